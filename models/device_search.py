"""The keyboard's word search of many sessions at once, as tensors on the model's device: no host read a round.

`models.suggest.WordSearch` reads every round's next-byte log-probs back to the host (a device sync and B x V x 8
bytes) and runs its best-first queue in Python; with many typists on a GPU that, not the model, is the limit.
`DeviceSearches` runs the same search (the same completions, definitions in models/suggest.py's docstring) for all
its searches in one set of tensor operations a round:

- per search a *pool* of `pool` candidate branches, each a byte that extends a node: its cumulative log-prob
  (float64, as the host's), the node, the byte, the characters so far, the UTF-8 bytes its last character still
  needs, the state of that character (its lead byte while the second byte is due, for the second byte's range; the
  partial code point) and the leading-space flag;
- a *node table* (parent node, byte) of the branches expanded, node 0 the root (the context), from which the host
  rebuilds a completion's bytes once, at the end; the model's state after each node (`nodes` rows a search, written
  and read by index: a round gathers its rows' states from it and writes the new ones back) and its next-byte
  log-probs (for the cursors of the one-character continuations, `next_cursors`);
- the best completions found so far (log-prob, node).

A round, for every search at once: each search's best `w` branches (topk; `w` = `batch`, fewer when many searches
share `round_rows`, at least 4) leave the pool; their states are gathered and stepped in one batched model call
under each row's session adapter (`row_adapters`, as `models.suggest.step`); then on the device: the children's
cumulative log-probs, the masks of what may follow (`TokenClasses`: a character's start inside the `max_chars` room
after a whole character; after a lead byte only the second bytes it allows; a completed non-ASCII character kept
only if it is a word character, `is_word_char`, by a table of every code point), the floor log(min_prob), the word
end (`word_ends`, a logsumexp) and the new completions, and the children merged into the pool by topk.

Exactness. The host search returns the k most probable completions above the floor. Here, since a child is never
more probable than its parent, a search is *finished* when its k-th completion is at least as probable as the best
branch left in its pool (nothing is in flight between rounds), or its pool is empty. The pool's truncation may drop
branches: each search keeps the best log-prob it ever dropped, and a finished search is *certified* only if its k
completions are all at least that probable (every completion a dropped branch could lead to is then less probable);
so is one that ran out of nodes. A search neither certified nor cut ends with `Finished.overflow`: its caller runs
the host search instead (`SuggestRounds` does; counted in `overflows`). A search that reaches `max_expansions`, or
that its caller cuts (`cut`, a time budget), answers with the best completions it found, marked inexact unless it
had finished by then, as the host's budget cut does. Up to float rounding (the rows of another batch; the word
end's logsumexp), the answer is the host's, in its order (ties in log-prob aside, which the host orders by the order
made).

No host read a round: a round's done flags (one byte a search) are copied into pinned host memory without waiting
(`non_blocking`), and read behind a CUDA event after the next round has been queued (on a CPU at once), so the
device never waits for the host. A search that has ended is read once, the same way a round later: its completions,
its one-character continuations and its slice of the node table, all the searches the host learnt of in a round in
one transfer. `reads` and `bytes_read` count the device-to-host transfers. On a GPU a keystroke's answer thus comes
two rounds after its search ended (each a batched step of all the typists: a few ms) in exchange for a device that
never idles while the host reads; only a round with nothing to run waits.

What the host search also does and this one does not: reuse the rows the session's last keystroke expanded
(`WordSearch`'s `known`): a CPU saving (rows are cheap on a GPU, syncs are not). Models whose state changes shape
as it steps (a transformer's memories) or that keep a branch form (`LanguageModel.branch` with roots) cannot write
their states into fixed rows: `eligible` says no, and their searches run on the host.
"""

from __future__ import annotations

import functools
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models.base import Adapter, LanguageModel, State
from models.suggest import (
    _BYTES,
    SPACE,
    SUGGEST_MIN_PROB,
    Completion,
    Cursor,
    Suggestions,
    TokenClasses,
    _valid_prefix,
    row_adapters,
)

__all__ = ["DeviceSearches", "Finished", "Ineligible"]

# a pool entry's integer fields, one int64 tensor (..., FIELDS): gathered and merged with one index
PARENT, BYTE, CHARS, PENDING, LEAD, CODE, SPACED = range(7)
FIELDS = 7
CODE_POINTS = 0x110000


