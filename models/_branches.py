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
the branches are query rows), each row's tail apart, under one softmax. Rows that each have a root of their own (one
generation, or several fed together) read their keys as one batch of (row, head) matrices instead (`row_attention`;
several roots stacked once into a copy, `RootStack`). A step is dispatch-bound at these models' sizes (hundreds of
small ops a byte), so what does not change from step to step is made once: per root its fills and its keys viewed by
head (`root_memo`), per step the tails' padding; a tail grows in place in a buffer with room (`grow`), and the
step's linears multiply a transposed copy of their weights (`dense`).

A row the form cannot step (its byte slides a window, or closes a segment the model does not close in the form; its
root's key/value cache is stale) takes the usual path alone: its root and tail settled (written into one usual-form
row), the usual forward, and its new state becomes a root of its own (`branch_forward`); the other rows step over
their roots as before. Several bytes at once, or a gradient, settle every row. (The compressive model closes a
segment in the form: the rows of a root that close it together get one new root holding the close, their tails
kept; models/compressive.py, `_close`.)

The arithmetic is the usual step's: the same scores and the same softmax, the values summed per part, so results
agree with the usual step to float rounding.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.base import ROOT, Adapter, LanguageModel, Output, State

__all__ = ["Group", "Parts", "RootStack", "append_tail", "branch_forward", "dense", "grow", "groups", "no_keys",
           "own_keys", "root_memo", "root_rows", "row_attention", "shared", "step_attention", "tail_padding",
           "tree_attention"]

# rows that share a root (an index (b,) into the batch, or a slice) and the root's keys and values, in parts in key
# order, each (H, L_i, Dh)
Group = tuple[torch.Tensor | slice, list[tuple[torch.Tensor, torch.Tensor]]]

# each layer's keys and values before the rows' tails, in parts in key order: (H, L_i, Dh) each for one root,
# (B*H, L_i, Dh) for rows of their own (`own_keys`)
Parts = list[list[tuple[torch.Tensor, torch.Tensor]]]

ROOM = 64  # the slots a tail's new buffer keeps free past it (`grow`)


