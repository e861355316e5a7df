"""Score texts with static, full dynamic or sparse dynamic evaluation (docs/algorithms.md §2-4).

The loop of fig. 4.1: split the text into segments of n tokens; score each segment with the current
parameters (those log-probs are the result), then take one gradient step on that segment's loss. The
hidden state is carried across segments and gradients stop at the segment start. Like
`models.scoring.score_bytes`, every text is preceded by the BOS token and every token is scored.

Static and sparse texts run through the one batched step the server runs (`batch_step`, with its guard: an
adapter whose scores blow up is reset and the segment redone); full mode steps a `FullStream` per text, whose
adapted weights are a private copy (the shared model is never written).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from models.adaptation._config import DynEvalConfig
from models.adaptation._full import FullStream, adapted_parameter_names, offline_memories
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import eval_mode, sparse_rule
from models.adaptation._step import STATIC_SEGMENT, Row, RuleCache, TextJob, batch_step
from models.base import LanguageModel, State
from models.copymodel import CopyModel
from models.memory import NoSettings
from models.scoring import LN2, ScoredText
from models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["EvalResult", "adapted_parameter_names", "evaluate", "evaluate_many", "split_documents"]



@dataclass(kw_only=True)
class EvalResult(ScoredText):
    mode: str
    logprobs: np.ndarray  # (tokens,) float64: natural-log probability of each token (a byte model's: each byte)
    params_adapted: int  # scalars that adapt (per stream)
    state_bytes: int  # bytes of adapted state per stream: full, the adapted weights; sparse, the M matrices
    seconds: float  # wall time of the whole call (shared by every text of an `evaluate_many` batch)
    skipped_updates: int = 0  # updates dropped by the non-finite guard
    adapter_resets: int = 0  # times an adapter (sparse) or the weights (full) whose scores blew up were reset to the
    # unadapted ones, the segment scored again
    adapted: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # final weights / M per site
    state: State | None = field(default=None, repr=False)  # final recurrent state (batch 1)


@dataclass
class _Stream:
    logprobs: torch.Tensor  # (T,)
    state: State
    adapted: dict[str, torch.Tensor]
    skipped: int = 0
    resets: int = 0


def split_documents(text: bytes, separator: bytes | None) -> list[bytes]:
    """Cut after every separator (which stays with the document it ends); empty pieces are dropped."""
    if separator is None:
        return [text]
    parts = text.split(separator)
    docs = [p + separator for p in parts[:-1]] + [parts[-1]]
    return [d for d in docs if d]


def _batched_streams(model: LanguageModel, docs: Sequence[bytes], config: DynEvalConfig,
                     rule: UpdateRule | None, sites: dict[str, int], tokenizer: Tokenizer,
                     copy: CopyModel | None = None) -> list[_Stream]:
    """Static or sparse evaluation of B streams at once, through `batch_step`; a finished text leaves the batch."""
    ref = next(model.parameters())
    memories = offline_memories(copy, config.cache)
    jobs = []
    for doc in docs:
        inputs, targets = tokenizer.stream(doc, None, ref.device)
        mats = {s: torch.zeros(k, k, dtype=ref.dtype, device=ref.device) for s, k in sites.items()} if rule else None
        row = Row(model.init_state(1), mats, rule,
                  memories={name: m.init(NoSettings(), ref.device) for name, m in memories.items()})
        jobs.append(TextJob(inputs, targets, [row]))
    segment = config.segment if rule is not None else STATIC_SEGMENT
    rules = RuleCache()
    while running := [job for job in jobs if not job.done]:
        batch_step(model, running, segment, rules, memories)
    out = []
    for job in jobs:
        row = job.rows[0]
        out.append(_Stream(torch.cat(row.logprobs), row.state, dict(row.mats or {}), row.dropped, row.resets))
    return out


def evaluate_many(model: LanguageModel, texts: Sequence[bytes], config: DynEvalConfig | None = None, *,
                  stats: Mapping[str, torch.Tensor] | None = None, max_streams: int = 64,
                  tokenizer: Tokenizer | None = None, copy: CopyModel | None = None) -> list[EvalResult]:
    """Score each text independently under `config` (static, full or sparse), with `copy` (a copy model,
    models/copymodel.py) mixed into every stream's scores when given.

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
    tokenizer = tokenizer or ByteTokenizer()
    # inference_mode(False): full and sparse need autograd even when the caller runs under inference mode
    with torch.inference_mode(False), eval_mode(model):
        if config.mode == "full":
            streams = []
            full = FullStream(model, config, stats, copy)  # one private copy of the weights, reset for each text
            for doc in docs:
                full.reset()
                inputs, targets = tokenizer.stream(doc, None, ref.device)
                lps = [full.step(inputs[None, i : i + config.segment], targets[None, i : i + config.segment])
                       for i in range(0, inputs.numel(), config.segment)]
                streams.append(_Stream(torch.cat(lps), full.state, full.adapted(), full.skipped, full.resets))
                params_adapted, state_bytes = full.params_adapted, full.state_bytes
        else:
            sites: dict[str, int] = {}
            rule = None
            if config.mode == "sparse":
                sites, rule = sparse_rule(model, config, stats)
                params_adapted = sum(k * k for k in sites.values())
                state_bytes = params_adapted * ref.element_size()
            streams = []
            for g in range(0, len(docs), max_streams):
                streams += _batched_streams(model, docs[g : g + max_streams], config, rule, sites, tokenizer, copy)
    seconds = time.perf_counter() - t0
    results = []
    for i in range(len(texts)):
        mine = [s for s, o in zip(streams, owner, strict=True) if o == i]
        lp = torch.cat([s.logprobs for s in mine]).double().cpu().numpy()
        results.append(EvalResult(mode=config.mode, bits=-float(lp.sum()) / LN2, bytes=len(texts[i]),
                                  tokens=int(lp.size), logprobs=lp,
                                  params_adapted=params_adapted, state_bytes=state_bytes, seconds=seconds,
                                  skipped_updates=sum(s.skipped for s in mine),
                                  adapter_resets=sum(s.resets for s in mine), adapted=mine[-1].adapted,
                                  state=mine[-1].state))
    return results


def evaluate(model: LanguageModel, text: bytes, config: DynEvalConfig | None = None, *,
             stats: Mapping[str, torch.Tensor] | None = None, tokenizer: Tokenizer | None = None,
             copy: CopyModel | None = None) -> EvalResult:
    """Score one text under `config`; see `evaluate_many`."""
    return evaluate_many(model, [text], config, stats=stats, tokenizer=tokenizer, copy=copy)[0]
