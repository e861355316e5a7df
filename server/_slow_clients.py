"""Deadlines for slow clients (slowloris): uvicorn waits for a request's head, and for its body, as long as the client
likes, so a few thousand connections that send a byte a minute (or nothing) hold the server's sockets forever.

- The head: `HeadDeadlineProtocol`, uvicorn's h11 protocol with a deadline from a connection's first byte (or its
  opening; for a pipelined request, the answer to the one before it) to the end of the request's headers; past it
  the client is answered 408 in the one error shape and the connection is closed. (uvicorn's keep-alive timer only
  runs between requests, and any byte stops it.)
- The body: `app.BodyLimitMiddleware` reads it with the same time allowed between two reads (its `idle_s`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11

from server._http_protocol import ErrorShapeProtocol
from server.errors import RequestTimeoutError

__all__ = ["head_deadline_protocol"]


def _timeout_response(message: str) -> bytes:
    body = RequestTimeoutError(message, code="request_timeout").body().model_dump_json().encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class HeadDeadlineProtocol(ErrorShapeProtocol):
    """uvicorn's H11Protocol (its refusals in the error shape: ErrorShapeProtocol) with `head_s`: the time a
    request's head (request line and headers) may take to arrive."""

    head_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that sends nothing at all is closed too

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of a keep-alive connection's next request
        super().data_received(data)
        if self._head_deadline is not None and (self.conn.their_state is not h11.IDLE or self._lingering is not None):
            self._disarm()  # the head is in (the app and BodyLimitMiddleware have the request), or was refused

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # a pipelined request's head that came in part behind the one just answered: no byte of it is to come
        # through `data_received` first (an idle keep-alive connection, nothing buffered, stays the keep-alive's)
        if (self._head_deadline is None and not self.transport.is_closing() and self.conn.their_state is h11.IDLE
                and self.conn.trailing_data[0]):
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_deadline = self.loop.call_later(self.head_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is None or self.cycle.response_complete:  # nothing of ours is being sent on it
            self.transport.write(_timeout_response(
                f"the request's head did not arrive within {self.head_s:g} s; the connection is closed"))
        self.transport.close()


def head_deadline_protocol(head_s: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for uvicorn's `http` option, with this deadline."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_s": head_s})
