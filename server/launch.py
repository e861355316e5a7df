"""Running `adaptlm serve` as a child process on a loopback port: what the load tests, the benchmarks and the
shutdown tests share. No torch, no FastAPI: it only starts a process and polls it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Served", "free_port", "serving", "stop", "wait_ready"]


def free_port() -> int:
    """A port free on 127.0.0.1 now (the child binds it; if another process takes it first, the child exits)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_ready(url: str, process: subprocess.Popen[bytes], deadline: float) -> bool:
    """Poll `GET /readyz` until it answers 200 (True), or the process exits or `deadline` (monotonic) passes."""
    # One client for all the polls: `httpx.get` builds a client, and its TLS context, each time (~40 ms of CPU),
    # which made the wait itself take half a core from the server starting beside it.
    with httpx.Client(timeout=2) as client:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if client.get(f"{url}/readyz").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    return False


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM (the server drains its work), then SIGKILL after `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Served:
    """A running `adaptlm serve` child: its URL, process and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@contextmanager
def serving(checkpoint: str | Path, log: Path, env: Mapping[str, str] | None = None, *, start_s: float = 120.0,
            tries: int = 3, stop_s: float = 30.0) -> Iterator[Served]:
    """`adaptlm serve --checkpoint checkpoint` on a free loopback port, ready (`GET /readyz` 200), until the block
    ends (then SIGTERM, and SIGKILL after `stop_s`; a process the block already stopped is left as it is) -> it.
    `env` is laid over this process's environment; the log (stdout and stderr) is appended to `log`. The port is
    chosen, then bound by the child: if another process takes it in between, the child exits and another port is
    tried, `tries` times. RuntimeError, with the log's tail, if it does not start."""
    for _ in range(tries):
        port = free_port()
        with log.open("ab") as out:
            process = subprocess.Popen([sys.executable, "-m", "adaptlm", "serve", "--checkpoint", str(checkpoint),
                                        "--host", "127.0.0.1", "--port", str(port)],
                                       env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
        served = Served(f"http://127.0.0.1:{port}", process, log)
        try:
            if wait_ready(served.url, process, time.monotonic() + start_s):
                yield served
                return
            if process.poll() is None:
                raise RuntimeError(f"the server was not ready in {start_s} s: {served.tail()}")
        finally:
            stop(process, stop_s)
    raise RuntimeError(f"the server did not start: {served.tail()}")
