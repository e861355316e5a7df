"""Keyboard suggestions: completions of the word being typed and the most likely next characters.

Word completions follow Al-Rfou et al. 2019, figure 5 (docs/algorithms.md §9): expand byte continuations
best-first on their cumulative log-probability, stop a branch where the word ends, drop branches whose cumulative
probability falls below `min_prob` (0.001). Each round pops up to `batch` of the best branches and expands
them in one batched model step (B, 1), so a word of n characters costs about n model calls, not one per
branch.

Definitions (byte-level model, UTF-8 text):
- a *word character* is a Unicode letter, mark or number, or an apostrophe (' or ’); the word being typed
  is the longest run of word characters at the end of the context (an apostrophe that opens it is left out);
- a word *ends* at an ASCII byte that is not a word character (space, punctuation, newline, control). A
  completed non-ASCII character that is not a word character (— “ ” « …) stops the branch without a
  completion: `prob` counts only ASCII word ends, so it is exact for that definition;
- a completion adds at least one character (the typed word itself is not suggested: whether it ends here is
  the probability of the space and punctuation in `next_chars`) and at most `max_chars`; every character of
  it is complete, valid UTF-8 (a branch that produces an invalid sequence is dropped);
- `prob` = P(continuation, then a word end | context) = P(continuation bytes) x the summed probability of
  every ASCII word-ending byte after them; the completions are the k most probable, most probable first;
- *the next word after a mark* (`takes_space`): where nothing of the word is typed and the context ends in a
  character that is neither a word character nor whitespace (punctuation: "Hi," "Done."; a symbol or an emoji), the
  word may begin either directly ("(the") or after exactly one ASCII space (byte 0x20) that the keyboard inserts
  ("Hi, there", as a phone keyboard offers the next word there). Both kinds compete in the one search: the space is
  one more byte of a branch, so a spaced completion's `prob` is P(" ", then the word, then a word end | context),
  computed by the model as every other byte; it is marked `Completion.space_before` and its `text` leaves the
  space out. The model nearly always predicts the space after "Hi,": the words glued to the comma alone are
  fragments of tiny probability ("ought"). An empty context, one ending in whitespace, and a word with some of its
  characters typed keep the one kind (directly after the context).

Search exactness: a completion is emitted only when it is at the top of the priority queue and no popped
branch is still waiting for expansion, so (probabilities only shrink along a branch) the k completions are
the k most probable ones above `min_prob` (after a mark, of both kinds: the space is one more branch). A round
pops past a completion that must wait to the next branches, up to `batch`: expanding a branch early changes no
completion's place (its children are less probable than it), and a batched step costs about as much for a few
rows as for one, so the round does work that a later round would do, or that the next keystroke's search reads
(`WordSearch`'s `known`: the next letter's branches).
`max_expansions` bounds the work; a search cut by it returns the best completions it has found
(`Suggestions.exact` is then False).

Next characters: the top n bytes of the next-byte distribution that can start a character (ASCII or a
UTF-8 lead byte). A lead byte stands for every character it starts; it is decoded best effort to its most
likely character (greedy over the continuation bytes, batched: at most 3 more model calls), and `prob` is
that character's own probability.

The model must be in eval mode; nothing here changes the state or adapter it is given.
"""

from __future__ import annotations

import codecs
import functools
import heapq
import itertools
import math
import unicodedata
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from models.base import Adapter, LanguageModel, State
from models.tokenizer import ByteTokenizer

__all__ = [
    "APOSTROPHES", "SPACE", "SUGGEST_MIN_PROB", "Completion", "Cursor", "Expanded", "NextChar", "Suggestions",
    "TokenClasses",
    "WordSearch", "advance", "advance_many", "complete_word", "gather_rows", "is_word_char", "next_chars",
    "row_adapters", "split_word", "step", "suggest", "takes_space", "word_ends",
]

# word completions: branches below this cumulative probability are dropped (docs/algorithms.md §9)
SUGGEST_MIN_PROB = 1e-3

APOSTROPHES = frozenset("'\u2019")
SPACE = 0x20  # the one space a word after a mark may begin with (a byte token: ids are byte values)


