"""Real `adaptlm serve` processes (so that a test can `kill -9` one and read its resident memory) and a
redis-server of the test's own on a fixed loopback port (so that it can be stopped, paused and started again
where the server expects it). Everything listens on 127.0.0.1 and is stopped when its block ends.

Helpers are handed out as fixtures (`start_server`, `redis_process`), as in tests/server/conftest.py.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench._replicas import binary
from server.launch import Served, free_port, serving

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass(frozen=True)
class ServerProcess(Served):
    """One `adaptlm serve` child (`server.launch.Served`) that a test kills and measures."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_bytes(self) -> int:
        """Resident memory now (VmRSS of /proc/<pid>/status)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def kill9(self) -> None:
        """SIGKILL: no drain, no lifespan end, no snapshot."""
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(30) == -signal.SIGKILL


@contextmanager
def run_server(checkpoint: Path, log: Path, env: dict[str, str] | None = None,
               timeout_s: float = 120.0) -> Iterator[ServerProcess]:
    """`adaptlm serve` on a free loopback port with `env` (ADAPTLM_* settings) until the block ends (SIGTERM,
    then SIGKILL), or until the test kills it. One torch thread: the machine is shared."""
    with serving(checkpoint, log, {"OMP_NUM_THREADS": "1", "ADAPTLM_LOG_LEVEL": "warning"} | (env or {}),
                 start_s=timeout_s) as served:
        yield ServerProcess(served.url, served.process, served.log)


StartServerFn = Callable[..., AbstractContextManager[ServerProcess]]


@pytest.fixture
def start_server(tiny_checkpoint: Path, tmp_path: Path) -> StartServerFn:
    """`with start_server(env={...}) as server:` a tiny-checkpoint server (its log in tmp_path/server.log)."""

    def start(env: dict[str, str] | None = None, checkpoint: Path | None = None) -> AbstractContextManager[
            ServerProcess]:
        return run_server(checkpoint or tiny_checkpoint, tmp_path / "server.log", env)

    return start


# -- Redis -----------------------------------------------------------------------------------------------------


def _redis_binary() -> str:
    try:
        return binary("redis-server", "/usr/bin")
    except RuntimeError as e:  # the Redis session store is tested against a real one
        pytest.fail(f"{e}, or `apt-get install redis-server`", pytrace=False)


@dataclass
class RedisProcess:
    """A redis-server on one loopback port that can be stopped, paused and started again on the same port.
    With `durable`, every write is in an append-only file synced before the reply (a restart keeps it all)."""

    directory: Path
    durable: bool = False
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        self.process = subprocess.Popen(
            [_redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
             "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        try:
            while self.process.poll() is None and time.monotonic() < deadline:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError(f"redis-server did not start on port {self.port} (see {self.directory}/redis.log)")

    def stop(self) -> None:
        """SIGTERM (a clean stop; its port is free once it returns)."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers (a hung or partitioned Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """`redis_process(durable=False)`: a started RedisProcess, stopped at the end of the test."""
    started: list[RedisProcess] = []

    def make(durable: bool = False) -> RedisProcess:
        directory = tmp_path / f"redis-{len(started)}"
        directory.mkdir()
        r = RedisProcess(directory, durable=durable)
        r.start()
        started.append(r)
        return r

    yield make
    for r in started:
        r.stop()


# -- the one error shape ---------------------------------------------------------------------------------------


def check_error(response: httpx.Response, status: int, type_: str, code: str | None = None) -> dict[str, Any]:
    """The response is an error in the one shape with this status and type (and code, when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error: dict[str, Any] = body["error"]
    assert error["type"] == type_ and isinstance(error["message"], str) and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.fixture(scope="session")
def assert_error_shape() -> Callable[..., dict[str, Any]]:
    return check_error
