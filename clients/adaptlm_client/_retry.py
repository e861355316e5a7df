"""When a refused request is sent again, and after how long."""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DEFAULT_RETRY", "RetryPolicy", "parse_retry_after"]


def parse_retry_after(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta-seconds (decimals accepted) or an HTTP date (RFC 9110
    sec. 10.2.3); None when absent or unreadable. A date in the past is 0."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - now()
    if not math.isfinite(seconds):
        return None
    return max(seconds, 0.0)


@dataclass(frozen=True)
class RetryPolicy:
    """How `Client` and `AsyncClient` retry a request the server refused with 429 or 503 (`statuses`), or with an
    error code of `codes` whatever its status: `session_conflict`, a 409.

    Every request is retried, POSTs included: the server answers 429 (its work queue is full) and 503 (the
    model is not loaded, the engine has stopped, the session store is full of busy sessions) when it admits
    the request, before any work starts, so sending it again cannot do anything twice. The one 503 that may come
    after the work, `session_store_unavailable` on an observe whose write reached Redis but whose reply did not, is
    made safe by the observe's `Idempotency-Key` (the same on every retry): the server applies a key once.
    A 409 `session_conflict` comes after the work, when the server was about to write the session back and found
    that another request (on another replica sharing the session store) had changed it since this one read it: the
    server then writes nothing, so nothing of the request was applied, and sending it again runs it on the session as
    the other request left it. A 409 of another code (`checkpoint_mismatch`) is not retried. A connection that could
    not be made (refused, or not made in time: the server restarting, a replica going away) is retried too
    (`connect`): nothing was sent; so, under the same flag, is an observe (with its idempotency key) whose
    connection broke or timed out after it went. Nothing else is retried: not other errors, and not another
    request whose connection broke after it went (it may have been done); those are raised at once.

    The wait is the response's `Retry-After` when it has one: never shorter (that would ignore the server),
    and when it is over `max_delay_s` the error is raised instead (its `retry_after` says how long the
    server asked for). Without the header: `backoff_s * 2**n` with jitter (a uniform factor in [0.5, 1]),
    capped at `max_delay_s`. At most `max_retries` retries per call.

        Client(retry=RetryPolicy(max_retries=5, max_delay_s=30))
        Client(retry=RetryPolicy(max_retries=0))  # never retry
        Client(retry=RetryPolicy(connect=False))  # a server that is not there: the error at once
        Client(retry=RetryPolicy(codes=frozenset()))  # a session_conflict raised as ConflictError at once
    """

    max_retries: int = 2
    backoff_s: float = 0.5
    max_delay_s: float = 10.0
    statuses: frozenset[int] = field(default=frozenset({429, 503}))
    codes: frozenset[str] = field(default=frozenset({"session_conflict"}))
    connect: bool = True

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff_s < 0 or self.max_delay_s < 0:
            raise ValueError("max_retries, backoff_s and max_delay_s must not be negative")

    def delay(self, retries_done: int, status: int, retry_after: float | None,
              code: str | None = None) -> float | None:
        """Seconds to wait before retry number `retries_done + 1` of a request answered with `status` (and error
        `code`, if the answer had one), or None: do not retry, raise the error."""
        if (status not in self.statuses and code not in self.codes) or retries_done >= self.max_retries:
            return None
        if retry_after is not None:
            return retry_after if retry_after <= self.max_delay_s else None
        return self._backoff(retries_done)

    def connect_delay(self, retries_done: int) -> float | None:
        """Seconds to wait before retry number `retries_done + 1` of a request whose connection could not be made
        (nothing was sent), or None: raise the error."""
        if not self.connect or retries_done >= self.max_retries:
            return None
        return self._backoff(retries_done)

    def _backoff(self, retries_done: int) -> float:
        backoff: float = self.backoff_s * 2.0**retries_done * random.uniform(0.5, 1.0)
        return min(backoff, self.max_delay_s)


DEFAULT_RETRY = RetryPolicy()
