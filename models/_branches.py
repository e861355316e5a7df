"""Continuations of shared states, stepped together without copying what they share (the transformers' branch form,
`LanguageModel.branch`).

A keyboard search expands many continuations of one context a byte at a time, the server batches the searches of
many typists into one step, and generation continues one state a byte at a time. A transformer's state is its memory
(1.6-1.8 MB a row, 5.3 MB with the compressive model's key/value cache), so giving every branch its own copy of it
and shifting that copy by a slot at every byte costs far more than the model's arithmetic. In the branch form each
row is a root and a short tail of its own: the roots are usual-form states of one row, kept once in `State.roots`
(`tensors[ROOT]` names each row's), which row operations never copy; the tail is the inputs and keys/values of the
bytes the row fed since its root, right-aligned, the last `memo.tail_n` of them valid.

A step of one byte a row computes the rows' projections, MLPs and head as one batch, and their attention per root
(`tree_attention`): the queries of a root's rows read its keys in place (one matrix product per head for all of them:
the branches are query rows), each row's tail apart, under one softmax. A row the form cannot step (its byte closes a
segment or slides a window; its root's key/value cache is stale) takes the usual path alone: its root and tail
settled (written into one usual-form row), the usual forward, and its new state becomes a root of its own
(`branch_forward`); the other rows step over their roots as before. Several bytes at once, or a gradient, settle
every row.

The arithmetic is the usual step's: the same scores and the same softmax, the values summed per part, so results
agree with the usual step to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from models.base import ROOT, Adapter, LanguageModel, Output, State

__all__ = ["Group", "append_tail", "branch_forward", "groups", "root_rows", "shared", "tree_attention"]

# rows that share a root (an index (b,) into the batch, or a slice) and the root's keys and values, in parts in key
# order, each (H, L_i, Dh)
Group = tuple[torch.Tensor | slice, list[tuple[torch.Tensor, torch.Tensor]]]


def shared(t: torch.Tensor) -> bool:
    """All rows of `t` are one row: a batch of 1 or a stride-0 view of one (`State.take`'s of a batch of 1)."""
    return t.shape[0] == 1 or t.stride(0) == 0


def groups(state: State) -> list[tuple[torch.Tensor | slice, State]]:
    """The rows of a branch-form state by root: (the rows, an index or all of them, their root)."""
    if len(state.roots) == 1:
        return [(slice(None), state.roots[0])]
    ids = state.tensors[ROOT]
    return [(rows, state.roots[r]) for r in range(len(state.roots)) if len(rows := (ids == r).nonzero()[:, 0])]


def root_rows(state: State, name: str) -> torch.Tensor:
    """Each row's root's tensor `name` (B, ...): a stride-0 view for one root, else gathered (a copy per row: only
    for settling)."""
    parts = [r.tensors[name] for r in state.roots]
    B = state.tensors[ROOT].shape[0]
    if len(parts) == 1:
        return parts[0].expand(B, *parts[0].shape[1:])
    return torch.cat(parts).index_select(0, state.tensors[ROOT])


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


def tree_attention(qc: torch.Tensor, roots: list[Group], tk: torch.Tensor, tv: torch.Tensor, n: torch.Tensor,
                   scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over its root's keys and the row's own tail, causal (every key precedes the query).

    qc (B, H, Dh) the queries (with any content bias added); roots: every row's group (`Group`: the rows of one root
    and its keys and values, (H, L_i, Dh) parts in key order); tk, tv (B, H, t, Dh) each row's own keys and values
    after its root's, right-aligned, the last n (B,) valid (the row's own key last); bias (B, H, L + t) added to the
    scores before scaling (relative positions), L the most keys a root has: a row's root keys take the last of the
    first L places (those before are no keys). -> (B, H, Dh): softmax(scale (q . k + bias)) v over the row's valid
    keys, in float32 for the softmax as `kernels.memory_attention_ref`."""
    B, H, Dh = qc.shape
    t = tk.shape[2]
    sizes = [sum(k.shape[1] for k, _ in parts) for _, parts in roots]
    L = max(sizes)
    s = qc.new_full((B, H, L + t), -math.inf)
    for (rows, parts), Lg in zip(roots, sizes, strict=True):
        qh = qc[rows].transpose(0, 1)  # (H, b, Dh) a root's rows are one matrix of queries per head
        s[rows, :, L - Lg : L] = torch.cat([qh @ k.transpose(1, 2) for k, _ in parts], -1).transpose(0, 1)
    s[..., L:] = (qc.unsqueeze(2) @ tk.transpose(2, 3)).squeeze(2)  # (B, H, t) the tails'
    if bias is not None:
        s = s + bias
    s = s * scale
    if t:
        pad = torch.arange(t, device=qc.device).view(1, t) < (t - n).view(B, 1)  # (B, t) the tails' padding
        s[..., L:] = s[..., L:].masked_fill(pad.unsqueeze(1), -math.inf)
    p = torch.softmax(s.float(), -1).to(tv.dtype)  # (B, H, L + t)
    out = (p[..., L:].unsqueeze(2) @ tv).squeeze(2)  # (B, H, Dh) the tails'
    for (rows, parts), Lg in zip(roots, sizes, strict=True):
        pg = p[rows, :, L - Lg : L].transpose(0, 1)  # (H, b, Lg)
        start = 0
        for k, v in parts:
            out[rows] += (pg[..., start : start + k.shape[1]] @ v).transpose(0, 1)  # (b, H, Dh) the root's
            start += k.shape[1]
    return out


def branch_forward(model: LanguageModel, tokens: torch.Tensor, state: State, adapter: Adapter | None,
                   ready: Callable[[State], torch.Tensor],
                   step: Callable[[torch.Tensor, State, torch.Tensor | None], Output]) -> Output:
    """A transformer's forward in the branch form (the module docstring): `step(tokens (B, 1), state, the rows'
    adapter matrices or None)` for the rows `ready(state)` (B,) bool can step over their roots, the usual forward
    for the others, each of whose new state is a root of its own; -> the rows in their order."""
    if tokens.shape[1] != 1 or model.training or torch.is_grad_enabled():
        ok = torch.zeros(tokens.shape[0], dtype=torch.bool)
    else:
        ok = ready(state).cpu()  # (B,)
    mats = adapter.mats["resid"] if adapter is not None else None
    if bool(ok.all()):
        return step(tokens, state, mats)
    if not bool(ok.any()):
        out = model.forward(tokens, model.settle(state), adapter)
        return Output(out.logits, model.branch(out.state), out.aux, out.hidden)
    a, b = ok.nonzero()[:, 0].to(tokens.device), (~ok).nonzero()[:, 0].to(tokens.device)
    mine = step(tokens[a], state.take(a), _rows(mats, a))
    theirs = model.forward(tokens[b], model.settle(state.take(b)), Adapter({"resid": m}) if (m := _rows(mats, b))
                           is not None else None)
    back = torch.cat([a, b]).argsort()  # (B,) each row's place in [mine ; theirs]
    hidden = None if mine.hidden is None or theirs.hidden is None else torch.cat([mine.hidden, theirs.hidden])[back]
    return Output(torch.cat([mine.logits, theirs.logits])[back],
                  State.stack([mine.state, model.branch(theirs.state)]).take(back), {}, hidden)


def _rows(mats: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """Adapter matrices (B, k, k) of `rows`; one for every row (1, k, k) stays."""
    return mats if mats is None or mats.shape[0] == 1 else mats[rows]
