"""Text work: a static score, a session score without adaptation ("peek") or a session observe, and the executor
that reads all running texts segment by segment in one batched step (`models.adaptation.batch_step`, the step
offline evaluation and the keyboard simulator run too).

A text reads its session when it starts and writes it back when it is done (an observe: the new state, shadow
state, adapter, next token, pending text, statistics and word cache); a text whose caller went away stops between two
segments, as does one whose request has spent its engine-time budget (`_work.Budget`), and its session stays as it
was.

A word model's session keeps `pending` text (`WordTokenizer.split_stable`: the last word, which may go on, and the
gap before it; more than PENDING_MAX_BYTES of it is scored as it stands). An observe scores and adapts on the tokens
of the stable part of pending + text, continuing from the session's last token, and keeps the rest pending: its
score is of that stable part (its bytes and tokens; none at all when it is empty: the text only grew the pending
word). A session's score without adaptation ("peek") scores pending + text, the text taken as complete. A byte
model's session has nothing pending: both read the text as sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from models.adaptation import RuleCache, TextJob
from models.checkpoint import Checkpoint
from models.scoring import LN2, ScoredText
from models.session import Observed
from server.engine._errors import SessionNotFound
from server.engine._scheduler import Scheduler, pack
from server.engine._session import Session
from server.engine._session_service import SessionService
from server.engine._slots import SessionSlots
from server.engine._stats import EngineStats
from server.engine._work import Budget, Work, charge, stop_if_asked

__all__ = ["Text", "TextExecutor", "TextScore"]

log = logging.getLogger(__name__)
Mode = Literal["static", "peek", "observe"]


@dataclass(kw_only=True)
class TextScore(ScoredText):
    """A text's bits under the model (static) or under a session, each segment scored before any update."""

    logprobs: list[float] | None = None
    static_bits: float | None = None  # adapting work: the same text under the unadapted model
    updates: int = 0  # adapter updates applied
    nonfinite_reset: bool = False  # the non-finite guard refused an update or reset the adapter
    pending_bytes: int = 0  # an observe of a word session: bytes left pending after it


class Text(Work):
    """`data` read as `mode`; with `create`, a session to create first (then observed)."""

    kind = "text"

    def __init__(self, data: bytes, mode: Mode, *, session_id: str | None = None, owner: str | None = None,
                 logprobs: bool = False, create: Callable[[], Session] | None = None, counted: bool = True,
                 budget: Budget | None = None) -> None:
        super().__init__(session_id=session_id, owner=owner, counted=counted, budget=budget)
        self.data, self.mode, self.logprobs, self.create = data, mode, logprobs, create
        self.job: TextJob | None = None  # its rows, once started
        self.text: Observed | None = None  # what the session model made of it, once started
        self.session: Session | None = None  # the record it started from
        self.scored = data  # the text whose tokens it scores (a word session: with the pending text; stable part)
        self.pending = b""  # an observe: the session's pending text after it
        self.slot: str | None = None  # an observe on a session slot (`SessionSlots`): the session's stored id

    @property
    def rows(self) -> int:
        return 2 if self.mode == "observe" else 1


