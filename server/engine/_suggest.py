"""Keyboard suggestions on the worker: their work item and executor, the batched rounds of word searches, and a
cache of cursors (the model after a session's text and a context), so
that a keystroke feeds only the bytes it added (or, after a backspace, the few since a cached context).

Suggestions run on every keystroke: feeding the whole context again each time would cost one model step per
byte typed so far. The cache keeps, per session, the cursors of its last few contexts and continues from the
longest one that the new context extends. A word search also leaves the cursors of the one-character
continuations it expanded (the likely next keystrokes: two times in three in a measurement on SMS text), so
that the next keystroke often feeds nothing at all. A cursor is valid only for the session record it was made
from: an observe, reset or import changes the state (or adapter, or next byte) and the session's cursors are
dropped.

A suggestion does not wait for its session's turn: it reads the session's last committed record at once (a
keystroke cannot wait behind a long observe) and joins the word searches in progress at their next round, its
model steps batched with theirs (`SuggestRounds`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from models.base import Adapter, LanguageModel, State
from models.device import SWITCHES, switched_on
from models.device_search import DeviceSearches, Finished, Ineligible
from models.lexicon import Lexicon
from models.session import SessionModel
from models.suggest import (
    SUGGEST_MIN_PROB,
    Completion,
    Cursor,
    Expanded,
    Suggestions,
    TokenClasses,
    WordSearch,
    advance,
    advance_many,
    gather_rows,
    next_chars,
    row_adapters,
    split_word,
    step,
    takes_space,
    word_ends,
)
from models.tokenizer import ByteTokenizer
from models.word_suggest import WordStates, word_suggestions
from models.word_tokenizer import WordTokenizer
from server.engine._errors import SessionsUnavailable
from server.engine._session import Session
from server.engine._session_service import SessionService
from server.engine._stats import EngineStats
from server.engine._work import Work

__all__ = ["SEARCH_ON_DEVICE", "SUGGEST_FEED_BYTES", "SUGGEST_FEED_STRIDE", "CursorCache", "Feed", "Suggest",
           "SuggestExecutor", "SuggestJob", "SuggestRounds", "Suggestions", "WordStateCache", "feed_window",
           "run_suggestions", "search_on_device"]

log = logging.getLogger(__name__)
NEXT_CURSORS = 8  # cursors a search leaves for the next keystroke (of a session's 32)
# branches one suggestion expands per model step (8 measured fastest: docs/notes/2026-11-benchmarks-history.md)
SUGGEST_BATCH = 8
SUGGEST_MAX_EXPANSIONS = 2048  # the most branches one suggestion expands (bounds its latency)
SUGGEST_ROUND_ROWS = 128  # branches of all suggestions per batched step (each gets at least 4)
# The rows of a session's searches kept for its next keystroke's (`CursorCache.rows`): the most probable first. A
# keystroke expands about 10 (default checkpoint, typing e-mail), so this bounds only the rare long search (a row
# of the default checkpoint is about 10 KB: the state and the next-byte log-probs; 64 rows, 0.6 MB a session at
# most, times the sessions the cache holds).
SEARCH_ROWS = 64
# A suggestion continues the session with at most the last SUGGEST_FEED_BYTES bytes of its context (`feed_window`):
# a keystroke must not feed kilobytes on the worker (an 8 KB context took seconds outside the time budget, held
# up all other work and grew the resident memory for good). The window starts at a multiple of the stride, so
# that it moves once per SUGGEST_FEED_STRIDE bytes typed and the cursor cache still feeds only new bytes between.
SUGGEST_FEED_BYTES = 256
SUGGEST_FEED_STRIDE = 128


SEARCH_ON_DEVICE = SWITCHES  # ADAPTLM_SUGGEST_ON_DEVICE


def search_on_device(setting: str, model: LanguageModel) -> bool:
    """Do the word searches run on the model's device (models/device_search.py)? `setting`
    (ADAPTLM_SUGGEST_ON_DEVICE): on, off, or auto: on a CUDA device only (on a CPU the host's search is faster:
    docs/notes/2026-11-30-device-search.md)."""
    return switched_on(setting, next(model.parameters()).device, "suggest_on_device")


def feed_window(context: str) -> str:
    """The end of `context` that a suggestion feeds: all of it up to SUGGEST_FEED_BYTES UTF-8 bytes; beyond, the
    bytes from the first multiple of SUGGEST_FEED_STRIDE that leaves at most SUGGEST_FEED_BYTES (moved on to the
    next whole character). A message longer than the window is, for the model, the session's text and then the
    window: the middle of the message is skipped (a byte model's prediction of the next word rests on the last
    few hundred bytes)."""
    data = context.encode("utf-8")
    if len(data) <= SUGGEST_FEED_BYTES:
        return context
    start = -(-(len(data) - SUGGEST_FEED_BYTES) // SUGGEST_FEED_STRIDE) * SUGGEST_FEED_STRIDE
    while start < len(data) and data[start] & 0xC0 == 0x80:  # a UTF-8 continuation byte: not a character's start
        start += 1
    return data[start:].decode("utf-8")


def _same_record(a: Session, b: Session) -> bool:
    """Do two records of a session hold the same state, next byte and adapter, under the same settings? (A store
    that serialises sessions returns new tensors on every read, so identity is not enough. A session deleted and
    made again under its id starts from the same state and adapter: its creation time and settings, a copy model or
    a neural cache asked for or not, tell it apart.)"""
    if a is b:
        return True
    if a.created != b.created or a.config != b.config:
        return False
    if a.last_token != b.last_token or a.state.tensors.keys() != b.state.tensors.keys() \
            or a.adapter.mats.keys() != b.adapter.mats.keys():
        return False
    pairs = [(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors]
    pairs += [(a.adapter.mats[k], b.adapter.mats[k]) for k in a.adapter.mats]
    # a record the store re-issued (its use time touched) holds the same tensors: identity first, values second
    return all(x is y or (x.shape == y.shape and torch.equal(x, y)) for x, y in pairs)


class Feed(NamedTuple):
    """Bytes to feed from a state to make a cursor."""

    state: State  # batch 1
    inputs: bytes


@dataclass(eq=False)
class _Entry:
    session: Session  # the record the cursors continue
    cursors: OrderedDict[bytes, Cursor] = field(default_factory=OrderedDict)  # inputs -> cursor, oldest first
    # what the session's last searches expanded (inputs -> the model after them, in the branch form of `model`):
    # only those that extend the last context are kept, the rows the next keystroke's search can reach
    rows: dict[bytes, Expanded] = field(default_factory=dict)
    model: LanguageModel | None = None


class CursorCache:
    """Worker-thread only. At most `sessions` sessions, `per_session` cursors each (least recently used go)."""

    def __init__(self, sessions: int = 256, per_session: int = 32, tokenizer: ByteTokenizer | None = None,
                 model: SessionModel | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        # what a session's search continues from and reads (`SessionModel.view_state`, `.adapter`); without a
        # session model, the session's own state and adapter (a session without memories)
        self.model = model
        self.sessions = sessions
        self.per_session = per_session
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.fed = 0  # bytes fed to the model

    def cursor(self, model: LanguageModel, session: Session, context: bytes) -> Cursor:
        """The model after the session's text and `context` (the session's next byte, then the context)."""
        plan = self.plan(session, context)
        if isinstance(plan, Cursor):
            return plan
        return self.put(session, context, advance(model, plan.state, plan.inputs, self.adapter(session)))

    def view(self, session: Session) -> State:
        return self.model.view_state(session) if self.model is not None else session.state

    def adapter(self, session: Session) -> Adapter:
        return self.model.adapter(session) if self.model is not None else session.adapter

    def search_width(self, session: Session, k: int) -> int:
        return self.model.search_width(session, k) if self.model is not None else k

    def rank(self, session: Session, completions: list[Completion], context: str, k: int, max_chars: int,
             lexicon: Lexicon | None, space: float) -> list[Completion]:
        if self.model is None:
            return lexicon.rank(completions, k, None) if lexicon is not None else completions[:k]
        return list(self.model.rank(session, completions, context, k, max_chars, lexicon, space))

    def plan(self, session: Session, context: bytes) -> Cursor | Feed:
        """The cached cursor after the session's text and `context`, or what must be fed to make it (from the
        longest cached context that this one extends): run it, then `put` the result."""
        inputs = self.tokenizer.token_bytes(session.last_token) + context
        entry = self._entries.get(session.id)
        if entry is None or not _same_record(entry.session, session):
            entry = _Entry(session)
            self._entries[session.id] = entry
        self._entries.move_to_end(session.id)
        while len(self._entries) > self.sessions:
            self._entries.popitem(last=False)
        base = max((key for key in entry.cursors if inputs.startswith(key)), key=len, default=b"")
        if base == inputs:
            entry.cursors.move_to_end(inputs)
            return entry.cursors[base]
        # a row a search expanded: the next letter of a word, or a completion taken (then what follows it is fed)
        for end in range(len(inputs), len(base), -1):
            row = entry.rows.get(inputs[:end])
            if row is not None:
                assert entry.model is not None
                cursor = Cursor(entry.model.settle(row.state.select(row.row)), torch.from_numpy(row.logprobs).float())
                if end == len(inputs):
                    return self.put(session, context, cursor)
                self.fed += len(inputs) - end
                return Feed(cursor.state, inputs[end:])
        self.fed += len(inputs) - len(base)
        state = entry.cursors[base].state if base else self.view(session)
        return Feed(state, inputs[len(base):])

    def rows(self, session: Session, context: bytes) -> tuple[dict[bytes, Expanded], bytes] | None:
        """What the session's earlier searches expanded that a search at `context` may reach, and the key of its
        root (`WordSearch`'s `known` and `key`); None if the session changed (call after `plan`)."""
        entry = self._entries.get(session.id)
        if entry is None or entry.session is not session and not _same_record(entry.session, session):
            return None
        inputs = self.tokenizer.token_bytes(session.last_token) + context
        entry.rows = {key: row for key, row in entry.rows.items() if key.startswith(inputs)}
        return entry.rows, inputs

    def keep(self, session: Session, rows: dict[bytes, Expanded], model: LanguageModel) -> None:
        """Keep what a search of the session expanded (`WordSearch.expanded`, best first) for the next keystroke."""
        entry = self._entries.get(session.id)
        if entry is None or entry.session is not session and not _same_record(entry.session, session):
            return
        if entry.model is not model:
            entry.rows, entry.model = {}, model
        for key, row in itertools.islice(rows.items(), SEARCH_ROWS):
            entry.rows.setdefault(key, row)
        while len(entry.rows) > SEARCH_ROWS:
            del entry.rows[next(iter(entry.rows))]

    def put(self, session: Session, context: bytes, cursor: Cursor) -> Cursor:
        """Keep the cursor after the session's text and `context` (made from `plan`'s feed)."""
        entry = self._entries.get(session.id)
        if entry is None or entry.session is not session and not _same_record(entry.session, session):
            return cursor  # the session changed (or was evicted) meanwhile: not worth keeping
        inputs = self.tokenizer.token_bytes(session.last_token) + context
        entry.cursors[inputs] = cursor
        entry.cursors.move_to_end(inputs)
        while len(entry.cursors) > self.per_session:
            entry.cursors.popitem(last=False)
        return cursor

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)