@dataclass(frozen=True)
class TokenClasses:
    """What each token is to the word search, asked of the tokenizer (`token_bytes`): masks (V,) of the tokens
    that are an ASCII word character, that end a word (any other ASCII byte), that start a multibyte UTF-8
    character (C0, C1 are never valid), and that continue one. The search reads one byte a token; a tokenizer
    whose tokens are longer (words) needs a search of its own."""

    words: torch.Tensor
    ends: torch.Tensor
    leads: torch.Tensor
    tails: torch.Tensor

    @property
    def starts(self) -> torch.Tensor:
        """What may follow a complete character inside a word."""
        return self.words | self.leads

    # the same as numpy arrays, for the search's arithmetic on a few rows at a time (`_Search.expand`)
    @functools.cached_property
    def end_ids(self) -> np.ndarray:
        return self.ends.nonzero()[:, 0].numpy()

    @functools.cached_property
    def char_starts(self) -> tuple[torch.Tensor, int]:
        """The tokens that can start a character (V,) (ASCII or a UTF-8 lead byte), and how many there are."""
        starts = self.words | self.ends | self.leads
        return starts, int(starts.sum())

    @functools.cached_property
    def starts_np(self) -> np.ndarray:
        return self.starts.numpy()

    @functools.cached_property
    def tails_np(self) -> np.ndarray:
        return self.tails.numpy()

    @staticmethod
    @functools.cache
    def of(tokenizer: ByteTokenizer) -> TokenClasses:
        pieces = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
        if any(len(p) != 1 for p in pieces):
            raise ValueError(f"the word search reads one byte a token; the {tokenizer.kind} tokenizer's are longer")
        values = torch.tensor([p[0] for p in pieces])  # (V,)
        ascii_ = values < 0x80
        words = ascii_ & torch.tensor([chr(v).isalnum() or chr(v) in APOSTROPHES if v < 0x80 else False
                                       for v in values.tolist()])
        return TokenClasses(words=words, ends=ascii_ & ~words, leads=(values >= 0xC2) & (values < 0xF5),
                            tails=(values >= 0x80) & (values < 0xC0))


_BYTES = TokenClasses.of(ByteTokenizer())


def _more_bytes(lead: int) -> int:
    """How many continuation bytes follow a lead byte."""
    return 1 if lead < 0xE0 else 2 if lead < 0xF0 else 3


def is_word_char(ch: str) -> bool:
    return ch in APOSTROPHES or unicodedata.category(ch)[0] in "LMN"


def split_word(context: str) -> tuple[str, str]:
    """-> (everything before the word being typed, the word's typed prefix); the prefix may be empty."""
    i = len(context)
    while i > 0 and is_word_char(context[i - 1]):
        i -= 1
    while i < len(context) and context[i] in APOSTROPHES:  # an opening quote is not part of the word
        i += 1
    return context[:i], context[i:]


def takes_space(context: str) -> bool:
    """May the word after `context` begin after a space the keyboard inserts (module docstring)? Where nothing of
    it is typed and `context` ends in a character that is neither a word character nor whitespace."""
    return bool(context) and not context[-1].isspace() and not split_word(context)[1]


@dataclass(frozen=True)
class Completion:
    text: str  # the whole word: the typed prefix and the continuation, without the word end (nor a space before)
    prob: float  # P(continuation, then a word end | context); a spaced one's continuation starts with the space
    space_before: bool = False  # the word begins after a space the keyboard inserts (`takes_space`)


@dataclass(frozen=True)
class NextChar:
    char: str
    prob: float


@dataclass(frozen=True)
class Suggestions:
    prefix: str  # the typed part of the word the completions continue
    completions: list[Completion]
    next_chars: list[NextChar]
    expansions: int = 0  # branches expanded (model rows)
    model_calls: int = 0  # batched model steps
    exact: bool = True  # False if max_expansions cut the search
    space_share: float = 0.0  # `WordSearch.space_share`: 0 unless the word may begin after a space
    # of the expansions, those read from an earlier search's rows (`WordSearch`'s `known`); a word model's: the
    # model steps read from an earlier keystroke's (`word_suggestions`' `states`)
    reused: int = 0


@dataclass(frozen=True)
class Cursor:
    """The model after a context: the state after its last byte was fed, and the next byte's log-probs."""

    state: State  # batch 1
    logprobs: torch.Tensor  # (V,) float32, natural log


def _rows(adapter: Adapter | None, batch: int, grouped: bool = False) -> Adapter | None:
    """A batch-1 adapter for `batch` rows: repeated (a view: the same M for every branch), or with `grouped` (the
    model's `grouped_adapters`) the one matrix for all of them (`Adapter.counts`)."""
    if adapter is None or adapter.batch == batch:
        return adapter
    if grouped and adapter.mats:
        return Adapter(adapter.mats, adapter.memories, (batch,))
    return Adapter({k: m.expand(batch, -1, -1) for k, m in adapter.mats.items()},  # (B, k, k)
                   adapter.memories)  # every row reads the one session's memories (index None: view 0)


