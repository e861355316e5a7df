"""The one score-then-update step (thesis fig. 4.1; docs/algorithms.md §2-3), batched over streams.

Offline evaluation (`evaluate_many`), the server's engine and the keyboard simulator all run text through
`batch_step`. A `TextJob` is one text and the rows (streams) that read it; each `Row` has its own state,
adapter M (None: M = 0), update rule (None: scored only, never updated), optional neural cache, and counts of
what its guard did. `batch_step` takes the next segment of every job it is given, stacks their rows into
right-padded batches (adapters zero-padded to the batch's largest size): the adapting rows into one forward,
backward and update (`sparse_step`), the rows that only score into one forward (`score_step`), so that they do
not pay for the backward; then it scatters each row's log-probs, state and adapter back. A row whose text ends
leaves with its job.

A `resident` row's tensors (state, M, its memories' states) are rows of tables that outlive the step (the server's
session slots, server/engine/_slots.py): where every row of a batch is one row of the same table, the batch is
gathered from it by index (one copy per tensor, instead of one per row and a zero fill for the padding; a row's
views of the last step's batch are gathered the same way), and when its job is done, its results are written back
into those table rows in place, again by index (one write a job, not one a segment). The numbers are the same.

The guard, per row (thesis sec. 4.4 gives none; this is ours): `sparse_step` refuses an update that would make
a row's M or state non-finite (the row keeps its last good values, `dropped`). An adapter can still be finite
yet so large that the next segment's scores blow up: non-finite, or a mean loss over the segment above
`DIVERGED_BITS` bits a token (8x a uniform guess over bytes: no working model is that wrong on average over a
whole segment; an aggressive but sound step can reach 40-odd bits on one segment and recover, which the bound
leaves alone, while a runaway adapter reaches 1e9 and more). Then that row's M is reset to 0 (`resets`) and its
job redoes the segment in the next step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import score_step, sparse_step
from models.base import Adapter, LanguageModel, State
from models.memory import Memory

__all__ = ["DIVERGED_BITS", "STATIC_SEGMENT", "Row", "RuleCache", "TextJob", "batch_step", "usable_rows"]

STATIC_SEGMENT = 1024  # rows that only score take no steps: long segments, fewer calls
DIVERGED_BITS = 64.0  # mean bits per token over a segment beyond which an adapter counts as diverged
_FOLD = 64  # a row's step counts kept apart on the device before they are summed into one


@dataclass(eq=False)
class Row:
    """One stream over a job's text. `mats` None: no adapter (M = 0); `rule` None: scored, never updated."""

    state: State  # batch 1
    mats: dict[str, torch.Tensor] | None = None  # site -> (k, k)
    rule: UpdateRule | None = None
    # the row's distribution memories (models/memory.py) by name, mixed into its scores in the order of
    # `batch_step`'s `memories`; each learns from the segment
    memories: dict[str, Any] = field(default_factory=dict)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # (t,) per segment, natural log
    # its state, M and memories' tensors are its own storage (rows of resident tables, module docstring): when its
    # job is done, the step writes its results into them in place, and the row's tensors are those again
    resident: bool = False
    home: tuple[State, dict[str, torch.Tensor] | None, dict[str, Any]] | None = None  # a resident row's own, meanwhile
    # [updates, dropped, resets] as far as the host knows them, and the (3,) int64 counts of the steps since, still
    # on the device (M's update applied or refused, the memories' `Learned.steps`): read back when a count is read,
    # not once a step (on a GPU every read back waits for the device)
    _counts: list[int] = field(default_factory=lambda: [0, 0, 0], repr=False)
    _on_device: list[torch.Tensor] = field(default_factory=list, repr=False)

    # weight steps of M and of the distribution memories that take any (`Learned.steps`), one each a segment
    @property
    def updates(self) -> int:
        return self._read()[0]

    @property
    def dropped(self) -> int:
        """Updates the non-finite guard refused."""
        return self._read()[1]

    @property
    def resets(self) -> int:
        """Times M (or a memory's weights) was reset to 0 because the scores under it diverged."""
        return self._read()[2]

    def _read(self) -> list[int]:
        if self._on_device:
            pending = self._on_device[0] if len(self._on_device) == 1 else torch.stack(self._on_device).sum(0)
            self._counts = [a + b for a, b in zip(self._counts, pending.tolist(), strict=True)]
            self._on_device = []
        return self._counts

    def _count(self, counts: torch.Tensor) -> None:
        """Add a step's (3,) counts, on the device; folded into one tensor now and then (a long text's steps)."""
        self._on_device.append(counts)
        if len(self._on_device) >= _FOLD:
            self._on_device = [torch.stack(self._on_device).sum(0)]

    def total_logprob(self) -> float:
        return float(torch.cat(self.logprobs).double().sum()) if self.logprobs else 0.0


