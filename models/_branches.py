"""Continuations of one shared state, stepped together without copying what they share (the transformers' branch
form, `LanguageModel.branch`).

A keyboard search expands many continuations of one context a byte at a time, and generation continues one state a
byte at a time. A transformer's state is its memory (1.6-1.8 MB a row, 5.3 MB with the compressive model's key/value
cache), so giving every branch its own copy of it and shifting that copy by a slot at every byte costs far more than
the model's arithmetic. In the branch form the state of every row is a shared root (the memories as they were, one
row viewed by all: a batch of 1 or a stride-0 view) and a short tail of its own: the inputs and keys/values of the
bytes it fed since, right-aligned, the last `memo.tail_n` of them valid. A step attends to the root's keys with the
queries of every row at once (one matrix product per head for all rows: the branches are query rows) and to each
row's tail apart, under one softmax; the root is never copied. A step the form cannot take (the rows do not share a
root, a segment or window boundary, more than one byte) settles the rows first: each row's root with its tail
written in, the model's usual state.

The arithmetic is the usual step's: the same scores and the same softmax, the values summed per part, so results
agree with the usual step to float rounding.
"""

from __future__ import annotations

import math

import torch

__all__ = ["append_tail", "shared", "tree_attention"]


def shared(t: torch.Tensor) -> bool:
    """All rows of `t` are one row: a batch of 1 or a stride-0 view of one (what `State.take` and `State.stack`
    keep for the branches of one state)."""
    return t.shape[0] == 1 or t.stride(0) == 0


def append_tail(mem: torch.Tensor, tail: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Each row's right-aligned memory mem (B, L, ...) with the last n (B,) entries of its tail (B, t, ...) appended,
    the oldest dropping: -> (B, L, ...), the last L of [mem_b ; tail_b[t - n_b:]]."""
    B, L = mem.shape[:2]
    t = tail.shape[1]
    if t == 0:
        return mem
    ext = torch.cat([mem.expand(B, *mem.shape[1:]), tail], 1)  # (B, L + t, ...)
    s = torch.arange(L, device=mem.device).view(1, L) + n.view(B, 1)  # (B, L) place in [mem ; the valid tail]
    src = torch.where(s < L, s, s + (t - n).view(B, 1))  # (B, L) place in ext: the tail's padding skipped
    return ext.gather(1, src.view(B, L, *[1] * (ext.dim() - 2)).expand(B, L, *ext.shape[2:]))


def tree_attention(qc: torch.Tensor, roots: list[tuple[torch.Tensor, torch.Tensor]], tk: torch.Tensor,
                   tv: torch.Tensor, n: torch.Tensor, scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over the shared root's keys and the row's own tail, causal (every key precedes the query).

    qc (B, H, Dh) the queries (with any content bias added); roots: parts of the root's keys and values, each
    (H, L_i, Dh), in key order; tk, tv (B, H, t, Dh) each row's own keys and values after the root's, right-aligned,
    the last n (B,) valid (the row's own key last); bias (B, H, L + t) added to the scores before scaling (relative
    positions; L the root's keys). -> (B, H, Dh): softmax(scale (q . k + bias)) v over the valid keys, in float32
    for the softmax as `kernels.memory_attention_ref`."""
    B, H, Dh = qc.shape
    t = tk.shape[2]
    qh = qc.transpose(0, 1)  # (H, B, Dh) the rows are one matrix of queries per head
    scores = [(qh @ k.transpose(1, 2)).transpose(0, 1) for k, _ in roots]  # (B, H, L_i) each
    scores.append((qc.unsqueeze(2) @ tk.transpose(2, 3)).squeeze(2))  # (B, H, t)
    s = torch.cat(scores, -1)  # (B, H, L + t)
    if bias is not None:
        s = s + bias
    s = s * scale
    if t:
        pad = torch.arange(t, device=qc.device).view(1, t) < (t - n).view(B, 1)  # (B, t) the tails' padding
        s[..., s.shape[-1] - t :] = s[..., s.shape[-1] - t :].masked_fill(pad.unsqueeze(1), -math.inf)
    p = torch.softmax(s.float(), -1).to(tv.dtype)  # (B, H, L + t)
    out = (p[..., s.shape[-1] - t :].unsqueeze(2) @ tv).squeeze(2)  # (B, H, Dh) the tails'
    start = 0
    for k, v in roots:
        L = k.shape[1]
        out = out + (p[..., start : start + L].transpose(0, 1) @ v).transpose(0, 1)  # (B, H, Dh) the root's
        start += L
    return out
