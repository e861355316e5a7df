"""A live server (`adaptlm serve` on a free loopback port, the tiny checkpoint) that has seen every kind of
request, so that its /metrics has every labelled series; and the Prometheus binaries."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from adaptlm_client import Client
from loadtest.run import start_server

ROOT = Path(__file__).resolve().parents[2]


def traffic(url: str) -> None:
    """One request of each kind the dashboards and rules look at (streams, suggestions, observes, a 404)."""
    with Client(url) as client:
        client.score("It is a truth universally acknowledged")
        with client.generate_stream("It was a dark", max_tokens=8, seed=1) as stream:
            for _ in stream:
                pass
        session = client.create_session(initial_text="Dear Sir, ")
        session.observe("I write to you about the house.")
        session.suggest("The hou")
        session.delete()
    with httpx.Client(base_url=url, timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        assert http.post("/v1/completions", json={"model": model, "prompt": "Once", "max_tokens": 4}).status_code == 200
        assert http.get("/v1/sessions/no-such-session-0000").status_code == 404


@pytest.fixture(scope="module")
def live_url(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with start_server(tiny_checkpoint, log=log) as url:
        traffic(url)
        yield url


def _binary(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if found is None:
        pytest.fail(f"{name} is not installed, and the monitoring assets are tested against a real one: run "
                    "`make test` (it installs the system package), or `apt-get install prometheus`", pytrace=False)
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _binary("prometheus")


TrafficFn = Callable[[str], None]


@pytest.fixture(scope="session")
def send_traffic() -> TrafficFn:
    return traffic