@torch.no_grad()
def advance(model: LanguageModel, state: State, inputs: bytes, adapter: Adapter | None = None) -> Cursor:
    """Feed `inputs` (batch 1) from `state`; the first input is the byte that follows the state (a session's
    `last_byte`, or the last byte of the context a cursor was made from)."""
    if not inputs:
        raise ValueError("nothing to feed")
    device = next(model.parameters()).device
    x = ByteTokenizer().encode_tensor(inputs, device).unsqueeze(0)  # (1, T)
    out = model(x, state, adapter)  # logits (1, T, V)
    return Cursor(out.state, model.log_probs(out)[0, -1])  # (V,)


@torch.no_grad()
def advance_many(model: LanguageModel, feeds: list[tuple[State, bytes, Adapter | None]]) -> list[Cursor]:
    """`advance` for many (state, inputs, adapter) at once (adapters of any size, or none): the rows of each input
    length run as one batched forward. -> a cursor per feed, in order."""
    device = next(model.parameters()).device
    out: list[Cursor | None] = [None] * len(feeds)
    by_length: dict[int, list[int]] = {}
    for i, (_, inputs, _) in enumerate(feeds):
        if not inputs:
            raise ValueError("nothing to feed")
        by_length.setdefault(len(inputs), []).append(i)
    for rows in by_length.values():
        x = torch.tensor([list(feeds[i][1]) for i in rows], dtype=torch.long, device=device)  # (B, T)
        state = State.stack([feeds[i][0] for i in rows])
        adapter = row_adapters([feeds[i][2] for i in rows], [1] * len(rows))
        result = model(x, state, adapter)  # logits (B, T, V)
        lps = model.log_probs(result)[:, -1]  # (B, V)
        for j, i in enumerate(rows):
            out[i] = Cursor(result.state.select(j), lps[j])
    return [c for c in out if c is not None]


def row_adapters(adapters: list[Adapter | None], rows: list[int], grouped: bool = False) -> Adapter | None:
    """Batch-1 adapters (or None: M = 0), adapter i repeated for rows[i] consecutive rows -> one (B, K, K) per site
    (a view when there is only one adapter); with `grouped` (the model's `grouped_adapters`) and adapters of one
    size, one matrix per adapter (S, k, k) and `Adapter.counts` (the stack kept while the same adapters come)."""
    if len(adapters) == 1:
        return _rows(adapters[0], rows[0], grouped)
    if all(a is None for a in adapters):
        return None
    given = [a for a in adapters if a is not None]
    if len(given) == len(adapters) and len({tuple(m.shape for m in a.mats.values()) for a in given}) == 1:
        if grouped and given[0].mats:
            return Adapter(_LAST_STACK.stack(given), counts=tuple(rows)).with_sessions(adapters, rows)
        stacked = Adapter.stack([Adapter({k: m.expand(n, -1, -1) for k, m in a.mats.items()})
                                 for a, n in zip(given, rows, strict=True)])
        return stacked.with_sessions(adapters, rows)  # the sessions' copy models and caches, one row each
    padded = Adapter.stack_padded(adapters)  # one row each, zero-padded to the largest size
    assert padded is not None
    index = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
    mats = {k: m.index_select(0, index.to(m.device)) for k, m in padded.mats.items()}
    return Adapter(mats).with_sessions(adapters, rows)


class _Stacked:
    """The last adapters stacked one matrix each (`row_adapters`, grouped), kept while the next call's are the same
    tensors, unchanged: the rounds of the same typists' searches stack their sessions' matrices once. Holds the last
    adapters' tensors (a few sessions' matrices) until another call."""

    def __init__(self) -> None:
        self._last: tuple[list[tuple[torch.Tensor, int]], dict[str, torch.Tensor]] | None = None

    def stack(self, adapters: list[Adapter]) -> dict[str, torch.Tensor]:
        key = [(m, m._version) for a in adapters for m in a.mats.values()]
        last = self._last
        if last is not None and len(last[0]) == len(key) \
                and all(t is u and v == w for (t, v), (u, w) in zip(last[0], key, strict=True)):
            return last[1]
        stacked = {k: torch.cat([a.mats[k] for a in adapters]) for k in adapters[0].mats}  # (S, k, k)
        self._last = (key, stacked)
        return stacked


_LAST_STACK = _Stacked()


class Expanded(NamedTuple):
    """The model after a search's branch (its bytes fed): row `row` of `state` (the search's batch, in the model's
    branch form), the next byte's log-probs (V,) float64 (numpy) and the probability of a word end there
    (`TokenClasses.ends`), log. What a word search computed, for the next keystroke's to take up (`WordSearch`'s
    `known`)."""

    state: State
    row: int
    logprobs: np.ndarray
    ends: float


