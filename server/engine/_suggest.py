"""Keyboard suggestions on the worker: a cache of cursors (the model after a session's text and a context), so
that a keystroke feeds only the bytes it added (or, after a backspace, the few since a cached context).

Suggestions run on every keystroke: feeding the whole context again each time would cost one model step per
byte typed so far. The cache keeps, per session, the cursors of its last few contexts and continues from the
longest one that the new context extends. A word search also leaves the cursors of the one-character
continuations it expanded (the likely next keystrokes: two times in three in a measurement on SMS text), so
that the next keystroke often feeds nothing at all. A cursor is valid only for the session record it was made
from: an observe, reset or import changes the state (or adapter, or next byte) and the session's cursors are
dropped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from models.base import LanguageModel, State
from models.suggest import (
    Cursor,
    Suggestions,
    WordSearch,
    advance,
    advance_many,
    next_chars,
    row_adapters,
    split_word,
    step,
)
from models.wordcache import mix_completions, previous_word
from server.engine._sessions import Session

__all__ = ["CursorCache", "Feed", "SuggestJob", "Suggestions", "run_suggestions"]


def _same_record(a: Session, b: Session) -> bool:
    """Do two records of a session hold the same state, next byte and adapter? (A store that serialises
    sessions returns new tensors on every read, so identity is not enough.)"""
    if a is b:
        return True
    if a.last_byte != b.last_byte or a.state.tensors.keys() != b.state.tensors.keys() \
            or a.adapter.mats.keys() != b.adapter.mats.keys():
        return False
    pairs = [(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors]
    pairs += [(a.adapter.mats[k], b.adapter.mats[k]) for k in a.adapter.mats]
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


class Feed(NamedTuple):
    """Bytes to feed from a state to make a cursor."""

    state: State  # batch 1
    inputs: bytes


@dataclass(eq=False)
class _Entry:
    session: Session  # the record the cursors continue
    cursors: OrderedDict[bytes, Cursor] = field(default_factory=OrderedDict)  # inputs -> cursor, oldest first


class CursorCache:
    """Worker-thread only. At most `sessions` sessions, `per_session` cursors each (least recently used go)."""

    def __init__(self, sessions: int = 256, per_session: int = 32) -> None:
        self.sessions = sessions
        self.per_session = per_session
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.fed = 0  # bytes fed to the model

    def cursor(self, model: LanguageModel, session: Session, context: bytes) -> Cursor:
        """The model after the session's text and `context` (the session's next byte, then the context)."""
        plan = self.plan(session, context)
        if isinstance(plan, Cursor):
            return plan
        return self.put(session, context, advance(model, plan.state, plan.inputs, session.adapter))

    def plan(self, session: Session, context: bytes) -> Cursor | Feed:
        """The cached cursor after the session's text and `context`, or what must be fed to make it (from the
        longest cached context that this one extends): run it, then `put` the result."""
        inputs = bytes([session.last_byte]) + context
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
        self.fed += len(inputs) - len(base)
        state = entry.cursors[base].state if base else session.state
        return Feed(state, inputs[len(base):])

    def put(self, session: Session, context: bytes, cursor: Cursor) -> Cursor:
        """Keep the cursor after the session's text and `context` (made from `plan`'s feed)."""
        entry = self._entries.get(session.id)
        if entry is None or entry.session is not session and not _same_record(entry.session, session):
            return cursor  # the session changed (or was evicted) meanwhile: not worth keeping
        inputs = bytes([session.last_byte]) + context
        entry.cursors[inputs] = cursor
        entry.cursors.move_to_end(inputs)
        while len(entry.cursors) > self.per_session:
            entry.cursors.popitem(last=False)
        return cursor

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)


@dataclass(eq=False)
class SuggestJob:
    """One keystroke's suggestions, for `run_suggestions`: its outcome is `result` or `error`."""

    session: Session
    context: str
    k: int
    max_chars: int
    n_chars: int
    deadline: float = math.inf  # time.monotonic() after which the word search stops with what it has
    result: Suggestions | None = None
    error: Exception | None = None
    cursor: Cursor | None = None
    search: WordSearch | None = None


@torch.no_grad()
def run_suggestions(model: LanguageModel, jobs: list[SuggestJob], cache: CursorCache, *, min_prob: float,
                    batch: int, max_expansions: int, round_rows: int) -> list[int]:
    """Answer every job, batching their model work across sessions: one forward feeds each job's new context
    bytes (by length), then each round of the word searches runs as one batched step of all the jobs' branches,
    every row under its own session's adapter. A job takes at most `batch` branches per round, fewer when many
    jobs share the round (`round_rows` in all, at least 4 each): the searches stay exact, they take more rounds.
    A job past its deadline is cut (its result is then marked inexact). -> the rows of each batched model call."""
    steps: list[int] = []
    plans = [(job, cache.plan(job.session, job.context.encode("utf-8"))) for job in jobs]
    feeds = [(job, plan) for job, plan in plans if isinstance(plan, Feed)]
    for job, plan in plans:
        if isinstance(plan, Cursor):
            job.cursor = plan
    if feeds:
        steps.append(len(feeds))
        made = advance_many(model, [(plan.state, plan.inputs, job.session.adapter) for job, plan in feeds])
        for (job, _), cursor in zip(feeds, made, strict=True):
            job.cursor = cache.put(job.session, job.context.encode("utf-8"), cursor)
    active = []
    for job in jobs:
        assert job.cursor is not None
        try:
            job.search = WordSearch(job.cursor, split_word(job.context)[1], k=job.k, max_chars=job.max_chars,
                                    min_prob=min_prob, batch=batch, max_expansions=max_expansions)
        except ValueError as e:
            job.error = e
        else:
            active.append(job)
    while active:
        now = time.monotonic()
        limit = max(4, round_rows // len(active))
        requests = []
        for job in active:
            assert job.search is not None
            if now > job.deadline:
                job.search.cut()
            request = job.search.request(limit)
            if request is None:
                _finish(model, job, cache)
            else:
                requests.append((job, request))
        if not requests:
            break
        sizes = [len(tokens) for _, (_, tokens) in requests]
        steps.append(sum(sizes))
        adapter = row_adapters([job.session.adapter for job, _ in requests], sizes)
        state, logprobs = step(model, State.stack([s for _, (s, _) in requests]),
                               [t for _, (_, tokens) in requests for t in tokens], adapter)
        start = 0
        for (job, _), n in zip(requests, sizes, strict=True):
            assert job.search is not None
            job.search.feed(state.select(slice(start, start + n)), logprobs[start : start + n])
            start += n
        active = [job for job, _ in requests]
    return steps


def _finish(model: LanguageModel, job: SuggestJob, cache: CursorCache) -> None:
    assert job.search is not None and job.cursor is not None
    context = job.context.encode("utf-8")
    for char, cursor in job.search.next_cursors.items():  # the next keystroke is likely one of these
        cache.put(job.session, context + char, cursor)
    try:
        found = job.search.result()
        chars = next_chars(model, job.cursor, job.n_chars, job.session.adapter)
        weight = job.session.config.cache_weight
        if weight > 0:  # the session's word cache, mixed in (models/wordcache.py)
            before, prefix = split_word(job.context)
            cached = job.session.words.candidates(prefix, previous_word(before), job.max_chars)
            found = dataclasses.replace(found, completions=mix_completions(found.completions, cached, weight, job.k))
    except Exception as e:  # one job's failure is its own
        job.error = e
        return
    job.result = Suggestions(found.prefix, found.completions, chars, found.expansions, found.model_calls, found.exact)