class _ById:
    """A value kept for a tensor while it lives, by its identity (a plain dict keyed by `id`, its entry dropped when
    the tensor goes; `torch.utils.weak.WeakIdKeyDictionary` costs several microseconds a lookup, and a step makes a
    few dozen). A value must not hold the tensor, or what holds it, but weakly: the entry would keep it alive."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def get(self, t: torch.Tensor) -> Any:
        hit = self._d.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def put(self, t: torch.Tensor, value: Any) -> None:
        key = id(t)
        hit = self._d.get(key)
        ref = hit[0] if hit is not None and hit[0]() is t else weakref.ref(t, lambda _: self._d.pop(key, None))
        self._d[key] = (ref, value)


_GROWN = _ById()  # a tail buffer -> the slots written (`grow`)
_TRANSPOSED = _ById()  # a layer's weight -> (the layers' weights' and biases' versions and storage, the layers
# (weakly), their weights transposed side by side, their biases: `dense`)


def shared(t: torch.Tensor) -> bool:
    """All rows of `t` are one row: a batch of 1 or a stride-0 view of one (`State.take`'s of a batch of 1)."""
    return t.shape[0] == 1 or t.stride(0) == 0


def groups(state: State) -> list[tuple[torch.Tensor | slice, State]]:
    """The rows of a branch-form state by root, in the roots' order: (the rows, a slice where they are consecutive
    (all of them for one root), else an index; their root)."""
    if len(state.roots) == 1:
        return [(slice(None), state.roots[0])]
    ids = state.tensors[ROOT]
    rows: dict[int, list[int]] = {}
    for b, r in enumerate(ids.tolist()):
        rows.setdefault(r, []).append(b)
    return [(slice(b[0], b[-1] + 1) if b[-1] - b[0] + 1 == len(b) else torch.tensor(b, device=ids.device),
             state.roots[r]) for r, b in sorted(rows.items())]


def root_memo(root: State, make: Callable[[State], Any]) -> Any:
    """What `make` derives from a root's tensors (its fills, views of its keys and values by head), made at the first
    step over the root and kept with it (`State.memo`; a root never changes) for its later steps."""
    key = make.__qualname__
    if key not in root.memo:
        root.memo[key] = make(root)
    return root.memo[key]


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
    the oldest dropping: -> (B, L, ...), the last L of [mem_b ; tail_b[t - n_b:]]. Where every row appends as many
    (one row: a cursor a search hands out, a generation's state) that is one copy of two slices; otherwise a gather
    from the two concatenated (two copies)."""
    B, L = mem.shape[:2]
    t = tail.shape[1]
    if t == 0:
        return mem
    if bool((n == n[0]).all()) and int(n[0]) <= L:
        k = int(n[0])
        return torch.cat([mem[:, k:].expand(B, L - k, *mem.shape[2:]), tail[:, t - k :]], 1)  # (B, L, ...)
    ext = torch.cat([mem.expand(B, *mem.shape[1:]), tail], 1)  # (B, L + t, ...)
    s = torch.arange(L, device=mem.device).view(1, L) + n.view(B, 1)  # (B, L) place in [mem ; the valid tail]
    src = torch.where(s < L, s, s + (t - n).view(B, 1))  # (B, L) place in ext: the tail's padding skipped
    return ext.gather(1, src.view(B, L, *[1] * (ext.dim() - 2)).expand(B, L, *ext.shape[2:]))


def grow(tail: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """tail (B, t, ...) with new (B, ...) as its next slot -> (B, t+1, ...), the first t slots `tail`'s. A tail lives
    at the start of a buffer with room past it: where `tail` is its buffer's newest view (all its rows, and no longer
    view of the buffer was grown from it), `new` is written into the next slot and the longer view returned;
    otherwise (a tail that rows were taken or stacked from, an older state stepped again, a full buffer) the tail is
    copied into a new buffer with `ROOM` free slots. A step then writes its byte's slot instead of copying the whole
    tail, and nothing an older state shows is ever written."""
    t = tail.shape[1]
    buf = tail._base
    if not (buf is not None and _GROWN.get(buf) == t and t < buf.shape[1] and buf.shape[0] == tail.shape[0]
            and tail.data_ptr() == buf.data_ptr() and tail.stride() == buf.stride()):
        buf = tail.new_empty(tail.shape[0], t + 1 + ROOM, *tail.shape[2:])
        buf.narrow(1, 0, t).copy_(tail)
    buf.select(1, t).copy_(new)
    _GROWN.put(buf, t + 1)
    return buf.narrow(1, 0, t + 1)


def tail_padding(n: torch.Tensor, t: int) -> torch.Tensor | None:
    """The tails' padding (B, 1, t) bool, the first t - n (B,) slots of each row's tail (`tree_attention`'s
    `pad`); None where every row's tail is all valid (every row fed since its root alike: generation)."""
    if t == 0 or bool((n == t).all()):
        return None
    return (torch.arange(t, device=n.device).view(1, t) < (t - n).view(-1, 1)).unsqueeze(1)


def dense(layer: nn.Linear | tuple[nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a step's rows outside autograd, x (B, in) -> (B, out); several layers of one input at once,
    their outputs side by side. The weights are kept transposed and contiguous, (in, out), beside the layers, made
    again when a weight or bias changes (its version or its storage): at a few rows a CPU's matrix product against that
    layout takes 55-60% of the time of `F.linear`'s against (out, in) (192 -> 576 at one row: 7 against 12 us), and
    a step is mostly such products."""
    layers = layer if isinstance(layer, tuple) else (layer,)
    hit = _TRANSPOSED.get(layers[0].weight)
    key = [(t._version, t.data_ptr()) for lin in layers for t in (lin.weight, lin.bias) if t is not None]
    if hit is None or hit[0] != key or [ref() for ref in hit[1]] != list(layers):  # (modules compare by identity)
        wt = torch.cat([lin.weight.detach().t() for lin in layers], 1).contiguous()  # (in, out)
        bias = None if layers[0].bias is None else torch.cat([lin.bias.detach() for lin in layers])
        # the layers weakly: held here, a layer would keep its weight, and so this entry and its copy, alive for good
        hit = (key, tuple(weakref.ref(lin) for lin in layers), wt, bias)
        _TRANSPOSED.put(layers[0].weight, hit)
    return torch.addmm(hit[3], x, hit[2]) if hit[3] is not None else x @ hit[2]


class RootStack:
    """The keys and values of several roots, one row each (generations fed together: `Stepper.feed_many`), in one
    batch, so that a layer's attention is one matrix product for all rows (`row_attention`) instead of a few per root.
    A copy of the roots' keys and values, made when the same roots are stepped a second time in a row (generation
    steps them for many bytes; a keyboard search's first round, whose rows are the typists' cursors, never again) and
    kept while they are (identity; not keeping them alive); made again when they change (a row slid its window, closed
    a segment, or the batch changed). Roots asked for once in between (a search's first round between two generation
    steps) do not drop the stack made: only roots asked for twice in a row replace it."""

    def __init__(self) -> None:
        self._asked: tuple[weakref.ref[State], ...] = ()  # roots asked for once, not stacked (yet)
        self._roots: tuple[weakref.ref[State], ...] = ()  # the roots of the stack made
        self._made: tuple[int, Parts, torch.Tensor | None] | None = None  # their stack

    def _drop_asked(self, _: object) -> None:
        self._asked = ()

    def _drop_made(self, _: object) -> None:
        self._roots, self._made = (), None

    @staticmethod
    def _same(roots: tuple[State, ...], refs: tuple[weakref.ref[State], ...]) -> bool:
        return len(roots) == len(refs) and all(a is b() for a, b in zip(roots, refs, strict=True))

    def get(self, roots: tuple[State, ...], views: Callable[[State], Parts]
            ) -> tuple[int, Parts, torch.Tensor | None] | None:
        """roots (one per row, in the rows' order), `views(root)` each layer's keys and values of a root by head
        -> the most keys L, each layer's [(k, v)] (B*H, L, Dh), each row's right-aligned, and which of the L places
        are no keys (B, 1, 1, L) (None: none); None the first time these roots are asked for."""
        if self._made is not None and self._same(roots, self._roots):
            return self._made
        if not self._same(roots, self._asked):
            self._asked = tuple(weakref.ref(r, self._drop_asked) for r in roots)
            return None
        self._asked = ()
        self._roots = tuple(weakref.ref(r, self._drop_made) for r in roots)
        self._made = self._stack(roots, views)
        return self._made

    @staticmethod
    def _stack(roots: tuple[State, ...], views: Callable[[State], Parts]) -> tuple[int, Parts, torch.Tensor | None]:
        per_root = [views(r) for r in roots]
        sizes = [sum(k.shape[1] for k, _ in layers[0]) for layers in per_root]
        B, L = len(roots), max(sizes)
        ref = per_root[0][0][0][0]
        H, _, Dh = ref.shape
        stacked: Parts = []
        for i in range(len(per_root[0])):
            k, v = ref.new_zeros(B, H, L, Dh), ref.new_zeros(B, H, L, Dh)
            for b, layers in enumerate(per_root):
                end = L
                for pk, pv in reversed(layers[i]):  # right-aligned, the parts in key order
                    k[b, :, end - pk.shape[1] : end], v[b, :, end - pk.shape[1] : end] = pk, pv
                    end -= pk.shape[1]
            stacked.append([(k.view(B * H, L, Dh), v.view(B * H, L, Dh))])
        no_key = torch.arange(L, device=ref.device).view(1, L) < L - torch.tensor(sizes, device=ref.device).view(B, 1)
        return L, stacked, no_key.view(B, 1, 1, L) if bool(no_key.any()) else None


def own_keys(state: State, views: Callable[[State], Parts], stack: RootStack
             ) -> tuple[int, Parts, torch.Tensor | None] | None:
    """Where every row has a root of its own (a batch of 1, generations fed together), each layer's keys and values
    before the rows' tails, for `row_attention`: the most keys L, each layer's parts (B*H, L_i, Dh) in key order, and
    which of the L places are no keys (B, 1, 1, L) (None: none); None where rows share a root (a search:
    `tree_attention`), and at the first step of several roots (`RootStack`). `views(root)` gives a root's by head,
    (H, L_i, Dh) parts."""
    B = state.batch
    if len(state.roots) != B:
        return None
    if B == 1:
        layers = views(state.roots[0])
        return sum(k.shape[1] for k, _ in layers[0]), layers, None
    return stack.get(tuple(state.roots[r] for r in state.tensors[ROOT].tolist()), views)  # None: not yet stacked


def no_keys(root: torch.Tensor | None, tail: torch.Tensor | None, B: int, L: int, t: int) -> torch.Tensor | None:
    """The places of [root keys ; tail] (B, 1, 1, L + t) that are no keys (`row_attention`'s `no_key`), from the
    roots' padding (B, 1, 1, L) (`own_keys`) and the tails' (B, 1, t) (`tail_padding`), None where there is none;
    None where neither has any."""
    if root is None and tail is None:
        return None
    ref = root if root is not None else tail
    assert ref is not None
    root = root if root is not None else torch.zeros(B, 1, 1, L, dtype=torch.bool, device=ref.device)
    tail = tail.view(B, 1, 1, t) if tail is not None else root.new_zeros(B, 1, 1, t)
    return torch.cat([root.expand(B, 1, 1, L), tail], -1)


def row_attention(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], tk: torch.Tensor,
                  tv: torch.Tensor, no_key: torch.Tensor | None, scale: float, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One query per row and head over keys of the row's own, causal (every key precedes the query): q (B*H, 1, Dh)
    (with any content bias added); parts the keys and values before the rows' tails, (B*H, L_i, Dh) each in key
    order (`own_keys`); tk, tv (B*H, t, Dh) the tails'; no_key (B, 1, 1, L + t) the places that are no keys (a
    root's padding, a tail's) or None; bias (B*H, 1, L + t) added to the scores before scaling (relative positions).
    -> (B*H, 1, Dh): softmax(scale (q . k + bias)) v, in float32 for the softmax as `kernels.memory_attention_ref`."""
    s = torch.cat([*(torch.bmm(q, k.transpose(1, 2)) for k, _ in parts), torch.bmm(q, tk.transpose(1, 2))], -1)
    if bias is not None:
        s += bias
    s *= scale  # (B*H, 1, L + t)
    if no_key is not None:
        s.view(no_key.shape[0], -1, *s.shape[1:]).masked_fill_(no_key, -math.inf)
    p = torch.softmax(s if s.dtype == torch.float32 else s.float(), -1)
    p = p if p.dtype == tv.dtype else p.to(tv.dtype)
    L = s.shape[-1] - tk.shape[1]
    out = torch.bmm(p[..., L:], tv)  # (B*H, 1, Dh) the tails'
    start = 0
    for k, v in parts:
        if out.dtype == v.dtype:
            out.baddbmm_(p[..., start : start + k.shape[1]], v)  # the root's
        else:  # autocast made the tails' product bf16 from float32 keys; it casts no in-place op
            out = torch.baddbmm(out, p[..., start : start + k.shape[1]], v)
        start += k.shape[1]
    return out


def tree_attention(qc: torch.Tensor, roots: list[Group], tk: torch.Tensor, tv: torch.Tensor,
                   pad: torch.Tensor | None, scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over its root's keys and the row's own tail, causal (every key precedes the query).

    qc (B, H, Dh) the queries (with any content bias added); roots: every row's group (`Group`: the rows of one root
    and its keys and values, (H, L_i, Dh) parts in key order); tk, tv (B, H, t, Dh) each row's own keys and values
    after its root's, right-aligned, the valid ones last (the row's own key last), `pad` (B, 1, t) the others
    (`tail_padding`; None: all valid); bias (B, H, L + t) added to the scores before scaling (relative positions), L
    the most keys a root has: a row's root keys take the last of the first L places (those before are no keys).
    -> (B, H, Dh): softmax(scale (q . k + bias)) v over the row's valid keys, in float32 for the softmax as
    `kernels.memory_attention_ref`."""
    B = qc.shape[0]
    sizes = [sum(k.shape[1] for k, _ in parts) for _, parts in roots]
    L = max(sizes)
    one = len(roots) == 1 and roots[0][0] == slice(None)  # every row on one root: one matrix of queries per head
    if one:
        s_root = _cat([qc.transpose(0, 1) @ k.transpose(1, 2) for k, _ in roots[0][1]]).transpose(0, 1)  # (B, H, L)
    else:
        s_root = qc.new_full((B, qc.shape[1], L), -math.inf)
        for (rows, parts), Lg in zip(roots, sizes, strict=True):
            qh = qc[rows].transpose(0, 1)  # (H, b, Dh) a root's rows are one matrix of queries per head
            s_root[rows, :, L - Lg :] = _cat([qh @ k.transpose(1, 2) for k, _ in parts]).transpose(0, 1)
    s = torch.cat([s_root, (qc.unsqueeze(2) @ tk.transpose(2, 3)).squeeze(2)], -1)  # (B, H, L + t) root, tail
    if bias is not None:
        s += bias
    s *= scale
    if pad is not None:
        s[..., L:].masked_fill_(pad, -math.inf)
    p = torch.softmax(s if s.dtype == torch.float32 else s.float(), -1)  # (B, H, L + t)
    p = p if p.dtype == tv.dtype else p.to(tv.dtype)
    out = (p[..., L:].unsqueeze(2) @ tv).squeeze(2)  # (B, H, Dh) the tails'
    for (rows, parts), Lg in zip(roots, sizes, strict=True):
        pg = p[rows, :, L - Lg : L].transpose(0, 1)  # (H, b, Lg)
        start = 0
        for k, v in parts:
            part = (pg[..., start : start + k.shape[1]] @ v).transpose(0, 1)  # (b, H, Dh) the root's
            if isinstance(rows, slice):
                out[rows].add_(part)  # in place through the view
            else:
                out.index_add_(0, rows, part)
            start += k.shape[1]
    return out


def step_attention(q: torch.Tensor, tkv: torch.Tensor, own: list[tuple[torch.Tensor, torch.Tensor]] | None,
                   roots: list[Group] | None, no_key: torch.Tensor | None, pad: torch.Tensor | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention in a branch step: q (B, H, Dh) (any content bias added), tkv (B, t, 2D) the tails' keys
    and values ([k ; v]), over the rows' own roots' parts (`own`, (B*H, L_i, Dh): `row_attention`, with `no_key`) or
    their groups' (`roots`: `tree_attention`, with `pad`); bias (B, H, L + t) or None -> (B, D), heads concatenated."""
    B, H, Dh = q.shape
    t = tkv.shape[1]
    kv = tkv.view(B, t, 2, H, Dh).permute(2, 0, 3, 1, 4)  # (2, B, H, t, Dh)
    if own is not None:
        tk, tv = kv.reshape(2, B * H, t, Dh)  # (B*H, t, Dh) each
        rows_bias = None if bias is None else bias.reshape(B * H, 1, -1)
        return row_attention(q.reshape(B * H, 1, Dh), own, tk, tv, no_key, Dh**-0.5, rows_bias).view(B, H * Dh)
    assert roots is not None
    return tree_attention(q, roots, kv[0], kv[1], pad, Dh**-0.5, bias).view(B, H * Dh)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


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
