"""The door's places (server/_admission.py) are given back however a request's task ends and whatever uvicorn runs in
it: the task's done-callback gives back the place the HTTP protocol took, not code in the task. And the server serves
no WebSocket (`ws="none"`): a request asking for an upgrade is answered as HTTP/1.1, through the door."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import uvicorn
from starlette.routing import BaseRoute, Mount, WebSocketRoute
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from server._admission import HELD, STATE_KEY, Admission, AdmissionMiddleware, Door
from server._slow_clients import head_deadline_protocol
from server.app import create_app, uvicorn_options
from server.metrics import Metrics
from server.settings import Settings
from tests.server.test_admission import _ok, _served


def _score(rid: str) -> bytes:
    return (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-ID: %s\r\n"
            b"Content-Length: 2\r\n\r\n{}" % rid.encode())


def _ask(port: int, data: bytes) -> bytes:
    """One request on a new connection; its whole answer (read until the server closes or the body is in)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.split(b"\r\n\r\n", 1)[1]:
            if not (chunk := sock.recv(65536)):
                break
            answer += chunk
        return answer


async def _settled(door: Door, server: uvicorn.Server) -> None:
    """Until the requests' tasks have ended (their done-callbacks run), at most 10 s."""
    deadline = time.monotonic() + 10
    while (door.inside or server.server_state.tasks) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _one_by_one(door: Door, server: uvicorn.Server, port: int, requests: list[bytes], status: bytes) -> None:
    """Each request on a connection of its own, one after the other: answered `status`, and its place back in the
    door once its task has ended."""
    for data in requests:
        answer = await asyncio.to_thread(_ask, port, data)
        assert answer.startswith(b"HTTP/1.1 " + status + b" "), answer[:200]
        await _settled(door, server)
        assert door.inside == 0


def test_requests_past_uvicorns_concurrency_limit_give_their_places_back() -> None:
    """uvicorn answers a request past `limit_concurrency` with its own 503 app, no middleware of ours in it: the
    place the protocol took for it still comes back (else each such request shrinks the door for good, and once it
    is empty every request for model work gets a 429)."""
    async def main() -> None:
        door = Door(2)
        async with _served(door, limit_concurrency=1) as (server, port):  # the connection itself reaches the limit
            await _one_by_one(door, server, port, [_score(f"r{n}") for n in range(4)], b"503")

    asyncio.run(main())


def test_a_task_in_a_fresh_context_holds_its_place_once() -> None:
    """With uvicorn's `reset_contextvars` a request's task starts in an empty context: the place the protocol took
    is still its own (not taken a second time by AdmissionMiddleware, which with a door of one would refuse it), and
    it comes back when the task ends."""
    seen: list[Door | None] = []

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(HELD.get())
        await _ok(scope, receive, send)

    async def main() -> None:
        door = Door(1)
        async with _served(door, route, reset_contextvars=True) as (server, port):
            await _one_by_one(door, server, port, [_score(f"r{n}") for n in range(3)], b"200")
        assert seen == [door] * 3

    asyncio.run(main())


def test_a_request_pipelined_behind_an_admitted_one_finds_its_place_given_back() -> None:
    """A request pipelined behind an admitted one gets its task when that one's answer ends (uvicorn's
    `on_response_complete`, in the admitted task), and takes its place in AdmissionMiddleware at its first step: the
    admitted one's place is given back by then, as its work is done (not one turn later, in its task's
    done-callback), else at a door of one every pipelined request would be refused, and at a full door one would."""
    async def main() -> None:
        door = Door(1)
        async with _served(door) as (server, port):
            for n in range(2):
                answer = await asyncio.to_thread(_ask_many, port, _score(f"a{n}") + _score(f"b{n}"), 2)
                assert answer.count(b"HTTP/1.1 200 ") == 2 and b" 429 " not in answer, answer[:600]
                await _settled(door, server)
                assert door.inside == 0

    asyncio.run(main())


def _ask_many(port: int, data: bytes, answers: int) -> bytes:
    """Requests pipelined on one connection; the answers, read until `answers` of them are in (or the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while answer.count(b"HTTP/1.1 ") < answers or not answer.endswith((b"ok", b"}")):
            if not (chunk := sock.recv(65536)):
                break
            answer += chunk
        return answer


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_place_comes_back_when_the_task_fails_or_is_cancelled_before_it_runs() -> None:
    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("a route that fails")

    async def main() -> None:
        door = Door(4)
        admission = Admission(door, 1, Metrics())
        config = uvicorn.Config(AdmissionMiddleware(failing, admission), lifespan="off", log_level="critical",
                                proxy_headers=False)
        config.load()
        state = ServerState()

        def admitted() -> None:
            protocol = head_deadline_protocol(30.0)(config=config, server_state=state,
                                                    app_state={STATE_KEY: admission}, _loop=asyncio.get_running_loop())
            protocol.connection_made(_Transport())
            protocol.data_received(_score("r"))
            assert door.inside == 1  # taken; its head is parsed (and its task made) at the loop's next turn

        admitted()
        await asyncio.sleep(0.05)  # the task ran, and failed (uvicorn answers 500)
        assert door.inside == 0

        admitted()
        made: list[asyncio.Task[None]] = []
        while not made:  # its task, made at the next turn; cancelled before its first step
            await asyncio.sleep(0)
            made = [t for t in state.tasks if not t.done()]
        (task,) = made
        assert door.inside == 1
        task.cancel()
        await asyncio.sleep(0.05)
        assert task.cancelled() and door.inside == 0

    asyncio.run(main())


def test_the_app_has_no_websocket_route_and_the_server_takes_no_upgrade(tiny_checkpoint: Path) -> None:
    """No route of the app is a WebSocket's, and its uvicorn takes no upgrade (`ws="none"`): a request asking for one
    is served as HTTP/1.1, a request for model work through the door, its place given back."""
    def routes(of: list[BaseRoute]) -> list[BaseRoute]:
        return [r for route in of for r in ([route, *routes(route.routes)] if isinstance(route, Mount) else [route])]

    settings = Settings(checkpoint=tiny_checkpoint)
    app = create_app(settings)  # (nothing loads until its lifespan starts)
    assert app.routes and not [r for r in routes(app.routes) if isinstance(r, WebSocketRoute)]
    options = uvicorn_options(settings)
    assert options["ws"] == "none"
    seen: list[str] = []

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])
        await _ok(scope, receive, send)

    async def main() -> None:
        door = Door(1)
        upgrade = (b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                   b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
        async with _served(door, route, ws=options["ws"]) as (server, port):
            answer = await asyncio.to_thread(_ask, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n%s\r\n" % upgrade)
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\nok"), answer[:200]
            work = _score("up").replace(b"Host: x\r\n", b"Host: x\r\n" + upgrade)
            # a door of one: the second is served only if the first gave its place back
            await _one_by_one(door, server, port, [work, work], b"200")
        assert seen == ["http"] * 3

    asyncio.run(main())