class Ineligible(ValueError):
    """The model's states cannot be kept in fixed rows (they change shape, or are in a branch form)."""


@dataclass
class Finished:
    """A device search's outcome, read as `_finish` reads a `WordSearch` (`next_cursors`, `expanded`, `result()`).
    `overflow`: not certified exact (module docstring): run the host search instead."""

    prefix: str
    completions: list[Completion]
    expansions: int
    model_calls: int
    exact: bool
    space_share: float
    overflow: bool
    classes: TokenClasses
    root_logprobs: torch.Tensor  # (V,) float64 on the host: the next-byte log-probs of the search's cursor
    next_cursors: dict[bytes, Cursor] = field(default_factory=dict)  # the model after each one-character continuation
    expanded: None = None  # no rows kept for the next keystroke (module docstring)

    def result(self) -> Suggestions:
        return Suggestions(self.prefix, self.completions, [], self.expansions, self.model_calls, self.exact,
                           self.space_share)


@dataclass
class _Tables:
    """What each byte is to the search, as tensors on the device."""

    starts: torch.Tensor  # (V,) bool: may follow a whole character inside a word (an ASCII word byte, a lead byte)
    follow: torch.Tensor  # (256, V) bool: row `lead`, the second bytes a lead byte allows; row 0x80, any later byte
    end_ids: torch.Tensor  # (E,) int64: the word-ending bytes
    more: torch.Tensor  # (V,) int64: continuation bytes a lead byte needs (0 otherwise)
    lead_bits: torch.Tensor  # (V,) int64: a lead byte's bits of the code point
    word_cp: torch.Tensor  # (0x110000,) bool: `is_word_char` of every code point
    ascii: torch.Tensor  # (V,) bool


@functools.cache
def _word_code_points() -> np.ndarray:
    """`models.suggest.is_word_char` of every code point (surrogates never complete: UTF-8 forbids them)."""
    cats = np.fromiter((unicodedata.category(chr(c))[0] in "LMN" for c in range(CODE_POINTS)), dtype=bool,
                       count=CODE_POINTS)
    cats[[ord(a) for a in "'\u2019"]] = True
    return cats


@functools.cache
def _second_bytes() -> np.ndarray:
    """(256, 256) bool: the bytes a lead byte allows next, by the host's own check (`_valid_prefix`)."""
    table = np.zeros((256, 256), dtype=bool)
    for lead in range(0xC2, 0xF5):
        table[lead] = [_valid_prefix(bytes([lead, b])) for b in range(256)]
    table[0x80, 0x80:0xC0] = True  # the third and fourth bytes: any continuation byte
    return table


def _tables(classes: TokenClasses, device: torch.device) -> _Tables:
    values = torch.arange(256)
    leads = (values >= 0xC2) & (values < 0xF5)
    more = torch.where(leads, torch.where(values < 0xE0, 1, torch.where(values < 0xF0, 2, 3)), 0)
    bits = torch.where(leads, values & torch.where(values < 0xE0, 0x1F, torch.where(values < 0xF0, 0x0F, 0x07)), 0)
    return _Tables(classes.starts.to(device), torch.from_numpy(_second_bytes()).to(device),
                   classes.ends.nonzero()[:, 0].to(device), more.to(device), bits.to(device),
                   torch.from_numpy(_word_code_points()).to(device), (values < 0x80).to(device))