@dataclass(eq=False)
class TextJob:
    inputs: torch.Tensor  # (T,) int64: the token before each target (`Tokenizer.stream`)
    targets: torch.Tensor  # (T,) int64
    rows: list[Row]
    pos: int = 0  # tokens done

    @property
    def done(self) -> bool:
        return self.pos >= self.targets.numel()


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


def _to(values: list[int], device: torch.device) -> torch.Tensor:
    """Host integers to `device` without waiting for its queue (an index or lengths tensor of a step)."""
    return torch.tensor(values).to(device, non_blocking=True)


def _table_rows(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """(table, the row of each part) when every part is one whole row of the same contiguous table (N, ...), as a
    resident row's tensors are; else None."""
    table = parts[0]._base
    if table is None or table.dim() == 0 or not table.is_contiguous():
        return None
    size = table.stride(0)
    rows = []
    for p in parts:
        offset = p.storage_offset() - table.storage_offset()
        if p._base is not table or p.numel() != size or not p.is_contiguous() or offset % size:
            return None
        rows.append(offset // size)
    return table, rows


def _stacked_state(rows: Sequence[Row]) -> State:
    """The rows' states as one batch: gathered by index where each tensor's rows are rows of one table."""
    states = [row.state for row in rows]
    if not any(s.roots for s in states):
        out = {}
        for key in states[0].tensors:
            found = _table_rows([s.tensors[key] for s in states])
            if found is None:
                break
            table, index = found
            out[key] = table.index_select(0, _to(index, table.device))  # (B, ...)
        else:
            return State(out)
    return State.stack(states)


def _stacked_adapter(rows: Sequence[Row]) -> Adapter | None:
    if rows and all(row.mats is not None for row in rows):
        out = {}
        for site in rows[0].mats or {}:
            found = _table_rows([row.mats[site] for row in rows if row.mats is not None])
            if found is None:
                break
            table, index = found
            out[site] = table.index_select(0, _to(index, table.device))  # (B, k, k): no padding, all of one k
        else:
            return Adapter(out)
    return Adapter.stack_padded([Adapter({s: m.unsqueeze(0) for s, m in row.mats.items()})
                                 if row.mats is not None else None for row in rows])


def _write_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each value into its target in place (a resident row's tensors): one index_copy_ per table where the
    targets are rows of one table and the values rows of one batch, else one copy per row."""
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for target, value in pairs:
        if target is value:
            continue
        base, vbase = target._base, value._base
        groups.setdefault((id(base) if base is not None else id(target),
                           id(vbase) if vbase is not None else id(value)), []).append((target, value))
    for group in groups.values():
        to = _table_rows([t for t, _ in group]) if len(group) > 1 else None
        src = _table_rows([v for _, v in group]) if to is not None else None
        if to is None or src is None or src[0].shape[1:] != to[0].shape[1:] or src[0].dtype != to[0].dtype:
            for target, value in group:
                target.copy_(value.reshape(target.shape))
            continue
        (table, index), (batch, rows) = to, src
        source = batch if rows == list(range(batch.shape[0])) else batch.index_select(0, _to(rows, batch.device))
        table.index_copy_(0, _to(index, table.device), source)


def usable_rows(logprobs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B,) bool: a row's scores are usable, finite and on average no worse than DIVERGED_BITS a token over its
    `lengths` (B,) scored tokens (logprobs (B, T), zero beyond each row's length). The divergence guard's test."""
    bits = -logprobs.sum(1) / lengths.clamp(min=1).to(logprobs.dtype) / math.log(2.0)  # (B,) mean bits a token
    return torch.isfinite(logprobs).all(1) & (bits <= DIVERGED_BITS)


def batch_step(model: LanguageModel, jobs: Sequence[TextJob], segment: int, rules: RuleCache | None = None,
               memories: Mapping[str, Memory] | None = None) -> int:
    """Advance every job by one segment (`segment` tokens) in one batched call; -> rows in the batch. Rows with
    distribution memories score under the network mixed with them, in the order of `memories` (each memory's rows
    in one call), and each memory learns the segment; the adapters learn from the network's own scores, so that
    without memories a row scores exactly as the network does."""
    rows = [row for job in jobs for row in job.rows]
    for row in rows:
        if row.resident and row.home is None:  # its tables' rows, written when its job is done
            row.home = (row.state, row.mats, dict(row.memories))
    spans = [min(segment, job.targets.numel() - job.pos) for job in jobs]  # this step's tokens of each job
    lengths = [t for job, t in zip(jobs, spans, strict=True) for _ in job.rows]
    n = max(lengths)
    ref = next(model.parameters())
    x = torch.zeros(len(rows), n, dtype=torch.long, device=ref.device)  # (B, n) right-padded
    y = torch.zeros_like(x)
    r = 0
    for job, t in zip(jobs, spans, strict=True):
        for _ in job.rows:
            x[r, :t] = job.inputs[job.pos : job.pos + t]
            y[r, :t] = job.targets[job.pos : job.pos + t]
            r += 1
    length_t = _to(lengths, ref.device)  # (B,)
    mask = torch.arange(n, device=ref.device).unsqueeze(0) < length_t.unsqueeze(1)  # (B, n)
    sites = [s.name for s in model.adaptation_sites()]
    # Adapting rows take a forward and a backward; the others (static scores, peeks, observes' shadows) only a
    # forward, in a call of their own, so they do not pay for the backward.
    learn = [i for i, row in enumerate(rows) if row.rule is not None]
    keep = [i for i, row in enumerate(rows) if row.rule is None]
    lp_dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32  # as `log_probs` gives them
    logprobs = torch.zeros(len(rows), n, dtype=lp_dtype, device=ref.device)  # (B, n)
    new_state: dict[int, State] = {}
    new_mats: dict[str, torch.Tensor] = {}
    learned_row: dict[int, int] = {}  # batch row -> its row in the adapting call
    failed_t = torch.zeros(len(rows), dtype=torch.bool, device=ref.device)  # (B,) updates the guard refused
    cached: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # batch row -> (log_dist, hidden) (1, n, .)

    memories = memories or {}
    for row in rows:
        if unknown := set(row.memories) - set(memories):
            raise ValueError(f"rows with the memories {sorted(unknown)} need them in `memories`")

    def keep_dist(index: list[int], log_dist: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        for j, i in enumerate(index):
            if rows[i].memories:
                assert log_dist is not None
                cached[i] = (log_dist[j : j + 1], hidden[j : j + 1] if hidden is not None else None)

    if learn:
        part = [rows[i] for i in learn]
        index = _to(learn, ref.device)
        # zero-padded to the batch's largest k; `UpdateRule.stack` keeps the padding 0 through the update
        adapter = _stacked_adapter(part)
        assert adapter is not None
        shapes = {site: tuple(m.shape[1:]) for site, m in adapter.mats.items()}
        rule = (rules or RuleCache()).stacked(part, sites, shapes, ref.dtype, ref.device)
        step = sparse_step(model, x[index], y[index], mask[index], _stacked_state(part), adapter,
                           None, rule=rule, row_lengths=[lengths[i] for i in learn])
        logprobs[index] = step.logprobs.to(logprobs.dtype)
        failed_t[index] = step.failed
        for j, i in enumerate(learn):
            new_state[i] = step.state.select(j)
        new_mats = dict(step.adapter.mats)
        learned_row = {i: j for j, i in enumerate(learn)}
        keep_dist(learn, step.log_dist, step.hidden)
    if keep:
        part = [rows[i] for i in keep]
        index = _to(keep, ref.device)
        with_dist = any(row.memories for row in part)
        scored = score_step(model, x[index], y[index], mask[index], _stacked_state(part),
                            _stacked_adapter(part), keep_dist=with_dist, row_lengths=[lengths[i] for i in keep])
        logprobs[index] = scored.logprobs.to(logprobs.dtype)
        for j, i in enumerate(keep):
            new_state[i] = scored.state.select(j)
        keep_dist(keep, scored.log_dist, scored.hidden)
    # The guard's read back from the device, the one a step takes: per row, are its scores usable? (A row that is
    # not has its segment redone, which the host must know to set up the next step.) Only a row with an adapter M is
    # reset for it, so a batch without one (static scores, shadows, sessions without M) reads nothing back.
    usable: list[bool] = usable_rows(logprobs, length_t).tolist() if any(row.mats is not None for row in rows) \
        else [True] * len(rows)
    # what the guard did, per row: [update applied, refused, reset] of M and of the memories; kept on the device
    # and read when a row's counts are read (`Row.updates`), not here
    counts_t = torch.zeros(len(rows), 3, dtype=torch.int64, device=ref.device)  # (B, 3)
    counting = [row.rule is not None and row.mats is not None for row in rows]
    if learn:
        adapting = _to([int(c) for c in counting], ref.device).bool()  # (B,)
        counts_t[:, 0] = adapting & ~failed_t
        counts_t[:, 1] = adapting & failed_t
    # each memory's rows mixed in one call, memory after memory (their new states are kept only where the segment
    # stands, below)
    dists = {i: d for i, (d, _) in cached.items()}  # batch row -> (1, n, V) its distribution so far
    learned: dict[int, dict[str, Any]] = {}  # batch row -> its memories' states after the segment
    stepped: list[tuple[list[int], torch.Tensor]] = []  # (batch rows, their (b, 3) weight steps) of each memory
    for name, memory in memories.items():
        mine_rows = [i for i, row in enumerate(rows) if name in row.memories]
        if not mine_rows:
            continue
        index = _to(mine_rows, ref.device)
        hidden = None
        if memory.needs_hidden:
            parts = [cached[i][1] for i in mine_rows]
            if any(h is None for h in parts):
                raise ValueError(f"the {name} memory needs the model's hidden states (Output.hidden)")
            hidden = torch.cat([h for h in parts if h is not None])  # (b, n, H)
        mixed, after, steps = memory.learn(torch.cat([dists[i] for i in mine_rows]), x[index], y[index],
                                           mask[index], hidden, [rows[i].memories[name] for i in mine_rows])
        for j, i in enumerate(mine_rows):
            dists[i] = mixed[j : j + 1]
            learned.setdefault(i, {})[name] = after[j]
        if steps is not None:
            stepped.append((mine_rows, steps))
    # the memories' weight steps, counted with M's
    for mine_rows, steps in stepped:
        counts_t.index_add_(0, _to(mine_rows, ref.device), steps.to(counts_t.device, torch.int64))
        for i in mine_rows:
            counting[i] = True
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # resident rows' (own tensor, its new value)
    b = 0
    for job in jobs:
        mine = range(b, b + len(job.rows))
        b += len(job.rows)
        broken = [row for i, row in zip(mine, job.rows, strict=True)
                  if not usable[i] and row.mats is not None and any(bool(m.any()) for m in row.mats.values())]
        if broken:  # scores blew up under these adapters: reset them, keep the other rows, redo the segment
            for row in broken:
                assert row.mats is not None
                row.mats = {s: torch.zeros_like(m) for s, m in row.mats.items()}
                row._counts[2] += 1
            continue
        for i, row in zip(mine, job.rows, strict=True):
            t = lengths[i]
            lp = logprobs[i, :t]
            if i in learned:
                lp = dists[i][0, :t].gather(-1, y[i, :t].unsqueeze(-1))[:, 0].to(logprobs.dtype)
                row.memories = {**row.memories, **learned[i]}
            if counting[i]:
                row._count(counts_t[i])
            row.logprobs.append(lp)
            row.state = new_state[i]
            if row.rule is not None and row.mats is not None:
                j = learned_row[i]
                row.mats = {s: new_mats[s][j, : row.mats[s].shape[0], : row.mats[s].shape[1]] for s in sites}
        job.pos += lengths[mine.start]
        if job.done:
            for row in job.rows:
                if row.home is not None:
                    _go_home(row, writes)
    _write_rows(writes)
    return len(rows)


def _go_home(row: Row, writes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A resident row whose job is done: its results into its own tensors (`writes`), which are its tensors again.
    A memory's `State` is written into the row's own; any other state is taken as it is."""
    assert row.home is not None
    state, mats, memories = row.home
    writes += [(state.tensors[k], v) for k, v in row.state.tensors.items()]
    row.state = state
    if mats is not None and row.mats is not None:
        writes += [(mats[s], m) for s, m in row.mats.items()]
        row.mats = mats
    for name, learned in row.memories.items():
        mine = memories.get(name)
        if isinstance(learned, State) and isinstance(mine, State) and set(learned.tensors) == set(mine.tensors):
            writes += [(mine.tensors[k], v) for k, v in learned.tensors.items()]
        else:
            memories[name] = learned
    row.memories = memories
    row.home = None
