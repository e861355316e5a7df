"""Shedding load at the door: a request for model work that finds this process holding as many such requests as the
engine can queue and run gets its 429 (`queue_full`) at once, before its body is read or its route runs.

Without it a burst was refused in arrival order only after every request before it had gone through the whole app
(parsing, checks, its submission): under 400 scores at once, the refused waited about 2 s for their 429. Each request
for model work takes a place here and, before running on, lets the event loop turn once, so that the requests that
arrived with it reach the door first and those beyond the limit are answered in microseconds. The engine's own queue
(`max_queue`) still refuses what gets past (work from other HTTP processes, sessions' turns)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server._asgi import HTTPMiddleware
from server.engine import EngineOverloaded
from server.errors import handle_error

__all__ = ["AdmissionMiddleware", "door_limit"]

WORK_METHODS = frozenset({"POST", "PUT"})  # under /v1/: scores, generations, session work and imports


def door_limit(max_queue: int, processes: int) -> int:
    """What one HTTP process admits at once: its share of the server's `max_queue` (queued or running). A burst is
    then refused here, at once, rather than by the engine's queue after the requests before it have run their checks
    (the engine's queue counts only work waiting to start, so it never refuses what the doors let in, unless the
    workers' shares are uneven)."""
    return max(1, -(-max_queue // max(1, processes)))


class AdmissionMiddleware(HTTPMiddleware):
    def __init__(self, app: ASGIApp, limit: int, retry_after_s: int) -> None:
        super().__init__(app)
        self.limit, self.retry_after_s = limit, retry_after_s
        self.inside = 0  # requests for model work past the door and not yet answered

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in WORK_METHODS or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.inside >= self.limit:
            refused = EngineOverloaded("the server is at capacity; retry after the Retry-After header's seconds",
                                       retry_after_s=self.retry_after_s)
            response = await handle_error(Request(scope, receive), refused)
            await response(scope, receive, send)
            return
        self.inside += 1
        try:
            await asyncio.sleep(0)  # the requests that arrived with this one reach the door before its work runs
            await self.app(scope, receive, send)
        finally:
            self.inside -= 1
