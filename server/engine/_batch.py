"""Batched text work: texts read segment by segment, many streams per model call (ALGORITHMS.md §2-3).

A `TextJob` is one text and the rows that read it: a static score has one row (no adapter); a session
score has one (the session's state and adapter, no update); a session observe has two, the session's
(score-then-update) and its unadapted shadow (scored only, for the static bits). `batch_step` takes the
next segment of every job it is given, stacks their rows into right-padded batches (adapters zero-padded
to the batch's largest size): the adapting rows into one forward, backward and update (`sparse_step`),
the rows that only score into one forward (`score_step`), so that they do not pay for the backward; then
it scatters each row's log-probs, state and adapter back. Rows of
different lengths are masked; a row whose text ends leaves with its job.

Non-finite guard: `sparse_step` refuses an update that would make a row's M or state non-finite (the row
keeps its last good values). An adapter can still be finite yet so large that the next segment's scores
overflow; then that row's M is reset to 0 and its job redoes the segment in the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.adaptation import DynEvalConfig, UpdateRule, score_step, sparse_step
from models.base import Adapter, LanguageModel, State

__all__ = ["Row", "RuleCache", "TextJob", "batch_step", "text_tensors"]


@dataclass(eq=False)
class Row:
    """One stream over a job's text. `mats` None: no adapter (M = 0); `rule` None: scored, never updated."""

    state: State  # batch 1
    mats: dict[str, torch.Tensor] | None = None  # site -> (k, k)
    rule: UpdateRule | None = None
    logprobs: list[torch.Tensor] = field(default_factory=list)  # (t,) per segment, natural log
    updates: int = 0
    dropped: int = 0  # updates the non-finite guard refused
    resets: int = 0  # times M was reset to 0 because the scores under it were not finite

    def total_logprob(self) -> float:
        return float(torch.cat(self.logprobs).double().sum()) if self.logprobs else 0.0


@dataclass(eq=False)
class TextJob:
    inputs: torch.Tensor  # (T,) int64: the byte before each target
    targets: torch.Tensor  # (T,) int64
    rows: list[Row]
    pos: int = 0  # bytes done

    @property
    def done(self) -> bool:
        return self.pos >= self.targets.numel()