def _upload(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device (pinned memory, `non_blocking`)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class _Pending:
    """A CPU stand-in for a CUDA event of a copy still in flight (`DeviceSearches`' `deferred`, for tests): never
    done until waited for, the slowest a device can be."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


_Event = torch.cuda.Event | _Pending


@dataclass
class _Results:
    """Ended searches' results on their way to the host."""

    slots: list[int]
    payload: torch.Tensor  # (e, ...) float64: on the host once `event` has passed (None: already there)
    event: _Event | None
    made: int  # `DeviceSearches.rounds` when it was asked for
    k: int  # the completions' columns then
    cursors: int


@dataclass
class _Slot:
    tag: Any
    prefix: str
    k: int
    adapter: Adapter | None
    cut: bool = False
    dropped: bool = False  # its caller wants no answer


class DeviceSearches:
    """Word searches of many sessions as tensors on the model's device (module docstring). `add` starts searches,
    `round` runs one batched round of all of them, `ended` hands back those the host has learnt have ended (their
    `Finished`), `cut` stops one early. A search's slot holds `nodes` states of the model (and as many next-byte
    distributions): `nodes` x (the state's row bytes + V x 4) bytes of device memory a search in progress."""

    def __init__(self, model: LanguageModel, classes: TokenClasses = _BYTES, *, min_prob: float = SUGGEST_MIN_PROB,
                 batch: int = 8, round_rows: int = 128, max_expansions: int = 2048, pool: int = 256,
                 nodes: int = 256, next_cursors: int = 8, slots: int = 8, deferred: bool | None = None) -> None:
        if classes.words.shape[0] != 256:
            raise Ineligible("the device search reads byte tokens (256)")
        if batch < 1 or pool < batch or nodes < 2 or not 0 < min_prob <= 1:
            raise ValueError("batch >= 1, pool >= batch, nodes >= 2 and min_prob in (0, 1]")
        self.model, self.classes = model, classes
        self.device = next(model.parameters()).device
        self.log_min = math.log(min_prob)
        self.batch, self.round_rows, self.max_expansions = batch, round_rows, max_expansions
        self.pool, self.nodes, self.n_cursors = pool, nodes, next_cursors
        self._t = _tables(classes, self.device)
        # copies to the host in flight, read behind events (None: on CUDA; on a CPU, True stands in for a slow device)
        self._deferred = self.device.type == "cuda" if deferred is None else deferred
        self._capacity = 0
        self._slots: dict[int, _Slot] = {}  # slot -> the search in it
        self._free: list[int] = []
        self._running: list[int] = []  # slots whose end the host has not learnt yet
        # done flags in transit: the slots, the searches in them then (a slot freed meanwhile may hold another)
        self._flags: list[tuple[list[int], list[_Slot], torch.Tensor, _Event | None]] = []
        self._ended: list[int] = []  # slots whose end the host has learnt, their results not yet asked for
        self._results: list[_Results] = []
        self._tags: dict[Any, int] = {}  # tag -> its slot
        self._idle = False  # the last round ran nothing: nothing is queued behind what is in transit
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self.states: dict[str, torch.Tensor] = {}  # per state tensor (slots, nodes + 1, ...): after each node
        self._alloc(slots)
        # measured: device-to-host transfers (each a sync), their bytes, rounds and model rows
        self.reads = self.bytes_read = self.rounds = self.rows = 0
        self.result_reads = self.result_bytes = 0  # of those, the reads of ended searches' results
        self.overflows = 0  # searches ended uncertified (their caller runs the host search)

    # -- buffers --------------------------------------------------------------------------------------------------

    def _alloc(self, capacity: int) -> None:
        """(Re)allocate every per-search buffer for `capacity` searches, keeping the first ones' contents."""
        old, d, N, P = self._capacity, self.device, self.nodes + 1, self.pool  # node N-1: where idle rows write
        f64, i64 = torch.float64, torch.int64

        def grow(t: torch.Tensor | None, fill: float | bool | int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
            new = torch.full((capacity, *shape), fill, dtype=dtype, device=d)
            if t is not None:
                new[:old] = t
            return new

        get = self.__dict__.get
        self.pool_lp = grow(get("pool_lp"), -math.inf, P, dtype=f64)
        self.pool_f = grow(get("pool_f"), 0, P, FIELDS, dtype=i64)
        self.node_link = grow(get("node_link"), 0, N, dtype=i64)  # parent * 256 + byte
        self.node_lp = grow(get("node_lp"), -math.inf, N, dtype=f64)
        self.node_one = grow(get("node_one"), False, N, dtype=torch.bool)  # a one-character continuation
        self.n_nodes = grow(get("n_nodes"), 1, dtype=i64)
        self.expansions = grow(get("expansions"), 0, dtype=i64)
        self.model_calls = grow(get("model_calls"), 0, dtype=i64)
        self.dropped = grow(get("dropped"), -math.inf, dtype=f64)  # the best log-prob the pool ever dropped
        self.out_of_nodes = grow(get("out_of_nodes"), False, dtype=torch.bool)
        self.cut_flag = grow(get("cut_flag"), False, dtype=torch.bool)
        self.done = grow(get("done"), False, dtype=torch.bool)
        self.max_chars = grow(get("max_chars"), 1, dtype=i64)
        self.k_index = grow(get("k_index"), 0, dtype=i64)  # k - 1
        self.space_share = grow(get("space_share"), 0.0, dtype=f64)
        K = max(1, get("_kcap", 8))
        self._kcap = K
        self.comp_lp = grow(get("comp_lp"), -math.inf, K, dtype=f64)
        self.comp_node = grow(get("comp_node"), 0, K, dtype=i64)
        self.lp_buf = grow(get("lp_buf"), 0.0, N, 256, dtype=torch.float32)
        if self._shapes is not None:
            self.states = {key: grow(self.states.get(key), 0, N, *shape, dtype=dtype)
                           for key, (shape, dtype) in self._shapes.items()}
        self._free += list(range(capacity - 1, old - 1, -1))
        self._capacity = capacity

    def _grow_k(self, k: int) -> None:
        extra = k - self._kcap
        self.comp_lp = torch.cat([self.comp_lp, self.comp_lp.new_full((self._capacity, extra), -math.inf)], 1)
        self.comp_node = torch.cat([self.comp_node, self.comp_node.new_zeros(self._capacity, extra)], 1)
        self._kcap = k

    def eligible(self, state: State) -> bool:
        """Can a search from `state` (a cursor's, batch 1) keep its states in this one's rows?"""
        state = self.model.branch(state)
        if state.roots or state.batch != 1:
            return False
        shapes = {k: (tuple(v.shape[1:]), v.dtype) for k, v in state.tensors.items()}
        return self._shapes is None or shapes == self._shapes

    # -- the searches ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def add(self, searches: Sequence[tuple[Any, Cursor, str, int, int, bool, Adapter | None]]) -> None:
        """Start searches: (tag, cursor, prefix, k, max_chars, space, adapter) each, as `WordSearch` takes them; the
        tag comes back with its `Finished`. Every cursor must be `eligible`. The root of each is expanded here."""
        if not searches:
            return
        tags = [s[0] for s in searches]
        if len(set(map(id, tags))) < len(tags) or any(t in self._tags for t in tags):
            raise ValueError("a search of this tag is in progress")
        for _, cursor, prefix, k, max_chars, space, _ in searches:
            if k < 1 or max_chars < 1:
                raise ValueError("k and max_chars must be >= 1")
            if space and prefix:
                raise ValueError("a word begins after a space only where nothing of it is typed")
            if not self.eligible(cursor.state):
                raise Ineligible("this state cannot be kept in the device search's rows")
        if self._shapes is None:
            first = self.model.branch(searches[0][1].state)
            self._shapes = {key: (tuple(v.shape[1:]), v.dtype) for key, v in first.tensors.items()}
            self.states = {key: torch.zeros(self._capacity, self.nodes + 1, *shape, dtype=dtype, device=self.device)
                           for key, (shape, dtype) in self._shapes.items()}
        if max(s[3] for s in searches) > self._kcap:
            self._grow_k(max(s[3] for s in searches))
        while len(self._free) < len(searches):
            self._alloc(2 * self._capacity)
        slots = [self._free.pop() for _ in searches]
        for slot, (tag, _, prefix, k, _, _, adapter) in zip(slots, searches, strict=True):
            self._slots[slot] = _Slot(tag, prefix, k, adapter)
            self._tags[tag] = slot
        d, n, V = self.device, len(slots), 256
        at = _upload(slots, torch.int64, d)
        # the root: node 0, its state and next-byte log-probs (V,) as the context's cursor has them
        for key, buf in self.states.items():
            rows = torch.cat([self.model.branch(c.state).tensors[key] for _, c, *_ in searches])  # (n, ...)
            buf[at, 0] = rows.to(buf.device, buf.dtype)
        lp = torch.stack([c.logprobs.to(d, torch.float64) for _, c, *_ in searches])  # (n, V)
        self.lp_buf[at, 0] = lp.float()
        # a slot is used again: nothing of its last search may stay (its pool above all, merged into below)
        for name, fill in (("pool_lp", -math.inf), ("node_lp", -math.inf), ("node_one", False),
                           ("comp_lp", -math.inf), ("done", False),
                           ("out_of_nodes", False), ("cut_flag", False), ("dropped", -math.inf)):
            getattr(self, name)[at] = fill
        self.node_lp[at, 0] = 0.0
        self.n_nodes[at] = 1
        self.expansions[at] = 1  # the root, as the host counts it
        self.model_calls[at] = 0
        self.max_chars[at] = _upload([s[4] for s in searches], torch.int64, d)
        self.k_index[at] = _upload([s[3] - 1 for s in searches], torch.int64, d)
        after_mark = _upload([s[5] for s in searches], torch.bool, d)  # (n,)
        # the root's children: a character's start (chars 0 < max_chars), and after a mark the space
        zeros = torch.zeros(n, 1, dtype=torch.int64, device=d)
        fields = self._children(zeros, zeros, zeros, zeros, zeros, zeros)  # (n, 1, V, FIELDS)
        total = lp.unsqueeze(1)  # (n, 1, V)
        keep = self._t.starts & (total >= self.log_min)  # (n, 1, V)
        cand_lp = torch.where(keep, total, -math.inf).view(n, V)
        cand_f = fields.view(n, V, FIELDS)
        spaced = lp[:, SPACE]  # (n,)
        space_f = torch.zeros(n, 1, FIELDS, dtype=torch.int64, device=d)
        space_f[:, 0, BYTE] = SPACE
        space_f[:, 0, SPACED] = 1
        space_lp = torch.where(after_mark & (spaced >= self.log_min), spaced, -math.inf).unsqueeze(1)  # (n, 1)
        all_lp = torch.cat([cand_lp, space_lp], 1)
        all_f = torch.cat([cand_f, space_f], 1)
        self._merge(at, all_lp, all_f)
        # the share of the space among the ways a word begins (`WordSearch.space_share`)
        direct = torch.logsumexp(lp.masked_fill(~self._t.starts, -math.inf), 1)
        share = torch.where(spaced > -math.inf, 1.0 / (1.0 + torch.exp(direct - spaced)), 0.0)
        self.space_share[at] = torch.where(after_mark, share, 0.0)
        self._running += slots

    def _children(self, chars: torch.Tensor, pending: torch.Tensor, lead: torch.Tensor, code: torch.Tensor,
                  spaced: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """The fields (..., V, FIELDS) of every byte's child of branches whose fields are given (...,) each; where
        the child cannot be (not a valid byte there), `_allowed` says so."""
        t, V = self._t, 256
        b = torch.arange(V, device=self.device)
        at_boundary = (pending == 0).unsqueeze(-1)  # (..., 1)
        c, p, cp = chars.unsqueeze(-1), pending.unsqueeze(-1), code.unsqueeze(-1)
        inner_p = (p - 1).clamp(min=0)
        inner_cp = (cp << 6) | (b & 0x3F)
        new_chars = torch.where(at_boundary, c + t.ascii.long(), c + (inner_p == 0).long())
        new_pending = torch.where(at_boundary, t.more, inner_p)
        new_lead = torch.where(at_boundary, torch.where(t.ascii, 0, b), torch.where(inner_p > 0, 0x80, 0))
        new_code = torch.where(at_boundary, t.lead_bits, torch.where(inner_p > 0, inner_cp, 0))
        shape = new_chars.shape
        return torch.stack([parent.unsqueeze(-1).expand(shape), b.expand(shape), new_chars, new_pending,
                            new_lead.expand(shape), new_code.expand(shape), spaced.unsqueeze(-1).expand(shape)], -1)

    def _allowed(self, f: torch.Tensor, max_chars: torch.Tensor) -> torch.Tensor:
        """(..., V) bool: which children may be, for branches whose fields are f (..., FIELDS) and whose searches'
        max_chars (...,): after a whole character, a character's start if there is room; inside one, what its lead
        byte allows, and a character completed only if it is a word character."""
        t, V = self._t, 256
        b = torch.arange(V, device=self.device)
        pending, lead, code = f[..., PENDING].unsqueeze(-1), f[..., LEAD], f[..., CODE].unsqueeze(-1)
        boundary = t.starts & (f[..., CHARS] < max_chars).unsqueeze(-1)
        inner = t.follow[lead.clamp(0, 255)]  # (..., V)
        completes = pending == 1
        cp = ((code << 6) | (b & 0x3F)).clamp(max=CODE_POINTS - 1)
        inner = inner & (~completes | t.word_cp[cp])
        return torch.where(pending == 0, boundary, inner)

    def _merge(self, at: torch.Tensor, cand_lp: torch.Tensor, cand_f: torch.Tensor) -> None:
        """Merge candidates (n, C) log-probs and (n, C, FIELDS) into the pools of searches `at` (n,): the best `pool`
        stay, and the best one dropped raises the search's `dropped`."""
        P = self.pool
        all_lp = torch.cat([self.pool_lp[at], cand_lp], 1)  # (n, P + C)
        all_f = torch.cat([self.pool_f[at], cand_f], 1)
        top = torch.topk(all_lp, P + 1, dim=1)  # sorted, best first
        keep = top.indices[:, :P]
        self.pool_lp[at] = top.values[:, :P]
        self.pool_f[at] = all_f.gather(1, keep.unsqueeze(-1).expand(-1, -1, FIELDS))
        self.dropped[at] = torch.maximum(self.dropped[at], top.values[:, P])

    @torch.inference_mode()  # buffers grown in `add` are inference tensors, written here from any mode (`drop`)
    def cut(self, tag: Any) -> None:
        """Stop the search of `tag` at the next round (a time budget): it ends with the best completions found."""
        slot = self._tags.get(tag)
        if slot is not None and not self._slots[slot].cut:
            self._slots[slot].cut = True
            self.cut_flag[slot] = True

    def drop(self, tag: Any) -> None:
        """Stop the search of `tag` without an answer (its slot is free once the host learns it has ended)."""
        self.cut(tag)
        slot = self._tags.get(tag)
        if slot is not None:
            self._slots[slot].dropped = True

    @property
    def running(self) -> int:
        """Searches whose end the host has not learnt yet."""
        return len(self._running)

    @property
    def busy(self) -> bool:
        """Searches running, or whose results have not been handed back by `ended` yet."""
        return bool(self._running or self._ended or self._results)

    @torch.inference_mode()
    def round(self) -> int:
        """One round of every running search (one batched model step); -> its rows (0: none ran)."""
        self._collect(wait=False)
        slots = list(self._running)
        self._idle = not slots
        if not slots:  # nothing to queue: wait for the flags in transit
            self._collect(wait=True, last=True)
            return 0
        d, V, P, N = self.device, 256, self.pool, self.nodes
        n = len(slots)
        w = min(self.batch, max(4, self.round_rows // n), P)
        at = _upload(slots, torch.int64, d)
        rank = torch.arange(w, device=d)
        pool_lp = self.pool_lp[at]  # (n, P)
        kth = self.comp_lp[at].gather(1, self.k_index[at].unsqueeze(1))  # (n, 1) the k-th completion so far
        sel = torch.topk(pool_lp, w, dim=1)  # (n, w)
        vals, idx = sel.values, sel.indices
        done = self.done[at] | self.cut_flag[at]
        budget = self.max_expansions - self.expansions[at]
        valid = (vals > kth) & ~done.unsqueeze(1) & (rank < budget.unsqueeze(1))  # a prefix of each row
        room = N - self.n_nodes[at]  # (n,)
        self.out_of_nodes[at] |= (valid & (rank >= room.unsqueeze(1))).any(1)
        valid &= rank < room.unsqueeze(1)
        node = torch.where(valid, self.n_nodes[at].unsqueeze(1) + rank, N)  # (n, w); idle rows write to node N
        self.pool_lp[at] = pool_lp.scatter(1, idx, torch.where(valid, -math.inf, vals))
        f = self.pool_f[at].gather(1, idx.unsqueeze(-1).expand(-1, -1, FIELDS))  # (n, w, FIELDS)
        # one model step for every row: the state after each branch's node, then its byte
        rows_at = at.unsqueeze(1).expand(n, w)
        state = State({key: buf[rows_at, f[..., PARENT]].reshape(n * w, *buf.shape[2:])
                       for key, buf in self.states.items()})
        x = f[..., BYTE].reshape(n * w, 1)
        adapter = row_adapters([self._slots[s].adapter for s in slots], [w] * n, self.model.grouped_adapters)
        out = self.model(x, state, adapter)
        lp_model = self.model.log_probs(out)[:, -1]  # (n w, V), the model's precision (at least float32)
        new = out.state
        if new.roots or {k: (tuple(v.shape[1:]), v.dtype) for k, v in new.tensors.items()} != self._shapes:
            raise Ineligible("the model's state changed shape in a step: it cannot be kept in fixed rows")
        for key, buf in self.states.items():
            buf[rows_at, node] = new.tensors[key].reshape(n, w, *buf.shape[2:])
        self.lp_buf[rows_at, node] = lp_model.float().view(n, w, V)
        # the nodes: their links, log-probs, and whether each is a one-character continuation
        self.node_link[rows_at, node] = f[..., PARENT] * 256 + f[..., BYTE]
        self.node_lp[rows_at, node] = torch.where(valid, vals, -math.inf)
        whole = f[..., PENDING] == 0
        one = whole & ((f[..., CHARS] == 1) | ((f[..., SPACED] == 1) & (f[..., CHARS] == 0)))
        self.node_one[rows_at, node] = one & valid
        expanded = valid.sum(1)
        self.n_nodes[at] += expanded
        self.expansions[at] += expanded
        self.model_calls[at] += (expanded > 0).long()
        # the completions: a word end after each node that ends a whole character of the word
        lp = lp_model.double().view(n, w, V)
        ends = torch.logsumexp(lp[..., self._t.end_ids], -1) + vals  # (n, w)
        complete = valid & whole & (f[..., CHARS] > 0) & (ends >= self.log_min)
        comp_lp = torch.cat([self.comp_lp[at], torch.where(complete, ends, -math.inf)], 1)
        comp_node = torch.cat([self.comp_node[at], node], 1)
        best = torch.topk(comp_lp, self._kcap, dim=1)
        self.comp_lp[at] = best.values
        self.comp_node[at] = comp_node.gather(1, best.indices)
        # the children, into the pool
        total = lp + vals.unsqueeze(-1)  # (n, w, V)
        keep = self._allowed(f, self.max_chars[at].unsqueeze(1)) & (total >= self.log_min) & valid.unsqueeze(-1)
        children = self._children(f[..., CHARS], f[..., PENDING], f[..., LEAD], f[..., CODE], f[..., SPACED], node)
        self._merge(at, torch.where(keep, total, -math.inf).view(n, w * V), children.view(n, w * V, FIELDS))
        # ended: finished (the k-th completion beats every branch left, or none is left), out of budget, out of
        # nodes, or cut
        kth = self.comp_lp[at].gather(1, self.k_index[at].unsqueeze(1)).squeeze(1)
        left = self.pool_lp[at, 0]  # the pool is sorted: its best branch
        # (NaN-proof: a search whose best branch is not a number ends, it cannot go on)
        ended = ~(left > kth) | (self.expansions[at] >= self.max_expansions) | self.out_of_nodes[at] \
            | self.cut_flag[at]
        self.done[at] = ended
        self._send_flags(slots, ended)
        self.rounds += 1
        self.rows += n * w
        self._collect(wait=True)
        self._request_results()
        return n * w

    def _send_flags(self, slots: list[int], ended: torch.Tensor) -> None:
        """Start copying a round's done flags to the host without waiting for them."""
        self._flags.append((slots, [self._slots[s] for s in slots], *self._to_host(ended)))

    def _to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, _Event | None]:
        """A copy of `t` on its way to the host (pinned memory, `non_blocking`) and the event after which it is
        there (None: it is there)."""
        if not self._deferred:
            return t.cpu(), None
        if self.device.type != "cuda":
            return t.clone(), _Pending()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return host, event

    def _collect(self, wait: bool, last: bool = False) -> None:
        """Read the done flags that have arrived; with `wait`, also those of every round but the last queued (their
        rounds are done by now, or nearly: the device is busy with the next one meanwhile), and with `last` that
        one's too."""
        keep: list[tuple[list[int], list[_Slot], torch.Tensor, _Event | None]] = []
        for i, (slots, searches, host, event) in enumerate(self._flags):
            newest = i == len(self._flags) - 1
            if event is not None and not event.query():
                if not wait or newest and not last:
                    keep.append((slots, searches, host, event))
                    continue
                event.synchronize()
            self.reads += 1
            self.bytes_read += host.numel()
            # a flag is its search's: the results of a search that ended may have been read (its slot freed, and
            # perhaps taken by a new search) before the flags of a later round that still name it
            ended = {slot for slot, search, flag in zip(slots, searches, host.tolist(), strict=True)
                     if flag and self._slots.get(slot) is search}
            if ended:
                still: list[int] = []
                for slot in self._running:  # one pass (a thousand searches: no list.remove each)
                    (self._ended if slot in ended else still).append(slot)
                self._running = still
        self._flags = keep

    def _request_results(self) -> None:
        """Start copying the results of the searches the host has learnt have ended to the host, without waiting for
        them (`ended` reads them): all of them in one transfer."""
        slots, self._ended = self._ended, []
        if not slots:
            return
        d, K, C = self.device, self._kcap, min(self.n_cursors, self.nodes + 1)
        at = _upload(slots, torch.int64, d)
        kth = self.comp_lp[at].gather(1, self.k_index[at].unsqueeze(1))  # (e, 1)
        cursors = torch.topk(self.node_lp[at].masked_fill(~self.node_one[at], -math.inf), C, dim=1)
        left = self.pool_lp[at, :1]
        flags = torch.cat([left, kth, self.dropped[at].unsqueeze(1), self.space_share[at].unsqueeze(1)], 1)
        counts = torch.stack([self.expansions[at], self.model_calls[at], self.out_of_nodes[at].long(),
                              self.cut_flag[at].long()], 1).double()
        # the root's next-byte log-probs ride along: the keystroke's next characters (`next_chars`) are read from them
        # on the host, not from the cursor on the device (a read that would wait for the rounds queued since)
        payload = torch.cat([self.comp_lp[at], self.comp_node[at].double(), cursors.values,
                             cursors.indices.double(), flags, counts, self.node_link[at].double(),
                             self.lp_buf[at, 0].double()], 1)
        self._results.append(_Results(slots, *self._to_host(payload), self.rounds, K, C))

    @torch.inference_mode()
    def ended(self) -> list[tuple[Any, Finished]]:
        """The searches whose results have reached the host, with their outcomes (their slots are then free). On a
        GPU a search's results are read a round after the host learnt that it ended, waiting only for what was queued
        before the last round (the device is busy with that one meanwhile); when no round runs, for everything."""
        self._request_results()
        out: list[tuple[Any, Finished]] = []
        waiting = []
        for r in self._results:
            if r.event is not None and not r.event.query():
                if r.made >= self.rounds and not self._idle:
                    waiting.append(r)
                    continue
                r.event.synchronize()
            out += self._read(r)
        self._results = waiting
        return out

    def _read(self, r: _Results) -> list[tuple[Any, Finished]]:
        N, K, C = self.nodes + 1, r.k, r.cursors
        payload = r.payload.tolist()
        self.reads += 1
        self.result_reads += 1
        size = r.payload.numel() * r.payload.element_size()
        self.bytes_read += size
        self.result_bytes += size
        out = []
        for slot, row in zip(r.slots, payload, strict=True):
            s = self._slots.pop(slot)
            self._free.append(slot)
            del self._tags[s.tag]
            if s.dropped:
                continue
            comp_lp, comp_node = row[:K], [int(v) for v in row[K:2 * K]]
            o = 2 * K
            cur_lp, cur_node = row[o:o + C], [int(v) for v in row[o + C:o + 2 * C]]
            o += 2 * C
            left_lp, kth_lp, dropped, share = row[o:o + 4]
            expansions, calls, out_of_nodes, cut = (int(v) for v in row[o + 4:o + 8])
            links = [int(v) for v in row[o + 8:o + 8 + N]]
            root = torch.tensor(row[o + 8 + N:], dtype=torch.float64)  # (V,)

            def data(node: int, links: list[int] = links) -> bytes:
                word = bytearray()
                while node:  # a parent is made before its children: its node is smaller
                    parent = links[node] >> 8
                    if not 0 <= parent < node:
                        raise RuntimeError("the device search's node table is corrupt")
                    word.append(links[node] & 0xFF)
                    node = parent
                return bytes(reversed(word))

            finished = not left_lp > kth_lp
            certified = dropped <= kth_lp and not out_of_nodes
            exact = finished and certified  # a cut that came after it finished takes nothing away
            overflow = not certified and not cut
            self.overflows += overflow
            completions = []
            for lp_, node in zip(comp_lp[: s.k], comp_node[: s.k], strict=True):
                if lp_ == -math.inf:
                    break
                word = data(node)
                spaced = word[:1] == bytes([SPACE])
                completions.append(Completion(s.prefix + (word[1:] if spaced else word).decode("utf-8"),
                                              math.exp(lp_), spaced))
            next_cursors = {}
            for lp_, node in zip(cur_lp, cur_node, strict=True):
                if lp_ == -math.inf:
                    break
                state = State({key: buf[slot, node:node + 1].clone() for key, buf in self.states.items()})
                next_cursors[data(node)] = Cursor(self.model.settle(state), self.lp_buf[slot, node].clone())
            out.append((s.tag, Finished(s.prefix, completions, expansions, calls, exact, share, overflow,
                                        self.classes, root, next_cursors)))
        return out

    def clear(self) -> None:
        """Forget every search (their callers answer them)."""
        self._free += list(self._slots)
        self._slots.clear()
        self._tags.clear()
        self._running, self._ended, self._flags, self._results = [], [], [], []
