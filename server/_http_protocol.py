"""What uvicorn refuses before the app sees a request, answered in the one error shape (server/errors.py).

uvicorn's h11 protocol answers a request it cannot parse (a path with raw non-ASCII bytes, `Content-Length: abc`,
a header line without a colon) with a plain-text 400, and closes the connection with the rest of the request still
unread, which makes the kernel reset it: a client still sending (a 1 MB header) gets the reset instead of the
answer. `ErrorShapeProtocol` answers such a request with a JSON error and an `X-Request-ID`, as the app answers
everything else:

- 400 `invalid_request_error`, code `malformed_http`: not HTTP/1.1 as RFC 9112 writes it;
- 431 `invalid_request_error`, code `header_too_large`: a request line and headers over MAX_HEAD_BYTES in all.

It also keeps the app's door (server/_admission.py): a request for model work takes its place, or gets its 429, when
its first bytes arrive, before h11 parses them.

The head is bounded twice: h11 refuses a head still incomplete after `MAX_HEAD_BYTES` (uvicorn's
`h11_max_incomplete_event_size`, so no more than that is buffered), and a head that arrived whole in fewer reads
is measured once parsed, so the bound does not depend on how the bytes were split into packets. After the answer
the connection is half-closed and what the client still sends is read and dropped (a lingering close, as nginx's
`lingering_close`) for up to LINGER_S or LINGER_BYTES, so that it reads the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server._admission import PLACE_KEY, STATE_KEY, Admission, Door, Place, WorkRequest, work_request
from server.errors import APIError, BadRequestError, raw_error_answer
from server.request_id import HEADER, REQUEST_ID, request_id_for

__all__ = ["ADMITTED_A_TURN", "LINGER_BYTES", "LINGER_S", "MAX_HEAD_BYTES", "ErrorShapeProtocol", "HeadTooLargeError"]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # h11's default; nginx's default allows 8 KB a header line (large_client_header_buffers)
LINGER_S = 5.0  # what a refused client may still send for, after its answer, before the connection is closed
LINGER_BYTES = 4 << 20  # and how much
# Admitted heads parsed a turn of the event loop (`_Admitted`): each costs its parsing, its task's start and its work
# (0.1-1 ms on a slow core), so a turn stays a few ms however many arrived at once.
ADMITTED_A_TURN = 8


class HeadTooLargeError(BadRequestError):
    status = 431


def _head_bytes(event: h11.Request) -> int:
    """The size of a request's head as sent, give or take the whitespace h11 strips: request line and headers."""
    line = len(event.method) + len(event.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items()) + 2


class _Connection(h11.Connection):
    """h11's server side, with the head bound applied to heads that arrived whole, and the error it refused with."""

    refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refused = exc
            raise
        if isinstance(event, h11.Request) and _head_bytes(event) > MAX_HEAD_BYTES:
            self.refused = h11.RemoteProtocolError("request head too large", error_status_hint=431)
            raise self.refused
        return event


def _refusal(exc: h11.RemoteProtocolError | None) -> APIError:
    if exc is not None and exc.error_status_hint == 431:
        return HeadTooLargeError(f"the request line and headers are over {MAX_HEAD_BYTES:,} bytes in all; the "
                                 "connection is closed", code="header_too_large")
    # h11's reason without what it quotes of the request after a colon ("illegal header line: b'...'")
    reason = str(exc).split(":", 1)[0].strip() if exc is not None else ""
    detail = f" ({reason[:100]})" if reason else ""
    return BadRequestError(f"the request is not valid HTTP/1.1{detail}; the connection is closed",
                           code="malformed_http")


