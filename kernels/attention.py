"""Memory attention: causal attention over [compressed memory; memory; current segment] (Compressive Transformer,
ALGORITHMS.md §7), with optional Transformer-XL relative terms (Dai et al. 2019, sec. 3.3).

Layout: q (B, H, Lq, D); k, v (B, H, Lk, D), Lk >= Lq, the last Lq keys are the queries' own positions.
Query i may attend key j iff j <= Lk - Lq + i (causal, aligned bottom-right: every memory slot is visible).
key_lengths (B,) int, optional: row b's valid keys are its LAST key_lengths[b] (memories are left-padded while a
session's memory fills up); key_lengths[b] >= Lq. Softmax scale default D**-0.5, applied to the whole score.
rel = (r, u, v_bias): r (Lr, H, D) sinusoidal encodings already projected, indexed by distance d = Lk - Lq + i - j
(Lr >= Lk), u and v_bias (H, D) the learned global biases:
    score(i, j) = scale * ((q_i + u) . k_j + (q_i + v_bias) . r[d])       Transformer-XL eq. (terms a-d)
-> out (B, H, Lq, D).

Known limits: the reference builds the (Lq, Lk) score matrix (the Triton kernel does not).
"""

from __future__ import annotations

import math

import torch

__all__ = ["memory_attention", "memory_attention_ref"]

Rel = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _allowed(Lq: int, Lk: int, key_lengths: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(B or 1, Lq, Lk) bool: the causal rule aligned bottom-right, and each row's left padding."""
    i = torch.arange(Lq, device=device).view(Lq, 1)
    j = torch.arange(Lk, device=device).view(1, Lk)
    allowed = (j <= Lk - Lq + i).unsqueeze(0)  # (1, Lq, Lk)
    if key_lengths is not None:
        allowed = allowed & (j >= Lk - key_lengths.view(-1, 1)).unsqueeze(1)  # (B, Lq, Lk)
    return allowed


def memory_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rel: Rel | None = None,
                         scale: float | None = None, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch reference (plain autograd). Layout in the module docstring."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    if rel is None:
        scores = q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
    else:
        r, u, vb = rel
        scores = (q + u.view(1, H, 1, D)) @ k.transpose(-1, -2)  # (B, H, Lq, Lk) content terms (a) + (c)
        pos = (q + vb.view(1, H, 1, D)) @ r[:Lk].permute(1, 2, 0)  # (B, H, Lq, Lk) (b) + (d), by distance d
        i = torch.arange(Lq, device=q.device).view(Lq, 1)
        j = torch.arange(Lk, device=q.device).view(1, Lk)
        dist = (Lk - Lq + i - j).clamp(min=0)  # (Lq, Lk) distance of key j from query i
        scores = scores + pos.gather(-1, dist.expand(B, H, Lq, Lk))  # pick column d for entry (i, j)
    scores = scores * scale
    allowed = _allowed(Lq, Lk, key_lengths, q.device).unsqueeze(1)  # (B or 1, 1, Lq, Lk)
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # (B, H, Lq, D)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: Rel | None,
           key_lengths: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected (B, H, L, D)")
    if k.shape[2] < q.shape[2]:
        raise ValueError("memory_attention needs Lk >= Lq (the keys end with the queries' own positions)")
    if rel is not None:
        r, u, vb = rel
        H, D = q.shape[1], q.shape[3]
        if r.dim() != 3 or r.shape[0] < k.shape[2] or r.shape[1:] != (H, D) or u.shape != (H, D) or vb.shape != (H, D):
            raise ValueError("rel = (r (Lr >= Lk, H, D), u (H, D), v_bias (H, D))")
    if key_lengths is not None and key_lengths.shape != (q.shape[0],):
        raise ValueError("key_lengths must have shape (B,)")


def memory_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rel: Rel | None = None,
                     scale: float | None = None, key_lengths: torch.Tensor | None = None,
                     impl: str | None = None) -> torch.Tensor:
    """Public op. `impl`: "triton" | "reference" (default: the implementation chosen at start)."""
    _check(q, k, v, rel, key_lengths)
    return memory_attention_ref(q, k, v, rel=rel, scale=scale, key_lengths=key_lengths)
