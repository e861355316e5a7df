"""A real server on loopback for the SDK (tests/server/conftest.py's `serve`, the one way tests run one), and
SDK clients on it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adaptlm_client import Client
from server.settings import Settings
from tests.server.conftest import LiveServer, serve

__all__ = ["LiveServer", "RecordingTransport", "serve"]


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    # no suggestion time budget: tests compare exact answers, which a loaded CI machine must not cut short
    with serve(Settings(checkpoint=tiny_checkpoint, suggest_budget_ms=0)) as server:
        yield server


@pytest.fixture
def client(live: LiveServer) -> Iterator[Client]:
    with Client(live.url, timeout=60) as c:
        yield c


class RecordingTransport(httpx.AsyncBaseTransport, httpx.BaseTransport):
    """httpx's own transport, noting (request, monotonic time, status) of every answer: the SDK re-sends the same
    `httpx.Request` when it retries, so `id(request)` links a retry to its refusal."""

    def __init__(self) -> None:
        self.sync = httpx.HTTPTransport()
        self.async_ = httpx.AsyncHTTPTransport()
        self.log: list[tuple[int, float, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.sync.handle_request(request)
        self._note(request, response)
        return response

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.async_.handle_async_request(request)
        self._note(request, response)
        return response

    def _note(self, request: httpx.Request, response: httpx.Response) -> None:
        self.log.append((id(request), time.monotonic(), response.status_code))

    def close(self) -> None:
        self.sync.close()

    async def aclose(self) -> None:
        await self.async_.aclose()

    def statuses(self) -> list[int]:
        return [status for _, _, status in self.log]

    def retry_gaps(self) -> list[float]:
        """Seconds between each refusal and the next send of the same request."""
        gaps: list[float] = []
        for i, (rid, t, status) in enumerate(self.log):
            if status in (429, 503):
                later = [t2 for rid2, t2, _ in self.log[i + 1:] if rid2 == rid]
                if later:
                    gaps.append(later[0] - t)
        return gaps
