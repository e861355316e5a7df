"""Shedding load at the door: a request for model work that finds the server holding `max_queue` such requests
(waiting or running) gets its 429 (`queue_full`) at once, before its headers are parsed, its body read or its route
run.

The door is kept in the HTTP front. uvicorn hands a connection's bytes to its protocol (`data_received`), which parses
the head and starts the request's task; the tasks run only after every connection whose bytes arrived with it has
been through `data_received`. A door in a middleware (in the task) was therefore reached only once every request of a
burst had been parsed and every admitted one had run through the middlewares before it, and a refusal then went
through the error handler and the middlewares' answer path: under 400 scores at once, the refused waited 0.1-0.6 s for
their 429. The protocol (server/_http_protocol.py) now reads the request line of a connection's first bytes
(`work_request`): a request for model work takes its place there, or is answered at once with a 429 made in advance
(`Admission.answer`: the one error shape, Retry-After, its X-Request-ID) and the connection closed, its head never
parsed. An admitted request's head is parsed at the event loop's next turn, so that the requests that arrived with
it are all admitted or refused first; its task, once made, lets the loop turn once more before its work runs (the
bytes read meanwhile reach the door first). The place is held until the request's work ends, and its scope says it
holds one (PLACE_KEY: a `Place`), so that `AdmissionMiddleware` does not take a second. It is given back once,
whichever comes first: by `AdmissionMiddleware` when the app's call returns (before the first step of the task of a
request pipelined behind it, made when its answer ended), or by the task's done-callback (so also where the task
failed, was cancelled before it ran, or went to uvicorn's own 503 past `limit_concurrency`, whatever context it runs
in). A request the protocol could not read at
once (its head split across packets, one pipelined behind another, a browser's under CORS, whose answer needs the CORS
middleware's headers, or a server without this protocol, as a TestClient) takes its place in `AdmissionMiddleware`.

The places are counted in this process (`Door`), or, for the HTTP workers of one server (ADAPTLM_WORKERS), in shared
memory (`SharedDoor`), so that the limit is the server's whichever worker a connection lands on. The engine's own
queue still refuses work items beyond `max_queue` waiting to start."""

from __future__ import annotations

import asyncio
import os
import re
from contextvars import ContextVar
from typing import Any, NamedTuple

from starlette.types import ASGIApp, Receive, Scope, Send

from server._asgi import HTTPMiddleware
from server.engine import EngineOverloaded
from server.errors import error_response, from_engine_error, raw_error_answer
from server.metrics import UNMATCHED, Metrics
from server.request_id import HEADER

__all__ = ["HELD", "PLACE_KEY", "STATE_KEY", "Admission", "AdmissionMiddleware", "Door", "Place", "SharedDoor",
           "shared_places", "WorkRequest", "work_request"]

WORK_METHODS = frozenset({"POST", "PUT"})  # under /v1/: scores, generations, session work and imports
STATE_KEY = "adaptlm.admission"  # the app's Admission in the lifespan state, where the server's protocol finds it

_WORK_LINE = re.compile(rb"(POST|PUT) (/v1/[^ \r\n]*) HTTP/(1\.[01])\r\n")
_HEADER_LINE = re.compile(rb"\r\n%s:[ \t]*([^\r\n]*?)[ \t]*\r\n" % HEADER.encode(), re.IGNORECASE)
_ORIGIN_LINE = re.compile(rb"\r\norigin:", re.IGNORECASE)
_HEAD_SEARCH = 16 * 1024  # how far a head's end is looked for (the protocol's MAX_HEAD_BYTES)


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


# The scope key where the protocol leaves the `Place` it took for a request (`ErrorShapeProtocol._hand_over`)
PLACE_KEY = "adaptlm.admission.place"
# In a request's task below AdmissionMiddleware, the door holding the request's place
HELD: ContextVar[Door | None] = ContextVar("adaptlm_admission_held", default=None)


class Place:
    """A place the protocol took at a door for a request, given back once though two may give it back (module
    docstring): AdmissionMiddleware when the request's work ends, the task's done-callback when the task does."""

    def __init__(self, door: Door) -> None:
        self.door, self._held = door, True

    def leave(self) -> None:
        if self._held:
            self._held = False
            self.door.leave()


class WorkRequest(NamedTuple):
    method: str
    target: str
    http_version: str
    request_id: str | None  # the X-Request-ID header's value as sent (RequestIdMiddleware's to check)


def work_request(data: bytes, cors: bool) -> WorkRequest | None:
    """What the protocol needs of a request for model work whose request line begins
    `data` (a connection's first bytes), else None: not model work, or not to be decided here (its head not all in
    `data`; or `cors`, the app answering browsers of other origins, and the request names its Origin)."""
    line = _WORK_LINE.match(data)
    if line is None:
        return None
    end = data.find(b"\r\n\r\n", line.end() - 2, _HEAD_SEARCH)
    if end < 0:  # the head is not all here: its headers are h11's to read
        return None
    head = data[line.end() - 2:end + 2]
    if cors and _ORIGIN_LINE.search(head):
        return None
    given = _HEADER_LINE.search(head)
    return WorkRequest(line.group(1).decode(), line.group(2).decode("latin-1"), line.group(3).decode(),
                       given.group(1).decode("latin-1") if given else None)


class Admission:
    """An app's door (`Door` or `SharedDoor`) and its refusals: the answer made in advance, the metrics."""

    def __init__(self, door: Door, retry_after_s: int, metrics: Metrics, cors: bool = False) -> None:
        self.door, self.retry_after_s, self.metrics, self.cors = door, retry_after_s, metrics, cors
        self._head, self._body = raw_error_answer(from_engine_error(self.refusal()))  # Retry-After included

    def refusal(self) -> EngineOverloaded:
        return EngineOverloaded("the server is at capacity; retry after the Retry-After header's seconds",
                                retry_after_s=self.retry_after_s)

    def answer(self, request_id: str) -> bytes:
        """A refusal's whole HTTP answer, with its request's ID."""
        return b"%s%s: %s\r\n\r\n%s" % (self._head, HEADER.lower().encode(), request_id.encode(), self._body)

    def count_refusal(self, method: str) -> None:
        """What MetricsMiddleware and the error handler count of a refusal the app never saw."""
        self.metrics.observe_request(method, UNMATCHED, 429, 0.0)
        self.metrics.observe_refusal("queue_full")


class AdmissionMiddleware(HTTPMiddleware):
    """The door for the requests the server's protocol did not take a place for (module docstring)."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        super().__init__(app)
        self.admission = admission

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        place: Place | None = scope.get(PLACE_KEY)  # the place the protocol took for it
        door = place.door if place is not None else None
        if door is None:
            if scope["method"] not in WORK_METHODS or not scope["path"].startswith("/v1/"):
                await self.app(scope, receive, send)
                return
            door = self.admission.door
            if not door.enter():
                self.admission.metrics.observe_refusal("queue_full")  # the request itself is MetricsMiddleware's
                await error_response(from_engine_error(self.admission.refusal()))(scope, receive, send)
                return
        token = HELD.set(door)
        try:
            # The event loop turns once before the work runs: the bytes of the requests that arrived with this one
            # (read after this task was made) reach the door, and the refused get their answer, first.
            await asyncio.sleep(0)
            await self.app(scope, receive, send)
        finally:
            HELD.reset(token)
            # now, not when the task ends: a request pipelined behind this one, whose task was made when this
            # answer ended, takes its place at its first step, which comes before this task's done-callback
            if place is not None:
                place.leave()
            else:
                door.leave()