@dataclass(eq=False, slots=True)
class _Branch:
    data: bytes  # the continuation so far
    chars: int  # complete characters in it
    pending: int  # continuation bytes its last character still needs
    states: State  # row `row` of it is the state before data[-1] is fed (a batch shared with its siblings)
    row: int
    logprob: float
    space: bool = False  # data starts with the space before the word (not one of its characters)
    rest: _Siblings | None = None  # its siblings after it, queued when it is popped (`_Search`)


@dataclass(eq=False, slots=True)
class _Siblings:
    """The children of one branch that ends a character, best first, not yet in the queue: each is queued when the
    one before it is popped (`_Search`)."""

    parent: _Branch
    states: State
    row: int
    tokens: list[int]
    logprobs: list[float]
    orders: list[int]
    next: int = 1  # the first not yet queued

    def child(self, j: int) -> _Branch:
        parent, b = self.parent, self.tokens[j]
        chars, pending = (parent.chars + 1, 0) if b < 0x80 else (parent.chars, _more_bytes(b))
        return _Branch(parent.data + bytes((b,)), chars, pending, self.states, self.row, self.logprobs[j],
                       parent.space, self if j + 1 < len(self.tokens) else None)


def _sources(branches: list[_Branch]) -> tuple[list[_Branch], list[tuple[State, list[int]]]]:
    """The branches grouped by the batch their states are rows of -> (the branches in that order, (the batch, its
    rows) for each group)."""
    groups: dict[int, tuple[State, list[_Branch]]] = {}
    for b in branches:
        groups.setdefault(id(b.states), (b.states, []))[1].append(b)
    ordered = [b for _, members in groups.values() for b in members]
    return ordered, [(states, [b.row for b in members]) for states, members in groups.values()]


def gather_rows(sources: list[tuple[State, list[int]]]) -> State:
    """The rows of several batches, in order, as one batch (B, ...): where none is in a branch form and their
    tensors are alike, one concatenation and one index_select per tensor (a round of many searches takes a few rows
    of dozens of batches); otherwise one `State.take` per batch, then `State.stack`, which keep what rows share (the
    branch form's roots, a row repeated as a view) shared."""
    if len(sources) == 1:
        states, rows = sources[0]
        return states.take(torch.tensor(rows, device=states.batch_device()))
    first = sources[0][0].tensors
    if not any(s.roots for s, _ in sources) and all(
            s.tensors.keys() == first.keys() and all(
                v.shape[1:] == first[k].shape[1:] and v.dtype == first[k].dtype for k, v in s.tensors.items())
            for s, _ in sources[1:]):
        index, offset = [], 0
        for states, rows in sources:
            index += [offset + r for r in rows]
            offset += states.batch
        at = torch.tensor(index, device=sources[0][0].batch_device())
        return State({k: torch.cat([s.tensors[k] for s, _ in sources]).index_select(0, at) for k in first})
    return State.stack([s.take(torch.tensor(rows, device=s.batch_device())) for s, rows in sources])


@torch.no_grad()
def step(model: LanguageModel, state: State, tokens: list[int],
         adapter: Adapter | None) -> tuple[State, torch.Tensor]:
    """One batched step: row i feeds tokens[i] from row i of `state`, under `adapter` (batch 1: every row, or one
    matrix per row). -> new states (B, ...), log-probs (B, V) float64 on the CPU."""
    device = next(model.parameters()).device
    x = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)  # (B, 1)
    out = model(x, state, _rows(adapter, len(tokens), model.grouped_adapters))  # logits (B, 1, V)
    return out.state, model.log_probs(out)[:, -1].double().cpu()  # (B, V)


def _valid_prefix(data: bytes) -> bool:
    """Can `data` (whole characters, then possibly part of one) still be valid UTF-8?"""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


