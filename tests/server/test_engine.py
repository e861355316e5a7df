"""The engine alone (no HTTP), and the app's behaviour when the engine is not running."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.adaptation import AdapterSettings
from models.checkpoint import CheckpointError, load_checkpoint
from models.mlstm import MLSTM
from models.sampling import SamplingParams, generate
from models.scoring import score_bytes
from models.suggest import Suggestions
from models.wordcache import WordsSettings
from server.engine import (
    Engine,
    EngineUnavailable,
    Event,
    Finished,
    GenerationStream,
    InvalidSessionSettings,
    PromptScored,
    SessionConfig,
    Token,
)
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
    forward = MLSTM.forward

    def spy(self: MLSTM, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(MLSTM, "forward", spy)

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(engine.score(b"abc" * (i + 1), logprobs=True) for i in range(4))))

    results = asyncio.run(main())
    assert threads and set(threads) == {"engine-under-test"}
    assert [r.bytes for r in results] == [3, 6, 9, 12]
    assert all(r.logprobs is not None and len(r.logprobs) == r.bytes for r in results)


def test_model_errors_reach_the_caller(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(engine.score(b""))
    assert engine.alive  # one failed item does not stop the worker
    assert asyncio.run(engine.score(b"ok")).bytes == 2


async def collect(stream: GenerationStream) -> list[Event]:
    async with stream:
        return [event async for event in stream]


async def collect_from(engine: Engine, prompt: bytes, params: SamplingParams | None, **kw: Any) -> list[Event]:
    return await collect(engine.generate(prompt, params, **kw))


def test_generation_events(engine: Engine, tiny_checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=12, seed=5, temperature=0.8)
    events = asyncio.run(collect_from(engine, b"The ", params, n=2, logprobs=2))
    tokens = [e for e in events if isinstance(e, Token)]
    finished = [e for e in events if isinstance(e, Finished)]
    assert sorted(f.index for f in finished) == [0, 1] and all(f.completion_tokens == 12 for f in finished)
    assert all(f.first_token_seconds is not None and 0 < f.first_token_seconds <= f.seconds for f in finished)
    reference = load_checkpoint(tiny_checkpoint).model
    for i in (0, 1):
        mine = [t for t in tokens if t.index == i]
        assert len(mine) == 12 and all(t.logprob is not None and len(t.logprob.top) == 2 for t in mine)
        expected = "".join(generate(reference, b"The ", SamplingParams(max_tokens=12, seed=5 + i, temperature=0.8)))
        assert "".join(t.text for t in mine) == expected
        # A sequence's Finished comes after its last token.
        assert events.index(next(f for f in finished if f.index == i)) > events.index(mine[-1])


def test_prompt_only(engine: Engine, tiny_checkpoint: Path) -> None:
    data = "prompt scöring".encode()
    events = asyncio.run(collect_from(engine, data, None, logprobs=1, prompt_logprobs=True))
    scored, done = events
    assert isinstance(scored, PromptScored) and isinstance(done, Finished)
    expected = score_bytes(load_checkpoint(tiny_checkpoint).model, data, logprobs=True).logprobs
    assert [lp.logprob for lp in scored.logprobs] == pytest.approx(expected, abs=1e-5)  # float32, other kernels
    assert (done.completion_tokens, done.finish_reason, done.first_token_seconds) == (0, "length", None)
    assert engine.stats.prompt_tokens >= len(data)


def test_cancelling_stops_the_worker_between_tokens(engine: Engine) -> None:
    async def main() -> int:
        stream = engine.generate(b"a", SamplingParams(max_tokens=10_000_000))
        seen = 0
        async with stream:
            async for event in stream:
                seen += isinstance(event, Token)
                if seen == 5:
                    break
        return seen

    assert asyncio.run(main()) == 5
    deadline = time.monotonic() + 10
    while engine.stats.active or engine.stats.cancelled != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.stats.generated_tokens < 10_000_000
    assert asyncio.run(engine.score(b"still working")).bytes == 13


def test_a_failing_generation_raises_from_its_stream(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Iterator[None]:
        raise ValueError("broken prefill")  # in the model call of the prompt's first chunk
        yield

    monkeypatch.setattr("models.sampling.Stepper.prefill_chunks", broken)
    with pytest.raises(ValueError, match="broken prefill"):
        asyncio.run(collect_from(engine, b"a", SamplingParams(max_tokens=3)))
    monkeypatch.undo()
    assert len(asyncio.run(collect_from(engine, b"a", SamplingParams(max_tokens=3)))) == 4


def test_stop_finishes_running_generations(engine: Engine) -> None:
    async def main() -> list[Event]:
        stream = engine.generate(b"a", SamplingParams(max_tokens=300))
        await asyncio.to_thread(engine.stop)
        with pytest.raises(EngineUnavailable):
            engine.generate(b"a", SamplingParams(max_tokens=3))
        return await collect(stream)

    events = asyncio.run(main())
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 300


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
        assert_error(client.post("/v1/generate", json={"prompt": "a"}), 503, "service_unavailable_error")
        r = client.post("/v1/completions", json={"model": tiny_checkpoint.name, "prompt": "a"})
        assert_error(r, 503, "service_unavailable_error")


def test_stop_answers_the_suggestions_in_progress(engine: Engine) -> None:
    """Keystrokes queued or searching when the engine stops are answered, not dropped."""
    text = "It is a truth universally acknowledged, that a single man"

    async def main() -> list[Any]:
        session = (await engine.create_session(owner=None))[0]
        tasks = [asyncio.create_task(engine.suggest(session.id, None, text[:n])) for n in range(5, len(text), 4)]
        await asyncio.sleep(0.01)  # every one submitted (the first few already searching)
        await asyncio.to_thread(engine.stop)
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    answers = asyncio.run(main())
    assert len(answers) == 13 and all(isinstance(a, Suggestions) and a.completions for a in answers), answers
    assert not engine.alive


def test_session_settings_are_filled_and_checked_by_the_session_service(engine: Engine) -> None:
    """One place fills a session's settings from the checkpoint's defaults and checks them (and its TTL)
    against the checkpoint's and the server's limits, whoever creates the session."""
    limits = engine.session_limits()
    default = engine.sessions.config()
    adapter, words = default.get("adapter"), default.get("words")
    assert isinstance(adapter, AdapterSettings) and isinstance(words, WordsSettings)
    assert (adapter.lr, adapter.decay, adapter.size, words.weight) == (
        limits.lr, limits.decay, limits.adapter_size, limits.cache_weight)
    one = engine.sessions.config({"adapter": {"size": 1}}).get("adapter")
    assert isinstance(one, AdapterSettings) and one.size == 1
    assert engine.sessions.ttl(None) == engine.config.session_ttl_s
    too_large = SessionConfig({**default.memories,
                               "adapter": adapter.model_copy(update={"size": limits.max_adapter_size + 1})})
    for call, param in ((lambda: engine.sessions.config({"adapter": {"size": limits.max_adapter_size + 1}}),
                         "adapter.size"),
                        (lambda: engine.sessions.config({"adapter": {"decay": 1.5}}), "adapter.decay"),
                        (lambda: engine.sessions.config({"adapter": {"lr": math.nan}}), "adapter.lr"),
                        (lambda: engine.sessions.ttl(engine.config.max_session_ttl_s * 2), "ttl_s"),
                        (lambda: asyncio.run(engine.create_session(owner=None, config=too_large)), "adapter.size"),
                        (lambda: asyncio.run(engine.create_session(owner=None, ttl_s=-1.0)), "ttl_s")):
        with pytest.raises(InvalidSessionSettings) as info:
            call()
        assert info.value.param == param
    session, _ = asyncio.run(engine.create_session(owner=None))
    assert session.config == default and session.ttl_s == engine.config.session_ttl_s


def test_not_alive_once_the_engine_thread_dies(tiny_checkpoint: Path, serve_app: Any, assert_error: Any) -> None:
    """An error that escapes the engine's loop ends its thread for good: readiness alone would leave the pod up
    and unready forever (Kubernetes restarts only on failed liveness), so /healthz fails too. A stop (a drain) is
    not a death: /healthz stays 200 then (test above)."""
    with serve_app(Settings(checkpoint=tiny_checkpoint)) as live, httpx.Client(base_url=live.url) as client:
        engine = live.app.state.engine
        assert client.get("/healthz").status_code == 200 and not engine.crashed

        def broken() -> None:
            raise RuntimeError("a bug in the engine's loop")

        engine._scheduler._executors["text"].step = broken
        client.post("/v1/score", json={"text": "a"})  # wakes the loop, which dies; the request is failed
        deadline = time.monotonic() + 10
        while not engine.crashed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.crashed
        assert assert_error(client.get("/healthz"), 503, "service_unavailable_error")["code"] == "engine_crashed"
        assert_error(client.get("/readyz"), 503, "service_unavailable_error")
        assert_error(client.post("/v1/score", json={"text": "a"}), 503, "service_unavailable_error")
