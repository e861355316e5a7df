"""The engine alone (no HTTP), and the app's behaviour when the engine is not running."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.checkpoint import CheckpointError
from models.scoring import score_bytes
from server.engine import Engine, EngineUnavailable
from server.settings import Settings


@pytest.fixture
def engine(tiny_checkpoint: Path) -> Any:
    e = Engine(tiny_checkpoint, thread_name="engine-under-test")
    e.start()
    yield e
    e.stop()


def test_start_loads_the_model(engine: Engine, tiny_checkpoint: Path) -> None:
    assert engine.alive
    assert engine.info.name == tiny_checkpoint.name
    assert len(engine.info.model_hash) == 64


def test_model_code_runs_on_the_worker_thread(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return score_bytes(*args, **kwargs)

    monkeypatch.setattr("server.engine._engine.score_bytes", spy)

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(engine.score(b"abc" * (i + 1), logprobs=True) for i in range(4))))

    results = asyncio.run(main())
    assert threads == ["engine-under-test"] * 4
    assert [r.bytes for r in results] == [3, 6, 9, 12]
    assert all(r.state is None and len(r.logprobs) == r.bytes for r in results)


def test_model_errors_reach_the_caller(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(engine.score(b""))
    assert engine.alive  # one failed item does not stop the worker
    assert asyncio.run(engine.score(b"ok")).bytes == 2


def test_stop(engine: Engine) -> None:
    engine.stop()
    engine.stop()  # idempotent
    assert not engine.alive
    with pytest.raises(EngineUnavailable):
        asyncio.run(engine.score(b"abc"))


def test_a_bad_checkpoint_fails_start(tmp_path: Path) -> None:
    e = Engine(tmp_path / "missing")
    with pytest.raises(CheckpointError):
        e.start()
    assert not e.alive
    with pytest.raises(EngineUnavailable):
        _ = e.info


def test_a_bad_checkpoint_fails_server_start(tmp_path: Path, serve_app: Any) -> None:
    with pytest.raises(RuntimeError, match="failed to start"):
        with serve_app(Settings(checkpoint=tmp_path)):
            pass


def test_not_ready_once_the_engine_stops(tiny_checkpoint: Path, serve_app: Any, assert_error: Any) -> None:
    with serve_app(Settings(checkpoint=tiny_checkpoint)) as live, httpx.Client(base_url=live.url) as client:
        assert client.get("/readyz").status_code == 200
        live.app.state.engine.stop()
        assert client.get("/healthz").status_code == 200
        assert_error(client.get("/readyz"), 503, "service_unavailable_error")
        assert_error(client.post("/v1/score", json={"text": "a"}), 503, "service_unavailable_error")