class WordStateCache(WordStates):
    """A word model's states after its sessions' stable words (`word_suggestions`' `states`). Worker-thread only.

    A word is one token: a keystroke within a word changes only the typed part, whose distribution is the one after
    the words before it, so it needs no model step once a keystroke has fed them; a space settles the word before it,
    whose step the last keystroke ran already if the typed part was a word (`word_suggestions`' next characters), or
    else is the one step fed. Per session, the last `per_session` token-id runs of one record (the record changes
    with an observe, reset or import: its entry is dropped), for at most `sessions` sessions, least recently used
    going. An entry of the shipped word checkpoint holds a window's keys and values (3 layers of 64 x 192) and a
    distribution of 24,000 words: about 0.4 MB, 1.6 MB a session."""

    def __init__(self, sessions: int = 64, per_session: int = 4) -> None:
        self.sessions, self.per_session = sessions, per_session
        # session id -> (the record, token ids -> (state after them, next-token log-probs), oldest first)
        self._entries: OrderedDict[str, tuple[Session, OrderedDict[tuple[int, ...], tuple[State, torch.Tensor]]]] \
            = OrderedDict()

    def _runs(self, session: Session) -> OrderedDict[tuple[int, ...], tuple[State, torch.Tensor]] | None:
        entry = self._entries.get(session.id)
        if entry is None or not _same_record(entry[0], session):
            return None
        self._entries.move_to_end(session.id)
        return entry[1]

    def longest(self, session: Session, ids: Sequence[int]) -> tuple[int, State | None, torch.Tensor | None]:
        runs = self._runs(session)
        if runs is None:
            self._entries.pop(session.id, None)  # another record: what the last one fed is no use
            return 0, None, None
        key = tuple(ids)
        best = max((run for run in runs if len(run) <= len(key) and key[: len(run)] == run), key=len, default=())
        if not best:
            return 0, None, None
        runs.move_to_end(best)
        state, logprobs = runs[best]
        return len(best), state, logprobs

    def put(self, session: Session, ids: Sequence[int], state: State, logprobs: torch.Tensor) -> None:
        runs = self._runs(session)
        if runs is None:
            runs = OrderedDict()
            self._entries[session.id] = (session, runs)
            while len(self._entries) > self.sessions:
                self._entries.popitem(last=False)
        runs[tuple(ids)] = (state, logprobs)
        runs.move_to_end(tuple(ids))
        while len(runs) > self.per_session:
            runs.popitem(last=False)

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)


