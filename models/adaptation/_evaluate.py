"""Score texts with static, full dynamic or sparse dynamic evaluation (ALGORITHMS.md §2-4).

The loop of fig. 4.1: split the text into segments of n tokens; score each segment with the current
parameters (those log-probs are the result), then take one gradient step on that segment's loss. The
hidden state is carried across segments and gradients stop at the segment start. Like
`models.scoring.score_bytes`, every text is preceded by the BOS byte and every byte is scored.

Full mode never writes the model's weights: the adapted tensors are a private copy in a dict and every
forward runs through `torch.func.functional_call`, which binds them to the module for the duration of
that call only (so the model must not be used by another thread meanwhile: the engine's single worker
thread guarantees it) and restores the shared tensors afterwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call

from models.adaptation._cache import NeuralCache
from models.adaptation._config import DynEvalConfig
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import (
    adapter_ms_g,
    eval_mode,
    finite_rows,
    forward_rows,
    log_softmax,
    sparse_step,
)
from models.base import Adapter, LanguageModel, State
from models.scoring import BOS

__all__ = ["EvalResult", "adapted_parameter_names", "evaluate", "evaluate_many", "split_documents"]

LN2 = math.log(2.0)
_STATIC_CHUNK = 1024  # static scoring has no updates: long chunks, fewer calls


@dataclass
class EvalResult:
    mode: str
    bits: float
    bytes: int
    logprobs: np.ndarray  # (bytes,) float64: natural-log probability of each byte
    params_adapted: int  # scalars that adapt (per stream)
    state_bytes: int  # bytes of adapted state per stream: full, the adapted weights; sparse, the M matrices
    seconds: float  # wall time of the whole call (shared by every text of an `evaluate_many` batch)
    skipped_updates: int = 0  # updates dropped by the non-finite guard
    adapted: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # final weights / M per site
    state: State | None = field(default=None, repr=False)  # final recurrent state (batch 1)

    @property
    def bits_per_byte(self) -> float:
        return self.bits / self.bytes if self.bytes else float("nan")


@dataclass
class _Stream:
    logprobs: torch.Tensor  # (T,)
    state: State
    adapted: dict[str, torch.Tensor]
    skipped: int = 0


def split_documents(text: bytes, separator: bytes | None) -> list[bytes]:
    """Cut after every separator (which stays with the document it ends); empty pieces are dropped."""
    if separator is None:
        return [text]
    parts = text.split(separator)
    docs = [p + separator for p in parts[:-1]] + [parts[-1]]
    return [d for d in docs if d]


def adapted_parameter_names(model: LanguageModel, config: DynEvalConfig) -> list[str]:
    """Full mode: the parameters whose dotted name starts with a `params` prefix (all if none), minus `frozen`."""
    names = [n for n, _ in model.named_parameters()]

    def match(name: str, prefixes: Sequence[str]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    for prefix in (*config.params, *config.frozen):
        if not any(match(n, (prefix,)) for n in names):
            raise ValueError(f"no parameter matches {prefix!r}; parameters: {', '.join(names)}")
    chosen = [n for n in names if (not config.params or match(n, config.params)) and not match(n, config.frozen)]
    if not chosen:
        raise ValueError("the params/frozen settings leave no parameter to adapt")
    return chosen


def _encode(doc: bytes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.frombuffer(bytearray(doc), dtype=torch.uint8).to(device).long()  # (T,)
    return torch.cat([ids.new_tensor([BOS]), ids[:-1]]), ids  # inputs predict ids


def _pad(docs: Sequence[bytes], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> inputs, targets (B, Tmax) right-padded with 0, lengths (B,)."""
    T = max(len(d) for d in docs)
    inputs = torch.zeros(len(docs), T, dtype=torch.long, device=device)
    targets = torch.zeros_like(inputs)
    for b, doc in enumerate(docs):
        x, y = _encode(doc, device)
        inputs[b, : len(doc)], targets[b, : len(doc)] = x, y
    return inputs, targets, torch.tensor([len(d) for d in docs], device=device)


def _gather(log_dist: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return log_dist.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T, V) -> (B, T)


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return bool(finite_rows(list(tensors), 1).all())


