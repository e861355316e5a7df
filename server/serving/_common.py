"""What both generation surfaces share: limits, server-sent events, stream metrics, disconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from fastapi.sse import format_sse_event
from pydantic import BaseModel

from server.engine import AnyEngine, EngineUnavailable, Event, Finished, Token
from server.errors import APIError, PayloadTooLargeError, UnprocessableEntityError, to_api_error
from server.metrics import Metrics
from server.protocol import ErrorResponse
from server.settings import Settings

__all__ = ["Context", "StreamTimer", "check_limit", "check_prompt", "check_text", "error_event",
           "run_unless_disconnected", "sse", "sse_response"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    """What a serving function needs from the app and the request."""

    engine: AnyEngine
    settings: Settings
    metrics: Metrics
    request: Request
    route: str  # metric label
    owner: str | None = None  # the API key's hash: whose sessions this request may use


def check_text(data: bytes, settings: Settings, param: str) -> None:
    if len(data) > settings.max_text_bytes:
        raise PayloadTooLargeError(f"{param} is {len(data)} bytes; this server takes at most "
                                   f"{settings.max_text_bytes}", param=param, code="text_too_long")


def check_prompt(prompt: bytes, settings: Settings) -> None:
    check_text(prompt, settings, "prompt")


def check_limit(value: int, limit: int, param: str) -> None:
    """The schema bounds what it can; this is for the limits that come from the server's settings."""
    if value > limit:
        raise UnprocessableEntityError(f"{param}: Input should be less than or equal to {limit} (this server's limit)",
                                       param=param, code="less_than_equal")


def sse(payload: BaseModel | str) -> bytes:
    """One server-sent event whose data is `payload`'s JSON (or the string as it is, e.g. `[DONE]`)."""
    return format_sse_event(data_str=payload if isinstance(payload, str) else payload.model_dump_json())


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    # Starlette cancels the iteration when the client disconnects; the iterators cancel their engine work
    # when they are left, so a disconnect stops the generation between two tokens.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def error_event(exc: Exception, request: Request) -> ErrorResponse:
    """A failure after a stream started, in the one error shape (it becomes the stream's last event)."""
    error = to_api_error(exc, request)
    if isinstance(exc, EngineUnavailable):
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    elif not isinstance(exc, APIError):
        log.error("unexpected error in a stream of %s %s", request.method, request.url.path, exc_info=exc)
    return error.body()


@dataclass
class StreamTimer:
    """Observes time to first token and inter-token latency of one stream, from the engine's timestamps."""

    metrics: Metrics
    route: str
    submitted: float
    _last: dict[int, float] = field(default_factory=dict)

    def observe(self, event: Event) -> None:
        if not isinstance(event, Token):
            if isinstance(event, Finished):
                self._last.pop(event.index, None)
            return
        model = self.metrics.model
        last = self._last.get(event.index)
        if last is None:
            self.metrics.time_to_first_token.labels(model, self.route).observe(event.time - self.submitted)
        else:
            self.metrics.inter_token_latency.labels(model, self.route).observe(event.time - last)
        self._last[event.index] = event.time


async def _disconnected(request: Request) -> None:
    # The body has been read: the next message is http.disconnect when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Await `work`; if the client disconnects first, cancel it (and so its engine work) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.wait({task})  # let it leave its `async with` blocks (which cancel the engine work)
        return None
    return task.result()
