"""A real uvicorn server on a free loopback port, in a background thread of the test process; a real
redis-server on another, for the Redis session store.

Helpers are handed out as fixtures (`serve`, `assert_error`) rather than imported, so that the tests
do not depend on how pytest puts test directories on sys.path.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI

from bench._replicas import binary
from models.copymodel import CopyConfig
from server.app import create_app, uvicorn_options
from server.engine import AnyEngine
from server.settings import Settings

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class LiveServer:
    url: str
    app: FastAPI


@contextmanager
def serve(settings: Settings, start_timeout: float = 60.0, engine: AnyEngine | None = None) -> Iterator[LiveServer]:
    """Run `create_app(settings, engine=engine)` under uvicorn until the block ends. The socket is bound here (port
    0), so no other process can take the port between choosing it and listening on it."""
    app = create_app(settings, engine=engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Accepted connections inherit it: without it, a keep-alive client waits ~40 ms for each response (Nagle
    # holds the body back until the client's delayed ACK of the headers), which hides real latencies.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           **uvicorn_options(settings)))
    exit_codes: list[object] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit as e:  # uvicorn exits when the lifespan start-up fails
            exit_codes.append(e.code)

    thread = threading.Thread(target=run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the server failed to start (exit status {exit_codes}; see the captured log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {start_timeout} s")
            time.sleep(0.02)
        yield LiveServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _assert_error(response: httpx.Response, status: int, type_: str, param: str | None = None) -> dict[str, Any]:
    """The response is an error in the one shape, with this status, type and param; returns `error`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == ERROR_KEYS
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    assert error["param"] == param
    assert error["code"] is None or isinstance(error["code"], str)
    return dict(error)


def _parse_sse(lines: Iterable[str]) -> list[str]:
    """The data of each server-sent event in `lines` (httpx's iter_lines); comments and other fields are skipped."""
    events: list[str] = []
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append("\n".join(data))
    return events


ServeFn = Callable[..., AbstractContextManager[LiveServer]]  # (settings, start_timeout=60, engine=None)
AssertErrorFn = Callable[..., dict[str, Any]]
ParseSSEFn = Callable[[Iterable[str]], list[str]]


@pytest.fixture(scope="session")
def serve_app() -> ServeFn:
    """`with serve_app(settings) as live:` runs a server for the block."""
    return serve


@pytest.fixture(scope="session")
def assert_error() -> AssertErrorFn:
    """`assert_error(response, status, type, param=None)`: checks the one error shape; returns `error`."""
    return _assert_error


@pytest.fixture(scope="session")
def parse_sse() -> ParseSSEFn:
    """`parse_sse(lines)`: the data strings of the server-sent events in `lines`."""
    return _parse_sse


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    # no suggestion time budget: tests compare exact answers, which a loaded CI machine must not cut short
    with serve(Settings(checkpoint=tiny_checkpoint, suggest_budget_ms=0)) as server:
        yield server


COPY = CopyConfig(window=2048)  # the copy model of `copy_checkpoint`'s sessions


@pytest.fixture(scope="session")
def copy_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a "copy" section in its dyneval.json: every session gets a copy model (COPY), as on
    the shipped default checkpoint."""
    path = tmp_path_factory.mktemp("copy") / "tiny-copy"
    shutil.copytree(tiny_checkpoint, path)
    dyneval = json.loads((path / "dyneval.json").read_text())
    (path / "dyneval.json").write_text(json.dumps({**dyneval, "copy": COPY.to_dict()}))
    return path


@pytest.fixture
def client(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=30) as c:
        yield c


# -- Redis ---------------------------------------------------------------------------------------------


def _redis_server_binary() -> str:
    try:
        return binary("redis-server", "/usr/bin")
    except RuntimeError as e:  # the Redis session store is tested against a real one
        pytest.fail(f"{e}, or `apt-get install redis-server`", pytrace=False)


@contextmanager
def run_redis(directory: Path) -> Iterator[str]:
    """A redis-server of our own on a free loopback port (no persistence), until the block ends -> its URL."""
    binary = _redis_server_binary()
    for _ in range(5):  # the port is chosen, then bound by redis-server: another process may take it between
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(directory), "--logfile", str(directory / f"redis-{port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while process.poll() is None and time.monotonic() < deadline:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        if process.poll() is None and time.monotonic() < deadline:
            try:
                yield f"redis://127.0.0.1:{port}/0"
            finally:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            return
        process.kill()
        process.wait()
    raise RuntimeError(f"redis-server did not start (see the logs in {directory})")


RunRedisFn = Callable[[], AbstractContextManager[str]]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One redis-server for the test session -> its URL (database 0)."""
    with run_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """The session's Redis, emptied for this test."""
    with redis.Redis.from_url(redis_server) as client:
        client.flushdb()
    return redis_server


@pytest.fixture(scope="session")
def start_redis(tmp_path_factory: pytest.TempPathFactory) -> RunRedisFn:
    """`with start_redis() as url:` a redis-server of its own (for tests that stop it)."""
    return lambda: run_redis(tmp_path_factory.mktemp("redis-own"))


@pytest.fixture(scope="module")
def words_url(word_checkpoint: Path) -> Iterator[str]:
    """A server of the word checkpoint (no suggestion time budget: tests compare exact answers)."""
    with serve(Settings(checkpoint=word_checkpoint, suggest_budget_ms=0)) as live:
        yield live.url


@pytest.fixture
def words_client(words_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=words_url, timeout=60) as c:
        yield c