def _full_stream(model: LanguageModel, doc: bytes, config: DynEvalConfig, rule: UpdateRule,
                 theta_g: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor]) -> _Stream:
    """One stream of full dynamic evaluation; the adapted weights are a private copy of `theta_g`."""
    inputs, targets = _encode(doc, theta_g[rule.names[0]].device)
    params = {n: p.clone() for n, p in theta_g.items()}
    state = model.init_state(1)
    cache = NeuralCache(config.cache) if config.cache else None
    lps, skipped, n = [], 0, config.segment
    for start in range(0, inputs.numel(), n):
        x, y = inputs[None, start : start + n], targets[None, start : start + n]  # (1, t)
        leaves = {k: p.requires_grad_(True) for k, p in params.items()}
        with torch.enable_grad():
            out = functional_call(model, {**fixed, **leaves}, (x, state))
            log_dist = log_softmax(out.logits)  # (1, t, V)
            lp = _gather(log_dist, y)  # (1, t) scored with the weights from before this segment's update
            grads = torch.autograd.grad(-lp.mean(), list(leaves.values()))
        if cache is not None:
            assert out.hidden is not None, "the neural cache needs Output.hidden"
            lp = _gather(cache.mix(log_dist.detach(), out.hidden, y), y)
        lps.append(lp.detach()[0])
        new = rule.step({k: p.detach() for k, p in params.items()}, dict(zip(leaves, grads, strict=True)), theta_g)
        new_state = out.state.detach()
        # guard, as in sparse_step: a non-finite state rewinds the segment; non-finite weights alone are
        # dropped and the state, which the old weights produced, stands
        state_ok = _all_finite(list(new_state.tensors.values()))
        if state_ok and _all_finite(list(new.values())):
            params = new
        else:
            params = {k: p.detach() for k, p in params.items()}
            skipped += 1
        if state_ok:
            state = new_state
    return _Stream(torch.cat(lps), state, params, skipped)


def _batched_streams(model: LanguageModel, docs: Sequence[bytes], config: DynEvalConfig,
                     ms_g: Mapping[str, torch.Tensor] | None, sites: dict[str, int]) -> list[_Stream]:
    """Static or sparse evaluation of B streams at once. Rows are sorted longest first, so the rows still
    running are always a prefix; a finished row leaves the batch."""
    ref = next(model.parameters())
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))
    inputs, targets, lengths = _pad([docs[i] for i in order], ref.device)
    B, T = inputs.shape
    sparse = config.mode == "sparse"
    n = config.segment if sparse else _STATIC_CHUNK
    state = model.init_state(B)
    adapter = Adapter.zeros(sites, B, dtype=ref.dtype, device=ref.device) if sparse else None
    rule = UpdateRule(config, list(sites), ms_g) if sparse else None
    cache = NeuralCache(config.cache) if config.cache else None
    logprobs = torch.zeros(B, T, dtype=torch.float64, device=ref.device)
    skipped = torch.zeros(B, dtype=torch.long, device=ref.device)
    finished: dict[int, tuple[State, dict[str, torch.Tensor]]] = {}
    rows = B

    def finish(upto: int) -> None:
        for r in range(upto, rows):
            mats = {k: m[r] for k, m in adapter.mats.items()} if adapter is not None else {}
            finished[r] = (state.select(r), mats)

    for start in range(0, T, n):
        active = int((lengths > start).sum())
        if active < rows:
            finish(active)
            rows, keep = active, slice(0, active)
            state = state.select(keep)
            adapter = adapter.select(keep) if adapter is not None else None
            if cache is not None:
                cache.select(keep)
        x, y = inputs[:rows, start : start + n], targets[:rows, start : start + n]  # (rows, t)
        seg_len = (lengths[:rows] - start).clamp(0, x.shape[1])  # (rows,)
        mask = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < seg_len.unsqueeze(1)  # (rows, t)
        if adapter is not None:
            step = sparse_step(model, x, y, mask, state, adapter, ms_g, config, rule=rule)
            log_dist, hidden, state, adapter = step.log_dist, step.hidden, step.state, step.adapter
            lp = step.logprobs
            skipped[:rows] += step.failed.long()
        else:
            with torch.no_grad():
                logits, hidden, state = forward_rows(model, x, seg_len, state, None)
            log_dist = log_softmax(logits)
            lp = _gather(log_dist, y)
        if cache is not None:
            assert hidden is not None, "the neural cache needs Output.hidden"
            lp = _gather(cache.mix(log_dist, hidden, y, mask), y)
        logprobs[:rows, start : start + x.shape[1]] = lp.double()
    finish(0)
    by_doc = {i: _Stream(logprobs[r, : len(docs[i])], *finished[r], int(skipped[r])) for r, i in enumerate(order)}
    return [by_doc[i] for i in range(len(docs))]


