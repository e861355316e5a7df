"""Shedding load at the door (server/_admission.py): a request for model work beyond what the server holds
(`max_queue`, its HTTP processes' shares) is answered 429 `queue_full` at once, its body unread and its route not
run; what holds no model work (reads, health, metrics) passes; places free as answers end. The HTTP protocol keeps the
door: a refusal is written in the call that brought the request's bytes, before any request's app runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from server._admission import (
    HELD,
    STATE_KEY,
    Admission,
    AdmissionMiddleware,
    Door,
    SharedDoor,
    shared_places,
    work_request,
)
from server._http_protocol import ADMITTED_A_TURN
from server._slow_clients import head_deadline_protocol
from server.metrics import Metrics
from server.settings import Settings
from tests.server.conftest import AssertErrorFn, ServeFn

LONG = "It is a truth universally acknowledged. " * 3000  # about 120 KB: seconds of the tiny model's time


def _hold(url: str, path: str, body: dict[str, str]) -> socket.socket:
    """Send a request and leave its connection open, its answer unread (the work stays in flight)."""
    address = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_the_workers_of_a_server_share_its_places() -> None:
    """Two workers' doors (here in one process, each taking its own slot): the limit is the server's; a slot of a
    worker that died gives its places back to the one that takes it."""
    places = shared_places(2)
    one, two = SharedDoor(3, places), SharedDoor(3, places)
    assert [one.enter(), one.enter(), two.enter(), two.enter(), one.enter()] == [True, True, True, False, False]
    one.leave()
    assert two.enter() and not one.enter()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with places.get_lock():
        places[4], places[5] = gone.pid, 2  # a third slot, of a worker that died holding 2 places
        places[6] = os.getpid() + 10**7  # a fourth, of no process (the pid is beyond any)
    assert sum(places[2 * s + 1] for s in range(len(places) // 2)) == 5
    replacement = SharedDoor(3, places)  # takes the dead worker's slot
    assert replacement._slot == 2 and places[5] == 0
    two.leave()
    assert replacement.enter() and not replacement.enter()


def test_work_beyond_the_door_is_refused_at_once_and_the_rest_still_served(
        serve_app: ServeFn, tiny_checkpoint: Path, assert_error: AssertErrorFn) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_queue=2, max_request_engine_s=0, retry_after_s=2)
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        held = [_hold(live.url, "/v1/score", {"text": LONG}) for _ in range(2)]
        try:
            time.sleep(0.5)
            start = time.monotonic()
            refused = c.post("/v1/score", json={"text": LONG})
            assert time.monotonic() - start < 2.0  # not after the held work
            assert assert_error(refused, 429, "rate_limit_error")["code"] == "queue_full"
            assert refused.headers["Retry-After"] == "2"
            assert assert_error(c.post(f"/v1/sessions/{sid}/observe", json={"text": "abc"}), 429,
                                "rate_limit_error")["code"] == "queue_full"
            # no model work: served whatever the load
            assert c.get(f"/v1/sessions/{sid}").status_code == 200
            assert c.get("/healthz").status_code == 200
            # refused by the server's protocol (its answer closes the connection), its body never read
            address = urlsplit(live.url)
            with socket.create_connection((address.hostname, address.port), timeout=10) as raw:
                raw.sendall(_request("over-1"))
                answer = b""
                while chunk := raw.recv(65536):
                    answer += chunk
            head = answer.split(b"\r\n\r\n")[0].decode().lower().split("\r\n")
            assert head[0].startswith("http/1.1 429") and "x-request-id: over-1" in head and "connection: close" in head
            assert 'reason="queue_full"} 3.0' in c.get("/metrics").text
        finally:
            for sock in held:
                sock.close()  # the clients go away: their work is cancelled, their places free
        deadline = time.monotonic() + 30
        while (answer := c.post("/v1/score", json={"text": "abc"})).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer.status_code == 200


def _request(rid: str, body: bytes = b'{"text": ') -> bytes:
    """A score request (its body, by default, not JSON: it would be a 422 if it reached validation)."""
    return (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-ID: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (rid.encode(), len(body), body))


def test_work_request_reads_a_request_line_and_its_id() -> None:
    assert work_request(_request("a-1"), cors=False) == ("POST", "/v1/score", "1.1", "a-1")
    assert work_request(b"PUT /v1/sessions/s/import HTTP/1.1\r\nHost: x\r\n\r\n", cors=False) == \
        ("PUT", "/v1/sessions/s/import", "1.1", None)
    assert work_request(b"GET /v1/sessions/s HTTP/1.1\r\nHost: x\r\n\r\n", cors=False) is None  # no model work
    assert work_request(b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n", cors=False) is None
    assert work_request(_request("a")[:40], cors=False) is None  # the head not all there: h11 reads it
    browser = b"POST /v1/score HTTP/1.1\r\nOrigin: https://kb.example\r\n\r\n"
    assert work_request(browser, cors=True) is None and work_request(browser, cors=False) is not None


class _Transport(asyncio.Transport):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port, self.written, self.eof, self.closed = port, bytearray(), False, False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", self.port), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_refusal_is_written_before_any_request_is_parsed_or_run() -> None:
    """Five requests arrive at once at a door of 2 places: the 2 first take the places, and the 3 others have their
    429 written in the very call that brought their bytes (no task, no app, no body validation: their bodies are not
    JSON), before the admitted heads are parsed (at the event loop's next turn); the admitted requests' tasks hold the
    places (HELD) and give them back. A request whose head arrives in
    pieces takes its place in AdmissionMiddleware, as a request from a server without this protocol."""
    seen: list[Door | None] = []
    gate = asyncio.Event()  # the requests named "held" wait for it

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(HELD.get())
        if (b"x-request-id", b"held") in scope["headers"]:
            await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def main() -> None:
        door = Door(2)
        metrics = Metrics()
        admission = Admission(door, 3, metrics)
        config = uvicorn.Config(AdmissionMiddleware(route, admission), lifespan="off", log_level="warning",
                                proxy_headers=False)
        config.load()
        protocol_class = head_deadline_protocol(30.0)
        state = ServerState()

        def connect(port: int) -> tuple[Any, _Transport]:
            protocol = protocol_class(config=config, server_state=state, app_state={STATE_KEY: admission},
                                      _loop=asyncio.get_running_loop())
            transport = _Transport(port)
            protocol.connection_made(transport)
            return protocol, transport

        connections = [connect(5000 + n) for n in range(5)]
        for n, (protocol, _) in enumerate(connections):
            protocol.data_received(_request(f"burst-{n}"))
        assert door.inside == 2 and not seen  # no app has run yet, and the admitted heads wait for the next turn
        assert all(protocol.conn.their_state is h11.IDLE for protocol, _ in connections)
        for n, (_, transport) in enumerate(connections):
            if n < 2:
                assert not transport.written
                continue
            head, body = bytes(transport.written).split(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            assert lines[0] == "HTTP/1.1 429 Too Many Requests"
            assert {"retry-after: 3", f"x-request-id: burst-{n}", "connection: close"} <= set(lines)
            assert json.loads(body)["error"] == {"type": "rate_limit_error", "code": "queue_full", "param": None,
                                                 "message": "the server is at capacity; retry after the "
                                                            "Retry-After header's seconds"}
            assert transport.eof  # half-closed: what the client still sends is dropped
        await asyncio.sleep(0.05)
        assert seen == [door, door] and door.inside == 0  # the tasks held the places and gave them back
        for _, transport in connections[:2]:
            assert bytes(transport.written).startswith(b"HTTP/1.1 200 ")
        scrape = metrics.render().decode()
        assert 'reason="queue_full"} 3.0' in scrape
        assert 'adaptlm_http_requests_total{method="POST",model="",route="<unmatched>",status="429"} 3.0' in scrape

        # a head in two pieces: the protocol cannot read its request line at once; the middleware keeps the door
        held = [connect(6000 + n) for n in range(2)]
        for protocol, _ in held:
            protocol.data_received(_request("held"))
        piecewise, transport = connect(6002)
        request = _request("pieces")
        piecewise.data_received(request[:10])
        piecewise.data_received(request[10:])
        assert door.inside == 2 and not transport.written
        await asyncio.sleep(0.05)
        assert bytes(transport.written).startswith(b"HTTP/1.1 429 ")
        assert b'"code":"queue_full"' in transport.written
        gate.set()
        await asyncio.sleep(0.05)
        assert door.inside == 0 and seen == [door] * 4

        # a burst of admitted requests is parsed ADMITTED_A_TURN a turn of the loop (the loop reads its sockets
        # between two turns): one arriving behind it is answered before the burst's heads are all parsed
        gate.clear()
        burst = [connect(7000 + n) for n in range(3 * ADMITTED_A_TURN)]
        door.limit = len(burst)
        for protocol, _ in burst:
            protocol.data_received(_request("held"))
        await asyncio.sleep(0)
        assert sum(protocol.conn.their_state is not h11.IDLE for protocol, _ in burst) == ADMITTED_A_TURN
        late, transport = connect(7999)
        late.data_received(_request("late"))
        assert bytes(transport.written).startswith(b"HTTP/1.1 429 ")
        gate.set()
        await asyncio.sleep(0.1)
        assert door.inside == 0 and len(seen) == 4 + len(burst)

    asyncio.run(main())


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "websocket":  # (only where uvicorn hands the connection to a WebSocket protocol)
        await send({"type": "websocket.close"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def _served(door: Door, route: Callable[..., Any] = _ok,
                  **options: Any) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """A real uvicorn on loopback with the server's protocol, its door and `options`, in this event loop: (the
    server, its port); stopped on leaving."""
    admission = Admission(door, 1, Metrics())
    app = AdmissionMiddleware(route, admission)

    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while (await receive())["type"] == "lifespan.startup":
            scope["state"][STATE_KEY] = admission  # as create_app's lifespan hands the protocol its Admission
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    config = uvicorn.Config(served, host="127.0.0.1", port=0, log_level="error",
                            **{"http": head_deadline_protocol(30.0), **options})
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def _exchange(port: int, data: bytes, answers: int) -> bytes:
    """Send `data` on a new connection and read until `answers` answers (of 2 bytes' body) or the connection's end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while answer.count(b"HTTP/1.1 ") < answers or not answer.endswith(b"\r\n\r\nok"):
            if not (chunk := sock.recv(65536)):
                break
            answer += chunk
        return answer


def test_a_place_is_given_back_once_by_pipelined_and_upgraded_requests() -> None:
    """A request pipelined behind an admitted one (its task made in the admitted one's, when that answer ends) holds
    no place of it: the place is given back once, not twice (the door would then hold more than its limit). A request
    for model work asking for a WebSocket upgrade leaves the protocol keeping the door, and one h11 refuses makes no
    task: their places are given back."""
    async def main() -> None:
        door = Door(4)
        async with _served(door) as (server, port):
            score = _request("first", b'{"text": "a"}')
            answer = await asyncio.to_thread(_exchange, port, score + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 2)
            assert answer.count(b"HTTP/1.1 200 ") == 2
            answer = await asyncio.to_thread(_exchange, port, score + _request("second", b'{"text": "b"}'), 2)
            assert answer.count(b"HTTP/1.1 200 ") == 2
            deadline = time.monotonic() + 10
            while server.server_state.tasks and time.monotonic() < deadline:  # their places given back as they end
                await asyncio.sleep(0.01)
            assert door.inside == 0
            upgrade = (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                       b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
            answer = await asyncio.to_thread(_exchange, port, upgrade, 1)
            # uvicorn upgrades where a WebSocket library is installed (its protocol refuses a POST), else serves it
            upgraded = server.config.ws_protocol_class is not None
            assert answer.startswith(b"HTTP/1.1 400 " if upgraded else b"HTTP/1.1 200 ")
            deadline = time.monotonic() + 10
            while door.inside and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert door.inside == 0
            # admitted, then refused by h11 (a header line without a colon): the place is free while the client,
            # its connection still open, lingers
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
                assert (await asyncio.to_thread(sock.recv, 65536)).startswith(b"HTTP/1.1 400 ")
                assert door.inside == 0

    asyncio.run(main())


def test_an_admitted_request_waiting_for_its_turn_is_served_through_a_graceful_shutdown() -> None:
    """uvicorn's graceful shutdown closes each connection with no request under way (`shutdown`): a request whose
    place is taken and whose head waits for the loop's next turn has arrived whole, and is answered, not dropped."""
    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def main() -> None:
        door = Door(2)
        admission = Admission(door, 1, Metrics())
        config = uvicorn.Config(AdmissionMiddleware(route, admission), lifespan="off", log_level="warning",
                                proxy_headers=False)
        config.load()
        protocol = head_deadline_protocol(30.0)(config=config, server_state=ServerState(),
                                                app_state={STATE_KEY: admission}, _loop=asyncio.get_running_loop())
        transport = _Transport(5000)
        protocol.connection_made(transport)
        protocol.data_received(_request("just-in"))
        assert door.inside == 1 and not transport.written  # admitted, its head parsed at the next turn
        protocol.shutdown()  # what uvicorn's Server.shutdown does to every connection on SIGTERM
        await asyncio.sleep(0.05)
        assert bytes(transport.written).startswith(b"HTTP/1.1 200 ")
        assert transport.closed and door.inside == 0  # answered, then closed: the server is going

    asyncio.run(main())