class TextExecutor:
    def __init__(self, ckpt: Checkpoint, sessions: SessionService, scheduler: Scheduler, stats: EngineStats,
                 slots: SessionSlots | None = None) -> None:
        self._ckpt, self._sessions, self._scheduler, self._stats = ckpt, sessions, scheduler, stats
        self.slots = slots  # observed sessions' tensors resident on the device between requests (None: off)
        self._texts: list[Text] = []  # running, in the order they step
        self._stacked = RuleCache()

    @property
    def busy(self) -> bool:
        return bool(self._texts)

    @property
    def rows(self) -> int:
        return sum(len(t.job.rows) for t in self._texts if t.job is not None)

    def start(self, work: Text) -> None:
        """Read the session and set up the rows."""
        try:
            session = None
            if work.create is not None:
                session = work.create()
            elif work.session_id is not None:
                session = self._sessions.get(work.session_id, work.owner)
            resident = None
            if self.slots is not None and session is not None and work.mode == "observe":
                resident = self.slots.acquire(session)
                work.slot = session.id if resident is not None else None
            text = self._sessions.model.start(resident or session, work.data, work.mode, resident=resident is not None)
        except Exception as e:
            self._release(work, scheduler=False)  # (not claimed yet)
            work.fail(e)
            return
        work.session, work.text = session, text
        work.job, work.scored, work.pending = text.job, text.scored, text.pending
        self._scheduler.claim(work.session_id)
        if not work.scored:  # an observe that only grew the pending word: nothing to score
            self.finish(work)
            return
        self._texts.append(work)

    def step(self) -> None:
        """One batched segment of every running text (while someone types, of the texts that waited longest, up
        to the scheduler's row limit); then finish those that are done."""
        running = []
        for work in self._texts:
            if stop_if_asked(work, self._stats):
                self._release(work)
            else:
                running.append(work)
        self._texts = running
        if not running:
            return
        limit = self._scheduler.text_rows()
        if limit is not None:
            taken = pack(running, lambda t: len(t.job.rows) if t.job is not None else 0, limit)
            stepping = running[:taken]
            self._texts = running = [*running[taken:], *stepping]  # the others go first next time
        else:
            stepping = running
        began = time.perf_counter()
        try:
            rows = self._sessions.model.step([t.job for t in stepping if t.job is not None], self._stacked)
        except Exception as e:
            log.exception("a batched step failed; failing its %d items", len(stepping))
            for work in stepping:
                work.fail(e)
                self._release(work)
            self._texts = [work for work in running if work not in stepping]
            return
        charge([(t, len(t.job.rows)) for t in stepping if t.job is not None], time.perf_counter() - began)
        self._stats.batches += 1
        self._stats.batch_rows[rows] = self._stats.batch_rows.get(rows, 0) + 1
        self._texts = []
        for work in running:
            assert work.job is not None
            if work.job.done:
                self.finish(work)
            else:
                self._texts.append(work)

    def finish(self, work: Text) -> None:
        try:
            work.future.set_result(self._score(work))
        except Exception as e:
            work.fail(e)
        finally:
            self._release(work)

    def fail(self, error: BaseException) -> None:
        for work in self._texts:
            work.fail(error)
            self._release(work, scheduler=False)
        self._texts = []

    def _release(self, work: Text, revision: str | None = None, *, scheduler: bool = True) -> None:
        """The work is done with its session: its slot serves the record stored as `revision` (None: no record
        holds what the slot does now, as after a failure: the slot is dropped)."""
        if work.slot is not None and self.slots is not None:
            if revision is not None:
                self.slots.commit(work.slot, revision)
            else:
                self.slots.drop(work.slot)
            work.slot = None
        if scheduler:
            self._scheduler.release(work.session_id)

    def _score(self, work: Text) -> TextScore:
        """The text's score; an observe's session is written back."""
        assert work.job is not None
        main = work.job.rows[0]
        lp = torch.cat(main.logprobs) if main.logprobs else torch.zeros(0)  # (T,)
        bits = -float(lp.double().sum()) / LN2 if lp.numel() else 0.0  # not -0.0 for nothing scored
        static_bits = None
        self._stats.nonfinite_resets += main.dropped + main.resets
        if work.mode == "observe":
            assert work.session is not None and work.text is not None
            shadow = work.job.rows[1]
            static_bits = -shadow.total_logprob() / LN2 if shadow.logprobs else 0.0
            session = self._sessions.model.observed(work.session, work.text, bits, static_bits)
            # written only over the record `work.session` was read as: SessionConflict if another server wrote the
            # session meanwhile (this observe is then not applied at all, and its client may send it again)
            stored = self._sessions.store.update(session)
            if stored is None:
                raise SessionNotFound(session.id)  # deleted while it was being observed
            self._release(work, stored.revision, scheduler=False)  # the slot holds what the store now does
            self._stats.updates += main.updates  # applied
        texts = self._ckpt.tokenizer.token_texts(work.scored) if work.logprobs else None
        return TextScore(bits=bits, bytes=len(work.scored), logprobs=lp.tolist() if work.logprobs else None,
                         static_bits=static_bits, updates=main.updates,
                         nonfinite_reset=bool(main.dropped or main.resets), tokens=int(lp.numel()),
                         pending_bytes=len(work.pending), token_texts=texts)