def evaluate_many(model: LanguageModel, texts: Sequence[bytes], config: DynEvalConfig | None = None, *,
                  stats: Mapping[str, torch.Tensor] | None = None, max_streams: int = 64) -> list[EvalResult]:
    """Score each text independently under `config` (static, full or sparse).

    `stats` are a checkpoint's MS_g statistics ("param.<name>", "adapter.<site>"), needed by the RMS rules.
    Sparse and static run up to `max_streams` streams in one batch; full runs one stream at a time.
    With `config.reset`, each document after a separator is scored as a fresh text (initial state after
    BOS, unadapted weights), exactly as if it were passed on its own.
    """
    config = config or DynEvalConfig()
    if not texts or any(not t for t in texts):
        raise ValueError("empty text: nothing to score")
    if max_streams < 1:
        raise ValueError(f"max_streams must be >= 1, not {max_streams}")
    t0 = time.perf_counter()
    ref = next(model.parameters())
    owner: list[int] = []
    docs: list[bytes] = []
    for i, text in enumerate(texts):
        pieces = split_documents(text, config.reset)
        docs += pieces
        owner += [i] * len(pieces)
    params_adapted = state_bytes = 0
    # inference_mode(False): full and sparse need autograd even when the caller runs under inference mode
    with torch.inference_mode(False), eval_mode(model):
        if config.mode == "full":
            names = adapted_parameter_names(model, config)
            all_params = dict(model.named_parameters())
            theta_g = {n: all_params[n].detach() for n in names}
            fixed = {n: p.detach() for n, p in all_params.items() if n not in theta_g}
            ms_g = None
            if stats is not None:
                ms_g = {n: stats[f"param.{n}"].to(ref.device, theta_g[n].dtype)
                        for n in names if f"param.{n}" in stats}
            rule = UpdateRule(config, names, ms_g)
            streams = [_full_stream(model, d, config, rule, theta_g, fixed) for d in docs]
            params_adapted = sum(p.numel() for p in theta_g.values())
            state_bytes = sum(p.numel() * p.element_size() for p in theta_g.values())
        else:
            sites: dict[str, int] = {}
            ms_g = None
            if config.mode == "sparse":
                sites = {s.name: config.adapter_units or s.dim for s in model.adaptation_sites()}
                if not sites:
                    raise ValueError(f"{type(model).__name__} has no adaptation sites: sparse mode needs one")
                for s in model.adaptation_sites():
                    if sites[s.name] > s.dim:
                        raise ValueError(f"adapter_units {sites[s.name]} exceeds site {s.name!r} of {s.dim} units")
                if stats is not None and config.rule in ("rms", "rms_decay"):
                    ms_g = {k: v.to(ref.device, ref.dtype) for k, v in adapter_ms_g(stats, sites).items()}
                params_adapted = sum(k * k for k in sites.values())
                state_bytes = params_adapted * ref.element_size()
            streams = []
            for g in range(0, len(docs), max_streams):
                streams += _batched_streams(model, docs[g : g + max_streams], config, ms_g, sites)
    seconds = time.perf_counter() - t0
    results = []
    for i in range(len(texts)):
        mine = [s for s, o in zip(streams, owner, strict=True) if o == i]
        lp = torch.cat([s.logprobs for s in mine]).double().cpu().numpy()
        results.append(EvalResult(mode=config.mode, bits=-float(lp.sum()) / LN2, bytes=lp.size, logprobs=lp,
                                  params_adapted=params_adapted, state_bytes=state_bytes, seconds=seconds,
                                  skipped_updates=sum(s.skipped for s in mine), adapted=mine[-1].adapted,
                                  state=mine[-1].state))
    return results


def evaluate(model: LanguageModel, text: bytes, config: DynEvalConfig | None = None, *,
             stats: Mapping[str, torch.Tensor] | None = None) -> EvalResult:
    """Score one text under `config`; see `evaluate_many`."""
    return evaluate_many(model, [text], config, stats=stats)[0]
