"""Work items and the executor interface: what the scheduler (`_scheduler.py`) queues, orders and hands out.

Every piece of work the engine accepts is a `Work`: its future (what its caller awaits), its cancel flag (set
when the caller goes away), its engine-time budget (`Budget`: one request's, shared by all the work it
submitted), its session and owner, and whether it counts against `max_queue`. Its `kind`
names the executor that runs it: session operations (`call`, here), keyboard suggestions (`suggest`,
`_suggest.py`), text work (`text`, `_text.py`) and generations (`generate`, `_generation.py`). Each executor
starts work that the scheduler admits, steps all of its running work at once (one batched model call), and
finishes (answers) the work that is done. No torch here: the scheduler imports this module.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from server.engine._errors import EngineBudgetExceeded
from server.engine._stats import EngineStats

__all__ = ["Budget", "Call", "CallExecutor", "Executor", "Kind", "Work", "charge", "stop_if_asked"]

Kind = Literal["call", "suggest", "text", "generate"]
W = TypeVar("W", bound="Work", contravariant=True)


class Budget:
    """The engine time one request may take (`limit_s`; inf: no limit): its share of the model calls its work took
    part in (`charge`). A request's work items share one (a completion's prompts)."""

    def __init__(self, limit_s: float = math.inf) -> None:
        self.limit_s = limit_s
        self.spent_s = 0.0  # written by the worker thread only

    @classmethod
    def of_setting(cls, max_request_engine_s: float) -> Budget:
        """A new request's budget under `max_request_engine_s` (0: no limit)."""
        return cls(max_request_engine_s if max_request_engine_s > 0 else math.inf)

    @property
    def exceeded(self) -> bool:
        return self.spent_s > self.limit_s

    def error(self) -> EngineBudgetExceeded:
        return EngineBudgetExceeded(self.limit_s)


def charge(rows: Sequence[tuple[Work, int]], seconds: float) -> None:
    """One model call of `seconds` over `rows` (each work item with its rows in it): each pays its rows' share, so
    that a request's budget measures the engine it used, not how many others shared its batches."""
    total = sum(n for _, n in rows)
    for work, n in rows:
        work.budget.spent_s += seconds * n / total


def stop_if_asked(work: Work, stats: EngineStats) -> bool:
    """(Executors, between two segments of running work.) Its caller went away, or its request's budget is spent:
    fail it (with CancelledError, or EngineBudgetExceeded for its caller to answer), count it, and -> True."""
    if work.cancelled:
        stats.count_cancelled(work.kind)
        work.fail(asyncio.CancelledError())
        return True
    if work.budget.exceeded:
        stats.budget_exceeded += 1
        work.fail(work.budget.error())
        return True
    return False


class Work:
    """One piece of work, from its submission to its answer."""

    kind: ClassVar[Kind]
    keystroke: ClassVar[bool] = False  # its start means someone is typing (text steps get shorter: `_scheduler`)

    def __init__(self, *, session_id: str | None = None, owner: str | None = None, counted: bool = True,
                 budget: Budget | None = None) -> None:
        self.future: Future[Any] = Future()
        self.budget = budget or Budget()
        # Work on one session runs one item at a time, in arrival order; None: no turn to wait for.
        self.session_id = session_id
        self.owner = owner
        self.counted = counted  # counts against max_queue until it starts (internal follow-ups do not)
        self._cancelled = threading.Event()

    @property
    def rows(self) -> int:
        """Rows it takes in the batched text step (0: none)."""
        return 0

    def cancel(self) -> None:
        """Its caller went away: dropped before it starts, or stopped at its next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def begin(self) -> bool:
        """It leaves the waiting line: False (and it must not run) if its caller went away meanwhile."""
        return not self.cancelled and self.future.set_running_or_notify_cancel()

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class Executor(Protocol[W]):
    """Runs one kind of work on the worker thread."""

    @property
    def busy(self) -> bool:
        """Work of this kind is running."""

    @property
    def rows(self) -> int:
        """Rows its running work takes in the batched text step."""

    def start(self, work: W) -> None:
        """Set up `work`, which the scheduler has admitted (and which its caller still waits for)."""

    def step(self) -> None:
        """One step of all the running work (one batched model call); then `finish` what is done."""

    def finish(self, work: W) -> None:
        """Answer work that is done: write its session back, resolve its future, release its session."""

    def fail(self, error: BaseException) -> None:
        """Fail all the running work (the engine is stopping)."""


class Call(Work):
    """A session operation without batched model work (create, reset, import), run in the session's turn."""

    kind = "call"

    def __init__(self, run: Callable[[], Any], *, session_id: str | None, owner: str | None) -> None:
        super().__init__(session_id=session_id, owner=owner)
        self.run = run


class CallExecutor:
    """Runs a session operation as soon as it starts: nothing of it is left running."""

    busy = False
    rows = 0

    def start(self, work: Call) -> None:
        self.finish(work)

    def step(self) -> None:
        pass

    def finish(self, work: Call) -> None:
        try:
            result = work.run()
        except Exception as e:
            work.future.set_exception(e)
        else:
            work.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        pass
