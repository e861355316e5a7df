"""Shedding load at the door: a request for model work that finds the server holding `max_queue` such requests
(waiting or running) gets its 429 (`queue_full`) at once, before its body is read or its route runs.

Without it a burst was refused in arrival order only after every request before it had gone through the whole app
(parsing, checks, its submission): under 400 scores at once, the refused waited about 2 s for their 429. Each request
for model work takes a place here and, before running on, lets the event loop turn once, so that the requests that
arrived with it reach the door first and those beyond the limit are answered at once. The places are counted in this
process (`Door`), or, for the HTTP workers of one server (ADAPTLM_WORKERS), in shared memory (`SharedDoor`), so that
the limit is the server's whichever worker a connection lands on. The engine's own queue still refuses work items
beyond `max_queue` waiting to start."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server._asgi import HTTPMiddleware
from server.engine import EngineOverloaded
from server.errors import handle_error

__all__ = ["AdmissionMiddleware", "Door", "SharedDoor", "shared_places"]

WORK_METHODS = frozenset({"POST", "PUT"})  # under /v1/: scores, generations, session work and imports


class Door:
    """`limit` places, counted in this process."""

    def __init__(self, limit: int) -> None:
        self.limit, self.inside = max(1, limit), 0

    def enter(self) -> bool:
        if self.inside >= self.limit:
            return False
        self.inside += 1
        return True

    def leave(self) -> None:
        self.inside -= 1


def shared_places(workers: int) -> Any:
    """The shared memory of a server's `SharedDoor`s, made before its workers start (it crosses to them as they are
    spawned): a slot per worker, each its process id and the places it holds, as many again for replacements
    (uvicorn starts a worker's replacement before the worker stops, on SIGHUP)."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Array("q", 2 * (2 * workers + 1))


class SharedDoor(Door):
    """`limit` places for all the HTTP workers of a server, counted in `places` (`shared_places`). A worker takes a
    free slot (or one whose process is gone: a worker that died, whose places are then given back) when it starts."""

    def __init__(self, limit: int, places: Any) -> None:
        super().__init__(limit)
        self._places = places
        with places.get_lock():
            slots = len(places) // 2
            for slot in range(slots):
                pid = places[2 * slot]
                if pid == 0 or not _alive(pid):
                    places[2 * slot], places[2 * slot + 1] = os.getpid(), 0
                    self._slot = slot
                    break
            else:
                raise RuntimeError("no free place slot for this worker")

    def enter(self) -> bool:
        places = self._places
        with places.get_lock():
            if sum(places[2 * s + 1] for s in range(len(places) // 2)) >= self.limit:
                return False
            places[2 * self._slot + 1] += 1
            return True

    def leave(self) -> None:
        with self._places.get_lock():
            self._places[2 * self._slot + 1] -= 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AdmissionMiddleware(HTTPMiddleware):
    def __init__(self, app: ASGIApp, door: Door, retry_after_s: int) -> None:
        super().__init__(app)
        self.door, self.retry_after_s = door, retry_after_s

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] not in WORK_METHODS or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if not self.door.enter():
            refused = EngineOverloaded("the server is at capacity; retry after the Retry-After header's seconds",
                                       retry_after_s=self.retry_after_s)
            response = await handle_error(Request(scope, receive), refused)
            await response(scope, receive, send)
            return
        try:
            await asyncio.sleep(0)  # the requests that arrived with this one reach the door before its work runs
            await self.app(scope, receive, send)
        finally:
            self.door.leave()
