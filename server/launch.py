"""Running `adaptlm serve` as a child process on a loopback port: what the load tests, the benchmarks and the
shutdown tests share. No torch, no FastAPI: it only starts a process and polls it over HTTP."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx

__all__ = ["free_port", "stop", "wait_ready"]


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