def text_tensors(data: bytes, last_byte: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> inputs, targets (T,): every byte of `data` is predicted, the first one from `last_byte`."""
    targets = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device).long()  # (T,)
    return torch.cat([targets.new_tensor([last_byte]), targets[:-1]]), targets


class RuleCache:
    """The last batch's stacked update rule, reused while its rows keep their rules and adapter sizes: the
    common case, the same sessions stepping segment after segment (stacking costs 2 B K^2 writes)."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._rule: UpdateRule | None = None

    def stacked(self, rows: Sequence[Row], sites: Sequence[str], shapes: dict[str, tuple[int, ...]],
                dtype: torch.dtype, device: torch.device) -> UpdateRule:
        per_row = [(row.rule, {s: tuple(row.mats[s].shape) for s in sites})
                   if row.rule is not None and row.mats is not None else None for row in rows]
        # the rules themselves (compared by identity) are in the key, so they stay alive while it is cached
        key = (tuple((r[0], tuple(r[1].values())) if r is not None else None for r in per_row),
               tuple(shapes.items()), dtype, device)
        if key != self._key or self._rule is None:
            self._rule = UpdateRule.stack(per_row, shapes, dtype=dtype, device=device)
            self._key = key
        return self._rule


def _stacked_adapter(rows: Sequence[Row]) -> Adapter | None:
    return Adapter.stack_padded([Adapter({s: m.unsqueeze(0) for s, m in row.mats.items()})
                                 if row.mats is not None else None for row in rows])


def batch_step(model: LanguageModel, jobs: Sequence[TextJob], config: DynEvalConfig,
               rules: RuleCache | None = None) -> int:
    """Advance every job by one segment (`config.segment` bytes) in one batched call; -> rows in the batch."""
    rows = [row for job in jobs for row in job.rows]
    lengths = [min(config.segment, job.targets.numel() - job.pos) for job in jobs for _ in job.rows]
    n = max(lengths)
    ref = next(model.parameters())
    x = torch.zeros(len(rows), n, dtype=torch.long, device=ref.device)  # (B, n) right-padded
    y = torch.zeros_like(x)
    r = 0
    for job in jobs:
        t = min(config.segment, job.targets.numel() - job.pos)
        for _ in job.rows:
            x[r, :t] = job.inputs[job.pos : job.pos + t]
            y[r, :t] = job.targets[job.pos : job.pos + t]
            r += 1
    mask = torch.arange(n, device=ref.device).unsqueeze(0) < torch.tensor(lengths, device=ref.device).unsqueeze(1)
    sites = [s.name for s in model.adaptation_sites()]
    # Adapting rows take a forward and a backward; the others (static scores, peeks, observes' shadows) only a
    # forward, in a call of their own, so they do not pay for the backward.
    learn = [i for i, row in enumerate(rows) if row.rule is not None]
    keep = [i for i, row in enumerate(rows) if row.rule is None]
    lp_dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32  # as `log_softmax` gives them
    logprobs = torch.zeros(len(rows), n, dtype=lp_dtype, device=ref.device)  # (B, n)
    new_state: dict[int, State] = {}
    new_mats: dict[str, torch.Tensor] = {}
    learned_row: dict[int, int] = {}  # batch row -> its row in the adapting call
    failed = [False] * len(rows)
    if learn:
        part = [rows[i] for i in learn]
        index = torch.tensor(learn, device=ref.device)
        # zero-padded to the batch's largest k; `UpdateRule.stack` keeps the padding 0 through the update
        adapter = _stacked_adapter(part)
        assert adapter is not None
        shapes = {site: tuple(m.shape[1:]) for site, m in adapter.mats.items()}
        rule = (rules or RuleCache()).stacked(part, sites, shapes, ref.dtype, ref.device)
        step = sparse_step(model, x[index], y[index], mask[index], State.stack([r.state for r in part]), adapter, None,
                           config, rule=rule)
        logprobs[index] = step.logprobs.to(logprobs.dtype)
        for j, i in enumerate(learn):
            new_state[i] = step.state.select(j)
            failed[i] = bool(step.failed[j])
        new_mats = dict(step.adapter.mats)
        learned_row = {i: j for j, i in enumerate(learn)}
    if keep:
        part = [rows[i] for i in keep]
        index = torch.tensor(keep, device=ref.device)
        scored = score_step(model, x[index], y[index], mask[index], State.stack([r.state for r in part]),
                            _stacked_adapter(part))
        logprobs[index] = scored.logprobs.to(logprobs.dtype)
        for j, i in enumerate(keep):
            new_state[i] = scored.state.select(j)
    finite = torch.isfinite(logprobs).all(1).tolist()  # (B,)
    b = 0
    for job in jobs:
        mine = range(b, b + len(job.rows))
        b += len(job.rows)
        broken = [(row, row.mats) for i, row in zip(mine, job.rows, strict=True)
                  if not finite[i] and row.mats is not None and any(bool(m.any()) for m in row.mats.values())]
        if broken:  # scores overflowed under these adapters: reset them, keep the other rows, redo the segment
            for row, mats in broken:
                if mats is not None:
                    row.mats = {s: torch.zeros_like(m) for s, m in mats.items()}
                row.resets += 1
            continue
        for i, row in zip(mine, job.rows, strict=True):
            t = lengths[i]
            row.logprobs.append(logprobs[i, :t])
            row.state = new_state[i]
            if row.rule is not None and row.mats is not None:
                if failed[i]:
                    row.dropped += 1
                else:
                    row.updates += 1
                j = learned_row[i]
                row.mats = {s: new_mats[s][j, : row.mats[s].shape[0], : row.mats[s].shape[1]] for s in sites}
        job.pos += lengths[mine.start]
    return len(rows)