@dataclass
class _Search:
    """The priority queue of a word completion: branches and completions by cumulative log-probability, ties by the
    order they were made in.

    The children of a branch that ends a character (nearly every branch: the search's Python work is in them) are
    queued one at a time, best first (`_Siblings`): a child is queued when the sibling before it is popped. No child
    can be the queue's best before the siblings before it are popped (they are at least as probable and made
    earlier), so the queue pops the same items in the same order as with every child queued at once, while most
    children, which are never popped, are never made."""

    prefix: str
    max_chars: int
    log_min: float
    classes: TokenClasses
    queue: list[tuple[float, int, _Branch | Completion]] = field(default_factory=list)
    order: int = 0  # the next item's place in the order made
    expansions: int = 0
    model_calls: int = 0

    def push(self, logprob: float, item: _Branch | Completion) -> None:
        heapq.heappush(self.queue, (-logprob, self.order, item))
        self.order += 1

    def pop(self) -> _Branch | Completion:
        """The best item; a branch's next sibling takes its place in the queue."""
        item = self.queue[0][2]
        rest = item.rest if isinstance(item, _Branch) else None
        if rest is None:
            heapq.heappop(self.queue)
        else:
            j = rest.next
            rest.next += 1
            heapq.heapreplace(self.queue, (-rest.logprobs[j], rest.orders[j], rest.child(j)))
        return item

    def expand(self, branches: list[_Branch], state: State | list[Expanded], lp: np.ndarray,
               ends: np.ndarray) -> None:
        """Push the children and completions of `branches`, whose next-byte log-probs are `lp` (B, V) float64
        (numpy: a few rows' arithmetic costs microseconds where torch's costs tens), the log-probability of a word
        end after each `ends` (B,) (`word_ends`), and whose states after their last byte are the rows of `state`
        (or, one each, where `state` says)."""
        self.expansions += len(branches)
        classes = self.classes
        cum = np.array([b.logprob for b in branches])  # (B,)
        total = lp + cum[:, None]  # (B, V)
        ends = ends + cum  # (B,) the word ends after each branch
        at_boundary = np.array([b.pending == 0 for b in branches])  # (B,)
        room = np.array([b.chars < self.max_chars for b in branches])  # (B,)
        allowed = np.where(at_boundary[:, None], classes.starts_np & room[:, None], classes.tails_np)  # (B, V)
        rows, tokens = np.nonzero(allowed & (total >= self.log_min))  # by row, then token
        for branch, end in zip(branches, ends.tolist(), strict=True):
            if branch.pending == 0 and branch.chars > 0 and end >= self.log_min:
                word = branch.data[1:] if branch.space else branch.data
                self.push(end, Completion(self.prefix + word.decode("utf-8"), math.exp(end), branch.space))
        if not len(rows):
            return
        values = total[rows, tokens]
        orders = np.arange(self.order, self.order + len(rows))  # the order every child is made in, queued or not
        self.order += len(rows)
        # each branch's children best first, ties in the order made: (row, -logprob, order)
        by = np.lexsort((orders, -values, rows))
        rows_l, tokens_l, values_l, orders_l = (a[by].tolist() for a in (rows, tokens, values, orders))
        grouped = rows[by]
        starts = [0, *(np.flatnonzero(grouped[1:] != grouped[:-1]) + 1).tolist(), len(rows_l)]
        for a, z in itertools.pairwise(starts):
            i = rows_l[a]
            parent = branches[i]
            states, row = (state, i) if isinstance(state, State) else state[i][:2]
            if parent.pending == 0:  # a character ends here: no child is dropped, they are queued one at a time
                group = _Siblings(parent, states, row, tokens_l[a:z], values_l[a:z], orders_l[a:z])
                heapq.heappush(self.queue, (-values_l[a], orders_l[a], group.child(0)))
                continue
            for j in range(a, z):  # inside a multibyte character (rare): each child checked, queued at once
                b, logprob = tokens_l[j], values_l[j]
                data = parent.data + bytes((b,))
                chars, pending = parent.chars, parent.pending - 1
                if not _valid_prefix(data):
                    continue
                if pending == 0:
                    char = data[len(data) - _char_len(data):].decode("utf-8")
                    if not is_word_char(char):
                        continue  # non-ASCII punctuation: not a word end we count (module docstring)
                    chars += 1
                heapq.heappush(self.queue, (-logprob, orders_l[j],
                                            _Branch(data, chars, pending, states, row, logprob, parent.space)))


def word_ends(lp: np.ndarray, classes: TokenClasses) -> np.ndarray:
    """The log-probability of a word end (`TokenClasses.ends`) in each row of next-byte log-probs (B, V) -> (B,); a
    row's is its own whatever the other rows (a round computes its whole batch's at once). The rows are normalised
    log-probs (at most 0): their exp cannot overflow, so no shift by the maximum (a row whose word ends all underflow
    gets -inf, below any search's floor)."""
    with np.errstate(divide="ignore"):
        out: np.ndarray = np.log(np.exp(lp[:, classes.end_ids]).sum(axis=1))
    return out


def _char_len(data: bytes) -> int:
    """Bytes of the last (complete) UTF-8 character of `data`."""
    n = 1
    while data[-n] & 0xC0 == 0x80:
        n += 1
    return n