class _Admitted:
    """The admitted requests of an event loop whose heads wait to be parsed, parsed ADMITTED_A_TURN a turn of the loop
    in arrival order: between two turns the loop reads the sockets again, so that a request arriving behind a burst
    gets its 429 (or its place) after at most one turn's worth of other requests' parsing and work, not the burst's."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Admitted] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:  # no reference to its loop: the loop's entry in `_of` goes with it
        self.waiting, self.scheduled = collections.deque[ErrorShapeProtocol](), False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Admitted:
        if (admitted := cls._of.get(loop)) is None:
            admitted = cls._of[loop] = cls()
        return admitted

    def add(self, protocol: ErrorShapeProtocol) -> None:
        self.waiting.append(protocol)
        if not self.scheduled:
            self.scheduled = True
            protocol.loop.call_soon(self._turn, protocol.loop)

    def _turn(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for _ in range(min(ADMITTED_A_TURN, len(self.waiting))):
                self.waiting.popleft()._admitted()
        finally:  # one that raised (the loop logs it) holds up none of the others
            self.scheduled = bool(self.waiting)
            if self.scheduled:
                loop.call_soon(self._turn, loop)


class ErrorShapeProtocol(H11Protocol):
    """H11Protocol answering what it refuses in the error shape, with a lingering close, and keeping the door (module
    docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._lingering: asyncio.TimerHandle | None = None
        self._dropped = 0
        self._place: Door | None = None  # taken for a request whose task has not started yet
        self._waiting: bytearray | None = None  # an admitted request's first bytes, until its turn (`_admitted`)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # after a refusal: read and dropped
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        if self._waiting is not None:
            self._waiting += data
            return
        admission: Admission | None = self.app_state.get(STATE_KEY)
        if self._place is None and admission is not None and self._between_requests():
            request = work_request(data, admission.cors)
            if request is not None:
                if not admission.door.enter():
                    self._refuse_at_door(admission, request)
                    return
                self._place = admission.door
                # Refusals first: its head is parsed (and its task made) once the event loop has been through the
                # bytes of every connection that arrived with it, each admitted or answered 429 without parsing.
                self._waiting = bytearray(data)
                self.transport.pause_reading()
                _Admitted.of(self.loop).add(self)
                return
        if self._place is None:
            super().data_received(data)
            return
        cycle, tasks = self.cycle, set(self.tasks)
        super().data_received(data)
        if self.cycle is not cycle and self._place is not None:  # its task is made: it holds the place
            self._hand_over(self._place, [task for task in self.tasks if task not in tasks])

    def _hand_over(self, door: Door, made: list[asyncio.Task[None]]) -> None:
        """The request's task, just made, holds its place until its work ends (AdmissionMiddleware gives it back) or
        the task ends, however it ends (answered, failed, cancelled before it ran, or run by uvicorn's own 503 app
        past `limit_concurrency`, which no middleware of ours sees): its done-callback gives it back, if still held,
        needing nothing of the task's context (uvicorn's `reset_contextvars` runs it in an empty one). Its scope
        holds the `Place` (PLACE_KEY), for AdmissionMiddleware."""
        self._place = None
        if len(made) != 1:  # not the one task uvicorn makes a request: a place never given back would shrink the door
            door.leave()
            return
        place = Place(door)
        cast(dict[str, Any], self.cycle.scope)[PLACE_KEY] = place  # (read when the task first runs, after this)
        made[0].add_done_callback(lambda _: place.leave())

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The connection goes to uvicorn's WebSocket protocol, whose `connection_lost` gives back no place: no task of
        ours is made for it, so the place is given back here."""
        if self._place is not None:
            self._place.leave()
            self._place = None
        super().handle_websocket_upgrade(event)

    def _unsupported_upgrade_warning(self) -> None:
        """An Upgrade uvicorn does not take (the server serves no WebSocket: `ws="none"`, `server.app.uvicorn_options`)
        is served as the HTTP/1.1 request it also is; not a warning, nor a line a client could flood the log with."""
        log.debug("an upgrade to %r not taken: served as HTTP/1.1", self._get_upgrade())

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown closes a connection with no request under way: an admitted request whose head
        waits for its turn has arrived whole, so it is parsed now, and served like the requests already under way."""
        if self._waiting is not None:
            self._admitted()
        super().shutdown()

    def _admitted(self) -> None:
        data, self._waiting = self._waiting, None
        if data is None or self.transport.is_closing():  # the client went away (`connection_lost` freed the place)
            return
        self.transport.resume_reading()
        self.data_received(bytes(data))  # the whole protocol's: the head deadline sees the head in

    def _between_requests(self) -> bool:
        """No request of this connection's under way or buffered: its next bytes begin a request."""
        conn = self.conn
        return (conn.their_state is h11.IDLE and conn.our_state is h11.IDLE and not conn.trailing_data[0]
                and (self.cycle is None or self.cycle.response_complete))

    def _refuse_at_door(self, admission: Admission, request: WorkRequest) -> None:
        self._unset_keepalive_if_required()
        rid = request_id_for(request.request_id)
        self.transport.write(admission.answer(rid))
        admission.count_refusal(request.method)
        if self.access_log:  # uvicorn's access line, as for the requests it answers
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
            token = REQUEST_ID.set(rid)
            try:
                self.access_logger.info('%s - "%s %s HTTP/%s" %d', client, request.method, request.target,
                                        request.http_version, 429)
            finally:
                REQUEST_ID.reset(token)
        self._close_lingering()

    def eof_received(self) -> None:
        if self._lingering is not None:
            self.transport.close()  # the client has sent all it had, and has the answer
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering is not None:
            self._lingering.cancel()
        self._waiting = None
        if self._place is not None:  # gone before its request's task was made
            self._place.leave()
            self._place = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls for a request h11 refused (`msg` is uvicorn's one text for them all)."""
        error = _refusal(getattr(self.conn, "refused", None))
        rid = request_id_for(None)
        token = REQUEST_ID.set(rid)
        try:
            log.info("refused a request from %s: %s", self.client[0] if self.client else "?", error.message)
        finally:
            REQUEST_ID.reset(token)
        head, body = raw_error_answer(error)
        if self._place is not None:  # refused before its task was made: its place is not held while the client lingers
            self._place.leave()
            self._place = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:  # a request body h11 refused (bad chunked encoding)
            cycle.disconnected = True  # the app reading it sees the client gone, and what it sends is dropped
            cycle.message_event.set()
            if cycle.response_started:  # the app's answer is under way: nothing can follow it on this connection
                self.transport.close()
                return
        self.transport.write(b"%s%s: %s\r\n\r\n%s" % (head, HEADER.lower().encode(), rid.encode(), body))
        self._close_lingering()

    def _close_lingering(self) -> None:
        """After the answer written last: the connection half-closed, what the client still sends dropped."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the answer, then FIN: the client reads it and its end of stream
        self.transport.resume_reading()  # flow control may have paused it; what comes now is dropped
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)
