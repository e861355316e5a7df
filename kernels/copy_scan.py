"""The copy model's scan of its history (models/copymodel.py): one byte read by B streams, in one pass per stream.

For each stream b and history slot j, the suffix-match recurrence and what it predicts:

    match'[j] = [prev[j] == x] (1 + min(match[j], 254))      learning: prev = the history before x joined it
    counts[b, min(match'[j], K), cand[j]] += 1                 for match'[j] > 0 (orders 1..K by exact level)
    best[b] = max_j match'[j] * W + j                          the longest match, the most recent of them

`scan_ref` and `scan_frozen_ref` are the PyTorch reference of one byte (any device; models/copymodel.py builds its
reference step on them). `compiled()` gives two numba kernels that run a whole segment of a batch on CPU tensors,
the copy model's step fused (mixer update, scan, counts, features, mixture): `learn_segment` and `frozen_segment`.
The learning scan finds the slots whose byte is x with one vectorised compare and touches only those (the last
step's nonzero slots are cleared from their list), and log(count + alpha) comes from a table: about 25 us a byte
and stream with a 32 KB window, against ~500 us for the reference (tests/models/test_copymodel.py checks them
against it). The frozen scan, run for every branch of a keyboard search, reads the history through an index of
its slots by byte pair (`build_index`, made once per search) and touches only the slots that match 2 bytes or
more. Layout: `ext` (B, W + T) uint8 with the history of step t at [t + 1, t + 1 + W) and the one before at
[t, t + W) (the learning path's sliding window), `match` (B, W) uint8 updated in place, `valid_from` (B,) the first
slot holding a byte (a history still filling has empty slots before it, which never match); or, frozen (the
history does not take x), `hist` (S, W) and `fill` (S,) read through `index` (B,), and per row only the last bytes
it read, `ctx` (B, C) with `ctxlen` (B,) of them real: the match of the slot after each slot j whose byte is x is
1 + the bytes before j that agree with the bytes read before x.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["compiled", "scan_frozen_ref", "scan_ref"]

CAP = 254


def scan_ref(ext: torch.Tensor, t: int, match: torch.Tensor, x: torch.Tensor, valid_from: torch.Tensor,
             orders: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learning step (module docstring) -> (counts (B, K+1, 256) float32, best (B,) int64, -1 when no match);
    `match` is replaced in place."""
    B, W = match.shape
    old, new = ext[:, t : t + W], ext[:, t + 1 : t + 1 + W]  # (B, W)
    eq = torch.logical_not(old ^ x.to(torch.uint8).unsqueeze(1))  # (B, W)
    eq &= torch.arange(W, device=ext.device).unsqueeze(0) >= valid_from.unsqueeze(1)
    match.copy_((match.clamp(max=CAP) + 1).mul_(eq.view(torch.uint8)))
    return _predict_ref(new, match, orders)


def scan_frozen_ref(hist: torch.Tensor, fill: torch.Tensor, index: torch.Tensor, ctx: torch.Tensor,
                    ctxlen: torch.Tensor, orders: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen step (module docstring), after x joined `ctx` (B, C) (its last byte; `ctxlen` (B,) bytes of it are
    real): rows read hist[index[b]] (S, W); the match of the slot after each slot j whose byte is x is 1 + the
    bytes before j that agree with the bytes read before x. -> (counts (B, K+1, 256) float32, best (B,) int64)."""
    rows = hist[index]  # (B, W)
    B, W = rows.shape
    C = ctx.shape[1]
    start = (W - fill[index]).clamp(min=0)  # (B,)
    slots = torch.arange(W, device=hist.device)
    x = ctx[:, -1:]  # (B, 1)
    hit = (rows == x) & (slots >= start.unsqueeze(1)) & (slots < W - 1)  # (B, W)
    r, j = hit.nonzero(as_tuple=True)  # (n,)
    back = torch.arange(1, C, device=hist.device)  # (C-1,) how far back
    pos = j.unsqueeze(1) - back  # (n, C-1)
    agree = (rows[r.unsqueeze(1), pos.clamp(min=0)] == ctx[r.unsqueeze(1), C - 1 - back]) \
        & (pos >= start[r].unsqueeze(1)) & (back < ctxlen[r].unsqueeze(1))  # (n, C-1)
    m = 1 + agree.long().cumprod(1).sum(1)  # (n,)
    counts = torch.zeros(B, orders + 1, 256, device=hist.device)  # (B, K+1, 256)
    counts.index_put_((r, m.clamp(max=orders), rows[r, j + 1].long()), torch.ones_like(m, dtype=counts.dtype),
                      accumulate=True)
    best = torch.full((B,), -1, dtype=torch.long, device=hist.device)
    return counts, best.scatter_reduce(0, r, m * W + j + 1, "amax")


def _predict_ref(cand: torch.Tensor, match: torch.Tensor, orders: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, W = match.shape
    r, j = match.nonzero(as_tuple=True)  # (n,)
    length = match[r, j].long()  # (n,)
    counts = torch.zeros(B, orders + 1, 256, device=match.device)  # (B, K+1, 256)
    counts.index_put_((r, length.clamp(max=orders), cand[r, j].long()), torch.ones_like(length, dtype=counts.dtype),
                      accumulate=True)
    best = torch.full((B,), -1, dtype=torch.long, device=match.device)
    return counts, best.scatter_reduce(0, r, length * W + j, "amax")


@functools.cache
def _kernels() -> tuple[Any, Any, Any] | None:
    """The numba kernels, compiled at first use (cached on disk); None without numba."""
    try:
        import numba  # noqa: F401, PLC0415 (optional: the reference serves without it)
    except ImportError:
        return None
    from kernels import _copy_scan_jit as jit  # noqa: PLC0415

    return jit.learn_segment, jit.frozen_segment, jit.build_index


def compiled() -> tuple[Any, Any, Any] | None:
    """The whole-segment kernels (`learn_segment`, `frozen_segment`: the copy model's step fused, for CPU tensors;
    models/copymodel.py calls them and keeps its PyTorch code as the reference) and the pair index the frozen one
    reads (`build_index`), or None without numba."""
    return _kernels()