class _Settled(Mapping[bytes, Cursor]):
    """Cursors whose states may be in the model's branch form, settled (`LanguageModel.settle`) as they are read: a
    search keeps every one-character continuation it expanded, its caller reads a few. Each is kept as the row of
    its batch and made a cursor when read."""

    def __init__(self, model: LanguageModel | None) -> None:
        self._model = model
        self._rows: dict[bytes, tuple[State, int, np.ndarray]] = {}  # -> (batch, row, next-byte log-probs)
        self._made: dict[bytes, Cursor] = {}

    def put(self, key: bytes, state: State, row: int, logprobs: np.ndarray) -> None:
        self._rows[key] = (state, row, logprobs)
        self._made.pop(key, None)

    def __getitem__(self, key: bytes) -> Cursor:
        cursor = self._made.get(key)
        if cursor is None:
            state, row, logprobs = self._rows[key]
            one = state.select(row)
            cursor = Cursor(self._model.settle(one) if self._model is not None else one,
                            torch.from_numpy(logprobs).float())
            self._made[key] = cursor
        return cursor

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._rows))

    def __len__(self) -> int:
        return len(self._rows)


class WordSearch:
    """`complete_word` as a resumable search, so that a caller can batch the model steps of many searches (many
    typists) into one call: `request()` pops the branches of the next round and returns the batched step they
    need, the caller runs it (`step`, or its own batched call) and hands the result to `feed()`, until `request()`
    returns None; then `result()`. `cut()` ends the search early (a time budget): the result is then the best
    completions found so far, marked inexact. `next_cursors` keeps the model after each one-character
    continuation the search expanded: the likely next keystrokes, whose suggestions can then start without
    feeding the character (and, with `space`, after the space alone, the likeliest keystroke after a mark).

    `space` (`takes_space(context)`; only with nothing typed): the word may also begin after one space (module
    docstring). `space_share` is then the model's probability that it does, given that a word begins next:
    P(" ") / (P(" ") + P(a byte that may start a word)), both of the next byte (a space followed by something else
    than a word counts as one: the search does not know yet); 0 without `space`. The word cache splits its words
    between the two kinds by it (`WordCache.mix`).

    Reuse (`known`, a keystroke after another): the model after each branch an earlier search of the same session
    record expanded, by its bytes after a common origin, `key` being the bytes of this search's context (its
    cursor's) after that origin. The keystroke that types the next letter of a word searches under the branch of
    that letter, so most of what it expands was expanded the keystroke before. The search pops the same branches in
    the same order as without `known` (a branch's children depend only on its own next-byte distribution, which
    is the same row); a popped branch whose row is known is expanded from it at once, and only the others go to
    the model. The completions and their probabilities are therefore a search's from scratch, up to the float
    rounding of the rows' batches. `expanded` then holds every row this search read (its root, the known ones,
    the model's: rows of copies of its slices of the rounds' batches, which keep no other session's rows alive),
    keyed likewise, for the next keystroke's."""

    def __init__(self, cursor: Cursor, prefix: str, *, k: int = 3, max_chars: int = 24,
                 min_prob: float = SUGGEST_MIN_PROB, batch: int = 32, max_expansions: int = 2048,
                 classes: TokenClasses = _BYTES,
                 model: LanguageModel | None = None, space: bool = False,
                 known: Mapping[bytes, Expanded] | None = None, key: bytes = b"") -> None:
        if k < 1 or max_chars < 1 or batch < 1 or not 0 < min_prob <= 1:
            raise ValueError("k, max_chars and batch must be >= 1 and min_prob in (0, 1]")
        if space and prefix:
            raise ValueError("a word begins after a space only where nothing of it is typed")
        self.k, self.batch, self.max_expansions = k, batch, max_expansions
        self._search = _Search(prefix, max_chars, math.log(min_prob), classes)
        self._found: list[Completion] = []
        self._popped: list[_Branch] = []
        self._cut = False
        # given the model, the branches are in its branch form (`LanguageModel.branch`: what they share, kept once),
        # and the cursors handed out are settled (the usual form) as they are read
        self._next = _Settled(model)
        self.next_cursors: Mapping[bytes, Cursor] = self._next  # one-character continuations expanded on the way
        self._known, self._key = known, key
        self.expanded: dict[bytes, Expanded] | None = None if known is None else {}
        self.reused = 0  # branches expanded from `known` rows
        state = model.branch(cursor.state) if model is not None else cursor.state
        root = _Branch(b"", 0, 0, state, 0, 0.0)
        logprobs = cursor.logprobs.double().cpu().unsqueeze(0)  # (1, V)
        self.root_logprobs = logprobs[0]  # (V,) the cursor's, on the host (`next_chars` reads them)
        lp = logprobs.numpy()
        ends = word_ends(lp, classes)
        if self.expanded is not None:
            self.expanded[key] = Expanded(state, 0, lp[0], float(ends[0]))
        self._search.expand([root], state, lp, ends)
        self.space_share = 0.0
        if space:  # the root's one more child: the space, from which only a word may follow (no completion itself)
            spaced = float(logprobs[0, SPACE])
            if spaced >= self._search.log_min:
                self._search.push(spaced, _Branch(bytes([SPACE]), 0, 0, state, 0, spaced, space=True))
            direct = float(torch.logsumexp(logprobs[0, classes.starts], 0))
            self.space_share = 1.0 / (1.0 + math.exp(direct - spaced)) if spaced > -math.inf else 0.0

    @property
    def model_calls(self) -> int:
        return self._search.model_calls

    @property
    def classes(self) -> TokenClasses:
        return self._search.classes

    def request(self, limit: int | None = None) -> tuple[State, list[int]] | None:
        """Pop the next round (at most `limit` branches, else `batch`): -> (their states (b, ...), the byte each
        feeds), or None when the search is over. Completions at the top of the queue are taken on the way, and
        the popped branches whose rows are known are expanded here (a round of only those needs no step)."""
        asked = self.request_rows(limit)
        return None if asked is None else (gather_rows(asked[0]), asked[1])

    def request_rows(self, limit: int | None = None) -> tuple[list[tuple[State, list[int]]], list[int]] | None:
        """`request`, with the states as the rows of the batches they are in, in order ((batch, rows) each:
        `gather_rows` makes them one batch), for a caller that gathers the rows of many searches at once."""
        if self._popped:
            raise RuntimeError("feed() the last request first")
        search, limit = self._search, min(limit or self.batch, self.batch)
        while not self._cut and len(self._found) < self.k and search.queue and search.expansions < self.max_expansions:
            popped: list[_Branch] = []
            held: list[tuple[float, int, _Branch | Completion]] = []
            while search.queue and len(popped) < limit:
                item = search.queue[0][2]
                if isinstance(item, Completion):
                    if popped:  # a popped branch may still beat it: it waits, and the round fills up with the
                        held.append(heapq.heappop(search.queue))  # next branches (module docstring)
                        continue
                    search.pop()
                    self._found.append(item)
                    if len(self._found) == self.k:
                        break
                    continue
                search.pop()
                popped.append(item)
            for entry in held:
                heapq.heappush(search.queue, entry)
            if self._known is not None and popped:
                popped = self._expand_known(popped)
            if popped:
                self._popped, sources = _sources(popped)
                return sources, [b.data[-1] for b in self._popped]
        return None

    def _expand_known(self, popped: list[_Branch]) -> list[_Branch]:
        """Expand the popped branches whose rows are known; -> the others, for the model."""
        assert self._known is not None and self.expanded is not None
        hits, rows, missed = [], [], []
        for branch in popped:
            row = self._known.get(self._key + branch.data)
            if row is None:
                missed.append(branch)
            else:
                hits.append(branch)
                rows.append(row)
        if hits:
            self.reused += len(hits)
            for branch, row in zip(hits, rows, strict=True):
                self.expanded[self._key + branch.data] = row
                if branch.pending == 0 and (branch.chars == 1 or branch.space and branch.chars == 0):
                    self._next.put(branch.data, row.state, row.row, row.logprobs)
            self._search.expand(hits, rows, np.stack([r.logprobs for r in rows]),  # (h, V)
                                np.array([r.ends for r in rows]))
        return missed

    def feed(self, state: State, logprobs: torch.Tensor, ends: np.ndarray | None = None) -> None:
        """The step of the last request: the states after it (b, ...) and the next-byte log-probs (b, V); `ends`
        (b,), if given, `word_ends` of them."""
        if not self._popped:
            raise RuntimeError("nothing was requested")
        self._search.model_calls += 1
        popped, self._popped = self._popped, []
        lp = logprobs.double().cpu().numpy()
        if ends is None:
            ends = word_ends(lp, self.classes)
        if self.expanded is not None:  # kept for the next keystroke: copies, so as not to keep the whole batch alive
            state, lp = _copied(state), lp.copy()
            for i, (branch, end) in enumerate(zip(popped, ends.tolist(), strict=True)):
                self.expanded[self._key + branch.data] = Expanded(state, i, lp[i], end)
        for i, branch in enumerate(popped):
            # the model after the next character (or, after a mark, the space): keep it
            if branch.pending == 0 and (branch.chars == 1 or branch.space and branch.chars == 0):
                self._next.put(branch.data, state, i, lp[i])
        self._search.expand(popped, state, lp, ends)

    def cut(self) -> None:
        """Stop here (a pending request is dropped): `result()` gives what was found."""
        self._cut = True
        self._popped = []

    def result(self) -> Suggestions:
        search, found = self._search, list(self._found)
        exact = len(found) == self.k or not search.queue
        if not exact:  # cut by the budget: the best completions seen so far
            rest = sorted((e for e in search.queue if isinstance(e[2], Completion)), key=lambda e: e[:2])
            found += [e[2] for e in rest if isinstance(e[2], Completion)][: self.k - len(found)]
        return Suggestions(search.prefix, found, [], search.expansions, search.model_calls, exact, self.space_share,
                           self.reused)