@dataclass(eq=False)
class SuggestJob:
    """One keystroke's suggestions, for `SuggestRounds`: its outcome is `result` or `error`."""

    session: Session
    context: str
    k: int
    max_chars: int
    n_chars: int
    deadline: float = math.inf  # time.monotonic() after which the word search stops with what it has
    result: Suggestions | None = None
    error: Exception | None = None
    cursor: Cursor | None = None
    # the host's search, or what the device's found (`DeviceSearches`: None while it runs there)
    search: WordSearch | Finished | None = None
    # the search's next round, popped and not yet run: (the batches and rows of its states, the byte each row feeds)
    request: tuple[list[tuple[State, list[int]]], list[int]] | None = None


class SuggestRounds:
    """The keyboard suggestions in progress on the worker, their model work batched across sessions.

    `start(jobs)` feeds each new job's context bytes (one forward, rows grouped by length) and starts its word
    search; `round()` runs one round of every search in progress as one batched step, each row under its own
    session's adapter. A job takes at most `batch` branches per round, fewer when many share it (`round_rows`
    in all, at least 4 each): the searches stay exact, they take more rounds. A job past its deadline is cut
    (its result is then marked inexact).

    With `on_device` (ADAPTLM_SUGGEST_ON_DEVICE), the searches run as tensors on the model's device
    (models/device_search.py: no host read a round) where the model's states allow it (`DeviceSearches.eligible`),
    in their own batched step a round; the host's search (`WordSearch`) runs the others, and any that the device could
    not certify exact (its pool overflowed: `fallbacks`). The device's does not reuse the rows the session's last
    keystroke expanded (`CursorCache.rows`): a CPU saving, where a row costs more than a sync.

    Jobs join between rounds (continuous batching): the engine runs rounds back to back and starts the
    keystrokes that arrived in between, so a keystroke that arrives while others are searching waits for one
    round (a few ms), not for their whole searches (it may still wait for a text or generation step the engine
    is running)."""

    def __init__(self, model: LanguageModel, cache: CursorCache, *, min_prob: float, batch: int,
                 max_expansions: int, round_rows: int, classes: TokenClasses | None = None,
                 lexicon: Lexicon | None = None, on_device: bool = False) -> None:
        self.model, self.cache = model, cache
        self.lexicon = lexicon  # the checkpoint's words: the dictionary prior of the ranking (models/lexicon.py)
        self.classes = classes or TokenClasses.of(ByteTokenizer())  # what each token is to the word search
        self.min_prob, self.batch, self.max_expansions, self.round_rows = min_prob, batch, max_expansions, round_rows
        self.active: list[SuggestJob] = []  # the host's searches
        self.on_device: list[SuggestJob] = []  # the device's
        self._ended: list[SuggestJob] = []  # jobs that could not start: `round` hands them back with its own
        self.device: DeviceSearches | None = None
        if on_device:
            try:
                self.device = DeviceSearches(model, self.classes, min_prob=min_prob, batch=batch,
                                             round_rows=round_rows, max_expansions=max_expansions,
                                             next_cursors=NEXT_CURSORS)
            except Ineligible as e:
                log.info("keyboard searches run on the host: %s", e)
        self.fallbacks = 0  # device searches not certified exact, run again on the host

    @property
    def busy(self) -> bool:
        """Searches in progress (on the host or the device)."""
        return bool(self.active or self.on_device)

    @torch.inference_mode()
    def start(self, jobs: list[SuggestJob]) -> int | None:
        """Make the jobs' cursors and start their searches; -> the rows of the feeding forward (None: every
        cursor was cached). A job that cannot start gets its error, and the next `round` returns it as ended."""
        plans = [(job, self.cache.plan(job.session, job.context.encode("utf-8"))) for job in jobs]
        feeds = [(job, plan) for job, plan in plans if isinstance(plan, Feed)]
        for job, plan in plans:
            if isinstance(plan, Cursor):
                job.cursor = plan
        if feeds:
            made = advance_many(self.model, [(plan.state, plan.inputs, self.cache.adapter(job.session))
                                             for job, plan in feeds])
            for (job, _), cursor in zip(feeds, made, strict=True):
                job.cursor = self.cache.put(job.session, job.context.encode("utf-8"), cursor)
        device = []
        for job in jobs:
            assert job.cursor is not None
            # with a word memory, the search finds more of the model's words than it shows: a remembered word
            # among them keeps its own probability under the model in the mix (models/wordcache.py)
            width = self.cache.search_width(job.session, job.k)
            if self.device is not None and width >= 1 and job.max_chars >= 1 \
                    and self.device.eligible(job.cursor.state):
                device.append((job, job.cursor, split_word(job.context)[1], width, job.max_chars,
                               takes_space(job.context), self.cache.adapter(job.session)))
                continue
            self._start_host(job, width)
        if device:
            assert self.device is not None
            self.device.add(device)
            self.on_device += [job for job, *_ in device]
        return len(feeds) or None

    def _start_host(self, job: SuggestJob, width: int) -> None:
        assert job.cursor is not None
        try:
            # the rows the session's last searches expanded: this search expands them again without the model
            known, key = self.cache.rows(job.session, job.context.encode("utf-8")) or ({}, b"")
            job.search = WordSearch(job.cursor, split_word(job.context)[1], k=width, max_chars=job.max_chars,
                                    min_prob=self.min_prob, batch=self.batch,
                                    max_expansions=self.max_expansions, classes=self.classes,
                                    model=self.model, space=takes_space(job.context), known=known, key=key)
        except ValueError as e:
            job.error = e
            self._ended.append(job)
        else:
            self.active.append(job)

    def clear(self) -> None:
        """Forget every job (the caller answers them)."""
        self.active, self.on_device, self._ended = [], [], []
        if self.device is not None:
            self.device.clear()

    def drop(self, job: SuggestJob) -> None:
        """Stop a job's search (its client went away); the caller answers it."""
        if job in self.active:
            self.active.remove(job)
        if job in self.on_device:
            self.on_device.remove(job)
            assert self.device is not None
            self.device.drop(job)

    @torch.inference_mode()
    def round(self) -> tuple[int | None, list[SuggestJob]]:
        """One batched step of every search in progress (one on the host's, one on the device's) -> (their rows,
        None if no step was needed; the jobs that ended, with their result or error)."""
        done, self._ended = self._ended, []
        self.active = self._next_requests(self.active, done)
        rows = self._host_round(done) if self.active else None
        if self.on_device:
            on_device = self._device_round(done)
            rows = on_device if rows is None else rows + (on_device or 0)
            # pop the next round of the searches handed to the host now (a fallback), as `_host_round` does
            self.active = self._next_requests(self.active, done)
        return rows, done

    def _host_round(self, done: list[SuggestJob]) -> int:
        requests = [(job, job.request) for job in self.active if job.request is not None]
        sizes = [len(tokens) for _, (_, tokens) in requests]
        adapter = row_adapters([self.cache.adapter(job.session) for job, _ in requests], sizes,
                               self.model.grouped_adapters)
        # every search's rows gathered at once (a search's batches are its own: its rows stay together, in order)
        state, logprobs = step(self.model, gather_rows([source for _, (sources, _) in requests for source in sources]),
                               [t for _, (_, tokens) in requests for t in tokens], adapter)
        lp = logprobs.numpy()
        ends = word_ends(lp, self.classes)  # the whole batch's at once
        start = 0
        for (job, _), n in zip(requests, sizes, strict=True):
            assert isinstance(job.search, WordSearch)
            job.request = None
            job.search.feed(state.select(slice(start, start + n)), logprobs[start : start + n],
                            ends[start : start + n] if job.search.classes is self.classes else None)
            start += n
        # pop the next round now: a search that has just ended answers in this round, not the next
        self.active = self._next_requests(self.active, done)
        return sum(sizes)

    def _device_round(self, done: list[SuggestJob]) -> int | None:
        """One round of the device's searches; those the host learns have ended are finished into `done` (or, not
        certified exact, handed to the host's search)."""
        device = self.device
        assert device is not None
        now = time.monotonic()
        for job in self.on_device:
            if now > job.deadline:
                device.cut(job)
        try:
            rows = device.round() or None
        except Ineligible as e:  # states that change shape: every search here goes to the host, and all after
            log.info("keyboard searches run on the host: %s", e)
            jobs, self.on_device, self.device = self.on_device, [], None
            for job in jobs:
                self._start_host(job, self.cache.search_width(job.session, job.k))
            return None
        ended = device.ended()
        if ended:
            gone = {id(job) for job, _ in ended}
            self.on_device = [job for job in self.on_device if id(job) not in gone]
        now = time.monotonic()
        for job, found in ended:
            # past its deadline the host's search would be cut at once (nothing found): what the device found answers,
            # inexact
            if found.overflow and now <= job.deadline:
                self.fallbacks += 1
                self._start_host(job, self.cache.search_width(job.session, job.k))
                continue
            job.search = found
            _finish(self.model, job, self.cache, self.lexicon)
            done.append(job)
        return rows

    def _next_requests(self, jobs: list[SuggestJob], done: list[SuggestJob]) -> list[SuggestJob]:
        """Give every job without one its next request (cutting those past their deadline); -> the jobs that
        still search. The others are finished into `done`."""
        now = time.monotonic()
        # `round_rows` in all: the rows already popped (by the jobs that searched last round) count against it
        taken = sum(len(job.request[1]) for job in jobs if job.request is not None)
        asking = sum(job.request is None for job in jobs)
        limit = max(4, (self.round_rows - taken) // max(1, asking))
        going = []
        for job in jobs:
            assert isinstance(job.search, WordSearch)
            if now > job.deadline:
                job.search.cut()
                job.request = None
            if job.request is None:
                job.request = job.search.request_rows(limit)
            if job.request is None:
                _finish(self.model, job, self.cache, self.lexicon)
                done.append(job)
            else:
                going.append(job)
        return going


def run_suggestions(model: LanguageModel, jobs: list[SuggestJob], cache: CursorCache, *, min_prob: float,
                    batch: int, max_expansions: int, round_rows: int, lexicon: Lexicon | None = None) -> list[int]:
    """Answer every job (`SuggestRounds` until none is left) -> the rows of each batched model call."""
    rounds = SuggestRounds(model, cache, min_prob=min_prob, batch=batch, max_expansions=max_expansions,
                           round_rows=round_rows, lexicon=lexicon)
    steps = [rows] if (rows := rounds.start(jobs)) is not None else []
    while rounds.busy:
        rows, _ = rounds.round()
        if rows is not None:
            steps.append(rows)
    return steps


def _finish(model: LanguageModel, job: SuggestJob, cache: CursorCache, lexicon: Lexicon | None = None) -> None:
    assert job.search is not None and job.cursor is not None
    context = job.context.encode("utf-8")
    # The next keystroke is likely one of the characters the search expanded: keep the likeliest (the search
    # found them best first). Then the context's own cursor again, so that it is the most recent: a keystroke
    # no search foresaw (or a backspace) continues from it, instead of feeding the whole message again because
    # the foreseen characters pushed it out of the session's few cursors.
    for char, cursor in itertools.islice(job.search.next_cursors.items(), NEXT_CURSORS):
        cache.put(job.session, context + char, cursor)
    cache.put(job.session, context, job.cursor)
    if job.search.expanded is not None:
        cache.keep(job.session, job.search.expanded, model)
    try:
        found = job.search.result()
        # from the root's log-probs the search brought to the host (a device search's are read with its results: the
        # cursor's own, on the device, would wait for every round queued since)
        chars = next_chars(model, Cursor(job.cursor.state, job.search.root_logprobs), job.n_chars,
                           cache.adapter(job.session), classes=job.search.classes)
        # the session's word memories mixed in (models/wordcache.py: after a mark each remembered word split between
        # the two kinds by the model's odds of the space), then the k best under the lexicon's prior (a word neither
        # in it nor typed by the session demoted; each prob stays as mixed)
        mixed = cache.rank(job.session, found.completions, job.context, job.k, job.max_chars, lexicon,
                           found.space_share)
        found = dataclasses.replace(found, completions=mixed)
    except Exception as e:  # one job's failure is its own
        job.error = e
        return
    job.result = Suggestions(found.prefix, found.completions, chars, found.expansions, found.model_calls, found.exact,
                             found.space_share, found.reused)


class Suggest(Work):
    """Keyboard suggestions for the session `target`. `session_id` stays None: a suggestion does not wait for
    its session's turn."""

    kind = "suggest"
    keystroke = True

    def __init__(self, target: str, context: str, *, owner: str | None, k: int, max_chars: int, n_chars: int,
                 deadline: float) -> None:
        super().__init__(owner=owner)
        self.target, self.k, self.max_chars, self.n_chars = target, k, max_chars, n_chars
        self.context = feed_window(context)
        self.deadline = deadline
        self.job: SuggestJob | None = None  # once started


class SuggestExecutor:
    """The suggestions in progress: started ones join the word searches at the next `step` (one round)."""

    rows = 0

    def __init__(self, model: LanguageModel, sessions: SessionService, stats: EngineStats, *,
                 tokenizer: ByteTokenizer | None = None, refuse: str = "", words: WordTokenizer | None = None,
                 lexicon: Lexicon | None = None, on_device: str = "auto") -> None:
        self._sessions, self._stats = sessions, stats
        self._refuse = refuse  # why this model has no suggestions (SessionsUnavailable); "": it has
        self._model, self._words = model, words  # a word model: `word_suggestions`, answered at once
        self._word_states = WordStateCache()  # what a word model's keystrokes fed, for the next keystroke's
        tokenizer = tokenizer or ByteTokenizer()
        self._rounds = SuggestRounds(model, CursorCache(tokenizer=tokenizer, model=sessions.model),
                                     min_prob=SUGGEST_MIN_PROB,
                                     batch=SUGGEST_BATCH, max_expansions=SUGGEST_MAX_EXPANSIONS,
                                     round_rows=SUGGEST_ROUND_ROWS, classes=TokenClasses.of(tokenizer),
                                     lexicon=lexicon, on_device=search_on_device(on_device, model))
        self._started: list[Suggest] = []  # not yet fed
        self._searching: dict[SuggestJob, Suggest] = {}

    @property
    def busy(self) -> bool:
        return bool(self._searching or self._started)

    def start(self, work: Suggest) -> None:
        try:
            if self._refuse:
                raise SessionsUnavailable(self._refuse)
            session = self._sessions.get(work.target, work.owner)
            if self._words is not None:
                work.future.set_result(word_suggestions(self._model, self._words, session, work.context,
                                                        k=work.k, n_chars=work.n_chars, max_chars=work.max_chars,
                                                        sessions=self._sessions.model, states=self._word_states))
                return
        except Exception as e:
            work.fail(e)
            return
        work.job = SuggestJob(session, work.context, work.k, work.max_chars, work.n_chars, work.deadline)
        self._started.append(work)

    def step(self) -> None:
        """Start the suggestions that arrived, then run one round of all the word searches in progress (one
        batched step)."""
        rounds = self._rounds
        started = [work for work in self._started if not self._dropped(work)]
        self._started = []
        for job in [job for job in [*rounds.active, *rounds.on_device] if self._dropped(self._searching[job])]:
            rounds.drop(job)  # its client went away: the search stops here
            del self._searching[job]
        if not started and not rounds.busy:
            return
        jobs = [work.job for work in started if work.job is not None]
        self._searching.update(zip(jobs, started, strict=True))
        try:
            if started:
                self._count_rows(rounds.start(jobs))
            rows, done = rounds.round()
        except Exception as e:
            log.exception("a batched suggestion step failed; failing its %d suggestions", len(self._searching))
            for work in self._searching.values():
                work.fail(e)
            self._searching.clear()
            rounds.clear()
            return
        self._count_rows(rows)
        self._stats.suggest_fallbacks = rounds.fallbacks
        for job in done:
            self.finish(self._searching.pop(job))

    def finish(self, work: Suggest) -> None:
        job = work.job
        assert job is not None
        if job.result is not None:
            self._stats.suggest_cut += not job.result.exact
            work.future.set_result(job.result)
        else:
            work.fail(job.error or RuntimeError("the suggestion was not answered"))

    def fail(self, error: BaseException) -> None:
        for work in [*self._started, *self._searching.values()]:
            work.fail(error)
        self._started = []
        self._searching.clear()
        self._rounds.clear()

    def _dropped(self, work: Suggest) -> bool:
        """A started suggestion whose client went away is failed (as running text work is) and counted."""
        if not work.cancelled:
            return False
        work.fail(asyncio.CancelledError())
        self._stats.count_cancelled(work.kind)
        return True

    def _count_rows(self, rows: int | None) -> None:
        if rows is not None:
            self._stats.suggest_rows[rows] = self._stats.suggest_rows.get(rows, 0) + 1
