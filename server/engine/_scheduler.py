"""The scheduler: the engine's queue, admission, per-session ordering and row packing. No torch here (an
import-linter contract keeps it out): the executors (`_work.Executor`) do the model work.

Callers on any thread `put` work; at most `max_queue` items may wait to start, beyond that `EngineOverloaded`
(HTTP 429). Each round of the worker thread (`run`):
1. take what has arrived; coming from idle (nothing running) with text work, wait up to `max_wait_ms` for more
   to fill a batch (while work runs, newcomers join at the next segment: continuous batching);
2. start waiting items in arrival order (`_admit`): an item of a session waits while earlier work of the same
   session runs (work on one session is applied one at a time, in order); text work starts while its rows fit
   in `max_batch`; session operations run at once; keyboard suggestions read a session's last committed
   record without waiting for its turn;
3. keyboard suggestions: rounds of all the word searches in progress, keystrokes that arrive meanwhile joining
   between rounds, until none is left or, while other work waits, for at most SUGGEST_SLICE_S;
4. one batched step of all running text work (while someone types, of at most TYPING_TEXT_ROWS rows: `pack`);
5. the next chunk of the prompts being read, then one token of every running generation.

Each round thus takes about one chunk of any work, and between two the executors stop work whose caller went away
or whose request has spent its engine-time budget (`_work.stop_if_asked`). The worker records when each round
begins (`stalled_s`: how long it has made no progress with work waiting or running; /readyz reads it).

Sessions with work running are claimed: busy here, pinned in the store (never evicted). A cancelled item is
dropped when it would start; `stop` lets everything queued or running finish before `run` returns.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from server.engine._errors import EngineOverloaded, EngineUnavailable
from server.engine._stats import EngineStats
from server.engine._work import Executor, Kind, Work

__all__ = ["SUGGEST_SLICE_S", "TYPING_S", "TYPING_TEXT_ROWS", "Pins", "Scheduler", "pack"]

T = TypeVar("T")
SWEEP_S = 1.0  # how often the worker drops expired sessions
# Suggestion rounds run back to back (new keystrokes joining between rounds) for at most this long while text
# work or generations wait; then one text step and one generation step run, and the searches go on.
SUGGEST_SLICE_S = 0.025
# While someone is typing (a suggestion started in the last TYPING_S), a text step takes at most TYPING_TEXT_ROWS
# rows, the texts that waited longest first: a keystroke then waits for a shorter step (a 64-row step of the
# default model is ~150 ms in bf16, a 32-row one ~80 ms; docs/notes/2026-11-benchmarks-history.md).
TYPING_S = 1.0
TYPING_TEXT_ROWS = 32


class Pins(Protocol):
    """What the scheduler needs of the session store (`SessionStore` has it)."""

    def pin(self, session_id: str) -> None: ...

    def unpin(self, session_id: str) -> None: ...

    def sweep(self) -> int: ...


def pack(items: Sequence[T], rows: Callable[[T], int], limit: int) -> int:
    """How many of `items`, from the first, one step of at most `limit` rows takes (at least one)."""
    taken = total = 0
    for item in items:
        need = rows(item)
        if taken and total + need > limit:
            break
        taken += 1
        total += need
    return taken


class Scheduler:
    def __init__(self, pins: Pins, stats: EngineStats, *, max_batch: int, max_wait_ms: float, max_queue: int,
                 retry_after_s: int) -> None:
        self._pins = pins
        self._stats = stats
        self._max_batch, self._max_wait_ms = max_batch, max_wait_ms
        self._max_queue, self._retry_after_s = max_queue, retry_after_s
        self._queue: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        # Guards _running, _waiting and the queue, so no work is queued behind the stop sentinel.
        self._lock = threading.Lock()
        self._running = False
        self._worker: threading.Thread | None = None
        self._waiting = 0  # counted items queued or pending, not yet started
        # worker-thread state
        self._pending: collections.deque[Work] = collections.deque()
        self._busy: set[str] = set()  # sessions whose work is running
        self._executors: dict[Kind, Executor[Any]] = {}
        self._last_keystroke = -math.inf  # time.monotonic() of the last suggestion started
        self._stop_asked = False  # `stop` was called: the worker's end is not a crash
        # the worker's progress, read by any thread (`stalled_s`): when it last began a round or took work, and
        # whether it was then idle (nothing pending nor running)
        self._progress = time.monotonic()
        self._idle = True

    # -- any thread ------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """The worker thread is taking work."""
        return self._running and self._worker is not None and self._worker.is_alive()

    @property
    def crashed(self) -> bool:
        """The worker thread ended while taking work (an error escaped its loop), not by `stop`."""
        return not self._stop_asked and self._worker is not None and not self._worker.is_alive()

    @property
    def waiting(self) -> int:
        with self._lock:
            return self._waiting

    def stalled_s(self) -> float:
        """Seconds since the worker last made progress (began a round, or took work), while work waits to start or
        runs; 0 when there is none. A round reads about one chunk of work (a text segment, a prompt chunk, a token),
        so a large value means a model call or the worker itself is stuck."""
        progress = self._progress
        if self._idle and self.waiting == 0:
            return 0.0
        return max(0.0, time.monotonic() - progress)

    def put(self, work: Work) -> None:
        """Queue `work`, or refuse it: EngineUnavailable when not running, EngineOverloaded when full."""
        with self._lock:
            if not self.alive:
                raise EngineUnavailable("the engine is not running")
            if self._waiting >= self._max_queue:
                raise EngineOverloaded(f"the server is busy ({self._waiting} requests waiting); retry shortly",
                                       self._retry_after_s)
            self._waiting += 1
            self._queue.put(work)

    def stop(self) -> None:
        """Take no more work; `run` returns once what is queued or running is done. Idempotent."""
        with self._lock:
            self._stop_asked = True
            if self._running:
                self._running = False
                self._queue.put(None)

    # -- the worker thread -------------------------------------------------------------------------------

    def open(self) -> None:
        """Start taking work; called on the worker thread, which then calls `run`."""
        with self._lock:
            self._worker = threading.current_thread()
            self._running = True

    def claim(self, session_id: str | None) -> None:
        """Work on the session runs: its later work waits, and the store keeps it."""
        if session_id is not None:
            self._busy.add(session_id)
            self._pins.pin(session_id)

    def release(self, session_id: str | None) -> None:
        if session_id is not None and session_id in self._busy:
            self._busy.discard(session_id)
            self._pins.unpin(session_id)

    def follow(self, work: Work) -> None:
        """Queue internal follow-up work first in line (before its session's later work; not counted)."""
        self._pending.appendleft(work)

    def text_rows(self) -> int | None:
        """The most rows one text step may take now (None: all running text work)."""
        return TYPING_TEXT_ROWS if time.monotonic() - self._last_keystroke < TYPING_S else None

    def run(self, executors: Mapping[Kind, Executor[Any]]) -> None:
        """The worker's rounds (see the module docstring), until `stop` and everything is done."""
        self._executors = dict(executors)
        texts, generations = self._executors["text"], self._executors["generate"]
        stopping = False
        last_sweep = time.monotonic()
        while True:
            idle = not self._pending and not any(e.busy for e in self._executors.values())
            self._progress, self._idle = time.monotonic(), idle
            if stopping and idle:
                return
            stopping = self._take(block=idle and not stopping) or stopping
            # not stalled while it waited for work; busy from here if work arrived
            self._progress, self._idle = time.monotonic(), idle and not self._pending
            if idle and not stopping and self._max_wait_ms > 0 and self._pending_rows():
                stopping = self._fill(time.monotonic() + self._max_wait_ms / 1000) or stopping
            self._admit()
            stopping = self._suggest_slice() or stopping
            texts.step()
            generations.step()
            if time.monotonic() - last_sweep > SWEEP_S:
                self._pins.sweep()
                last_sweep = time.monotonic()

    def _take(self, *, block: bool) -> bool:
        """Move arrived items to the pending line (waiting for one when `block`); True on the stop sentinel."""
        stopping = False
        timeout: float | None = SWEEP_S if block else None
        while True:
            try:
                work = self._queue.get(block=block, timeout=timeout)
            except queue.Empty:
                return stopping
            block = False
            if work is None:
                stopping = True  # the work queued before the sentinel still runs
            else:
                self._pending.append(work)

    def _fill(self, deadline: float) -> bool:
        """Wait until `deadline` for more text work, unless the pending work already fills a batch."""
        stopping = False
        while self._pending_rows() < self._max_batch and (left := deadline - time.monotonic()) > 0:
            try:
                work = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if work is None:
                return True
            self._pending.append(work)
            stopping = self._take(block=False) or stopping
        return stopping

    def _pending_rows(self) -> int:
        return sum(work.rows for work in self._pending)

    def _admit(self) -> None:
        """Start what may start, in arrival order (see the module docstring)."""
        texts = self._executors["text"]
        rows = texts.rows
        blocked: set[str] = set()  # sessions with an earlier item still waiting
        texts_full = False
        waiting: collections.deque[Work] = collections.deque()
        for work in self._pending:
            sid = work.session_id
            if sid is not None and (sid in self._busy or sid in blocked):
                waiting.append(work)
                blocked.add(sid)
                continue
            if work.rows and (texts_full or (rows and rows + work.rows > self._max_batch)):
                texts_full = True  # later text work waits too: first come, first served
                waiting.append(work)
                if sid is not None:
                    blocked.add(sid)
                continue
            self._left(work)
            if work.keystroke:
                self._last_keystroke = time.monotonic()
            if not work.begin():
                self._stats.count_cancelled(work.kind)
                continue
            self._executors[work.kind].start(work)
            rows = texts.rows
        self._pending = waiting

    def _suggest_slice(self) -> bool:
        """Run suggestion rounds until no search is left, starting the keystrokes that arrive meanwhile; while
        text or generation work waits, for at most SUGGEST_SLICE_S. -> True if the stop sentinel arrived."""
        suggestions = self._executors["suggest"]
        others = (self._executors["text"], self._executors["generate"])
        stopping = False
        start = time.monotonic()
        while True:
            suggestions.step()
            spent = time.monotonic() - start
            # (with nothing else waiting, still back to the loop now and then: the store's sweep runs there)
            if not suggestions.busy or (any(e.busy for e in others) and spent > SUGGEST_SLICE_S) or spent > 1.0:
                return stopping
            stopping = self._take(block=False) or stopping
            self._admit()

    def _left(self, work: Work) -> None:
        """`work` left the waiting line (started, failed or dropped)."""
        if work.counted:
            with self._lock:
                self._waiting -= 1

    def fail_all(self, error: BaseException) -> None:
        """On the way out (a stop, or a crash of the loop): nothing may wait on a future or a stream forever."""
        with self._lock:
            self._running = False
        for executor in self._executors.values():
            executor.fail(error)
        while True:
            try:
                queued = self._queue.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                self._pending.append(queued)
        for work in self._pending:
            self._left(work)
            work.fail(error)
        self._pending.clear()
        for session_id in list(self._busy):
            self.release(session_id)