def _copied(state: State) -> State:
    """`state`'s rows in memory of their own (a row that is a view of one shared row stays that view; roots are
    shared, as the branch form keeps them)."""
    return State({k: v if v.dim() >= 1 and v.shape[0] > 1 and v.stride(0) == 0 else v.clone()
                  for k, v in state.tensors.items()}, state.roots)


@torch.no_grad()
def complete_word(model: LanguageModel, cursor: Cursor, prefix: str, adapter: Adapter | None = None, *, k: int = 3,
                  max_chars: int = 24, min_prob: float = SUGGEST_MIN_PROB, batch: int = 32,
                  max_expansions: int = 2048, classes: TokenClasses = _BYTES, space: bool = False) -> Suggestions:
    """The k most probable completions of the word whose typed part `prefix` ends the context that `cursor`
    is at (see the module docstring); with `space`, also those after one space (`WordSearch`). -> Suggestions
    without next characters."""
    search = WordSearch(cursor, prefix, k=k, max_chars=max_chars, min_prob=min_prob, batch=batch,
                        max_expansions=max_expansions, classes=classes, model=model, space=space)
    while (request := search.request()) is not None:
        search.feed(*step(model, *request, adapter))
    return search.result()


@torch.no_grad()
def next_chars(model: LanguageModel, cursor: Cursor, n: int, adapter: Adapter | None = None, *,
               classes: TokenClasses = _BYTES) -> list[NextChar]:
    """The n most likely next characters (module docstring), most likely first."""
    if n < 1:
        return []
    lp = cursor.logprobs.double().cpu()  # (V,)
    starts, n_starts = classes.char_starts  # (V,) tokens that can start a character
    top = torch.topk(lp.masked_fill(~starts, -math.inf), min(n, n_starts)).indices.tolist()
    values = lp.numpy()  # a tensor's element read by element costs microseconds each
    out = [NextChar(chr(b), math.exp(float(values[b]))) for b in top if b < 0x80]
    # multibyte: extend every lead byte greedily with its most likely valid continuation, all in one step each
    grow = [(bytes([b]), float(values[b]), cursor.state) for b in top if b >= 0x80]
    while grow:
        state, lps = step(model, State.stack([s for _, _, s in grow]), [d[-1] for d, _, _ in grow], adapter)
        later = []
        for i, (data, logprob, _) in enumerate(grow):
            for b in torch.argsort(lps[i].masked_fill(~classes.tails, -math.inf), descending=True)[:64].tolist():
                if _valid_prefix(data + bytes([b])):
                    break
            else:
                continue  # no valid continuation: nothing to show
            data, logprob = data + bytes([b]), logprob + float(lps[i, b])
            if len(data) == 1 + _more_bytes(data[0]):
                out.append(NextChar(data.decode("utf-8"), math.exp(logprob)))
            else:
                later.append((data, logprob, state.select(i)))
        grow = later
    return sorted(out, key=lambda c: -c.prob)


def suggest(model: LanguageModel, cursor: Cursor, context: str, adapter: Adapter | None = None, *, k: int = 3,
            max_chars: int = 24, n_chars: int = 5, min_prob: float = SUGGEST_MIN_PROB, batch: int = 32,
            max_expansions: int = 2048, tokenizer: ByteTokenizer | None = None) -> Suggestions:
    """Completions of the word being typed at the end of `context` (after a mark, also of the next word after a
    space: `takes_space`) and the next characters; `cursor` is the model after `context` (from `advance`). The
    tokenizer (the checkpoint's; bytes by default) says what each token is to the search (`TokenClasses`)."""
    classes = TokenClasses.of(tokenizer) if tokenizer is not None else _BYTES
    _, prefix = split_word(context)
    found = complete_word(model, cursor, prefix, adapter, k=k, max_chars=max_chars, min_prob=min_prob, batch=batch,
                          max_expansions=max_expansions, classes=classes, space=takes_space(context))
    return Suggestions(prefix, found.completions, next_chars(model, cursor, n_chars, adapter, classes=classes),
                       found.expansions, found.model_calls, found.exact, found.space_share)
