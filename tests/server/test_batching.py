"""Dynamic batching: many sessions share every model call and get what they would get alone; bounded admission
(429), cancellation of a departed client's work, and a shutdown that finishes what is running."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from models.adaptation import DIVERGED_BITS, Row, TextJob, batch_step, evaluate_many
from models.base import Adapter
from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, generate
from models.scoring import score_bytes
from server.engine import Engine, EngineConfig, EngineOverloaded, TextScore, Token
from server.engine._scheduler import TYPING_TEXT_ROWS
from server.settings import Settings
from trainer.evaluation import config_for

WORDS = ("the of and to a in that is was he for it with as his on be at by had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said what "
         "up its about into than them can only other new some could time these two may then do first any my now "
         "such like our over man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good very make world").split()


def texts(n: int, seed: int = 0) -> list[str]:
    """n different texts of 20 to 120 bytes (rows of one batch end at different segments)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words: list[str] = []
        target = 20 + (i * 37) % 101
        while len(" ".join(words)) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:target])
    return out


def metric_samples(client: httpx.Client, name: str) -> list[tuple[str, float]]:
    return [(line.split(" ")[0], float(line.rsplit(" ", 1)[1])) for line in client.get("/metrics").text.splitlines()
            if line.startswith(name)]


# -- the engine against models.adaptation ------------------------------------------------------------------


@pytest.fixture
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    e = Engine(tiny_checkpoint, config=EngineConfig(max_batch=64, max_wait_ms=200))
    e.start()
    yield e
    e.stop()


def test_batched_observe_equals_sequential_sparse_evaluation(engine: Engine, tiny_checkpoint: Path) -> None:
    data = [t.encode() for t in texts(12, seed=1)]

    async def main() -> tuple[list[TextScore], list[str], TextScore]:
        ids = [(await engine.create_session(owner=None))[0].id for _ in data]
        work = [engine.score(d, session_id=i, adapt=True) for d, i in zip(data, ids, strict=True)]
        static = engine.score(b"a static score in the same batches", logprobs=True)
        *results, plain = await asyncio.gather(*work, static)
        return results, ids, plain

    results, ids, plain = asyncio.run(main())
    assert max(engine.stats.batch_rows) == 2 * len(data) + 1  # every session's two rows and the static one
    ckpt = load_checkpoint(tiny_checkpoint)
    references = evaluate_many(ckpt.model, data, config_for("sparse", ckpt.dyneval), stats=ckpt.stats)
    for result, reference, session_id, text in zip(results, references, ids, data, strict=True):
        assert result.bits == pytest.approx(reference.bits, rel=1e-5)
        assert result.static_bits == pytest.approx(score_bytes(ckpt.model, text).bits, rel=1e-5)
        assert result.updates == -(-len(text) // 20) and not result.nonfinite_reset
        session = engine.get_session(session_id, None)
        torch.testing.assert_close(session.adapter.mats["h"][0], reference.adapted["h"], rtol=1e-4, atol=1e-6)
        assert reference.state is not None
        for key, value in session.state.tensors.items():
            torch.testing.assert_close(value, reference.state.tensors[key], rtol=1e-4, atol=1e-6)
        assert session.last_token == text[-1] and session.stats.bytes_observed == len(text)
    expected = score_bytes(ckpt.model, b"a static score in the same batches", logprobs=True)
    assert plain.bits == pytest.approx(expected.bits, rel=1e-5)
    assert plain.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_text_steps_are_shorter_while_someone_types(engine: Engine, tiny_checkpoint: Path) -> None:
    """With a keystroke in the last second, a text step takes at most TYPING_TEXT_ROWS rows (the texts that waited
    longest first), so that a keystroke waits for a shorter step; every observe still gives the same answer."""
    data = [t.encode() for t in texts(20, seed=3)]  # 40 rows

    async def observe_all(typing: bool) -> list[TextScore]:
        ids = [(await engine.create_session(owner=None))[0].id for _ in data]
        if typing:
            await engine.suggest(ids[0], None, "a keystroke")
        return list(await asyncio.gather(*(engine.score(d, session_id=i, adapt=True)
                                           for d, i in zip(data, ids, strict=True))))

    plain = asyncio.run(observe_all(typing=False))
    assert max(engine.stats.batch_rows) == 2 * len(data)
    before = dict(engine.stats.batch_rows)
    typed = asyncio.run(observe_all(typing=True))
    grew = {rows for rows, n in engine.stats.batch_rows.items() if n > before.get(rows, 0)}
    assert grew and max(grew) <= TYPING_TEXT_ROWS
    assert [r.bits for r in typed] == pytest.approx([r.bits for r in plain], rel=1e-5)


def test_an_adapter_whose_scores_overflow_is_reset_and_the_segment_redone(tiny_checkpoint: Path) -> None:
    ckpt = load_checkpoint(tiny_checkpoint)
    cfg = config_for("sparse", ckpt.dyneval)
    k = cfg.adapter_units
    data = b"finite weights, infinite adapter"
    inputs, targets = ckpt.tokenizer.stream(data, 10)
    huge = Row(ckpt.model.init_state(1), {"h": torch.full((k, k), 3e38)})  # finite, but h' = h + M h is not
    plain = Row(ckpt.model.init_state(1))
    job, other = TextJob(inputs, targets, [huge]), TextJob(inputs.clone(), targets.clone(), [plain])
    assert batch_step(ckpt.model, [job, other], cfg.segment) == 2
    assert (job.pos, other.pos, huge.resets, huge.logprobs) == (0, 20, 1, [])  # only the broken job waits
    assert not huge.mats["h"].any()  # type: ignore[index]
    while not job.done:
        batch_step(ckpt.model, [job], cfg.segment)
    expected = score_bytes(ckpt.model, data, last_token=10, logprobs=True).logprobs
    assert torch.cat(huge.logprobs).tolist() == pytest.approx(expected, abs=1e-5)


def test_an_adapter_whose_scores_are_finite_but_diverged_is_reset(tiny_checkpoint: Path) -> None:
    """Scores can be finite and still absurd (an exploded M gives log-probs of -1e3 a byte): past DIVERGED_BITS a
    token on average over a segment the adapter is reset and the segment redone, as for non-finite scores."""
    ckpt = load_checkpoint(tiny_checkpoint)
    k = config_for("sparse", ckpt.dyneval).adapter_units
    data = b"finite scores, absurd adapter"
    inputs, targets = ckpt.tokenizer.stream(data)
    wild = Row(ckpt.model.init_state(1), {"h": torch.full((k, k), 200.0)})
    with torch.no_grad():
        probe = score_bytes(ckpt.model, data, adapter=Adapter({"h": wild.mats["h"][None]}), logprobs=True)  # type: ignore[index]
    assert probe.logprobs is not None and all(math.isfinite(v) for v in probe.logprobs)
    assert probe.bits_per_byte > DIVERGED_BITS  # the case this test is about: finite but diverged
    job = TextJob(inputs, targets, [wild])
    batch_step(ckpt.model, [job], 20)
    assert (job.pos, wild.resets) == (0, 1) and not wild.mats["h"].any()  # type: ignore[index]
    while not job.done:
        batch_step(ckpt.model, [job], 20)
    assert torch.cat(wild.logprobs).tolist() == pytest.approx(score_bytes(ckpt.model, data, logprobs=True).logprobs,
                                                              abs=1e-5)


def test_concurrent_generations_share_each_step(engine: Engine, tiny_checkpoint: Path) -> None:
    prompts = [t.encode()[:30] for t in texts(6, seed=5)]
    params = [SamplingParams(max_tokens=10 + 5 * i, seed=i, temperature=0.9) for i in range(len(prompts))]

    async def main() -> list[str]:
        async def run(prompt: bytes, p: SamplingParams) -> str:
            async with engine.generate(prompt, p) as stream:
                return "".join([e.text async for e in stream if isinstance(e, Token)])

        return list(await asyncio.gather(*(run(a, b) for a, b in zip(prompts, params, strict=True))))

    outputs = asyncio.run(main())
    model = load_checkpoint(tiny_checkpoint).model
    assert outputs == ["".join(generate(model, a, b)) for a, b in zip(prompts, params, strict=True)]
    assert max(engine.stats.decode_rows) > 1


def test_one_session_runs_its_work_in_order(engine: Engine, tiny_checkpoint: Path) -> None:
    parts = [t.encode() for t in texts(5, seed=2)]
    parts = [p[: len(p) // 20 * 20] or p[:20] for p in parts]  # whole segments: the parts continue each other

    async def main() -> tuple[list[TextScore], str]:
        sid = (await engine.create_session(owner=None))[0].id
        return list(await asyncio.gather(*(engine.score(p, session_id=sid, adapt=True) for p in parts))), sid

    results, sid = asyncio.run(main())
    ckpt = load_checkpoint(tiny_checkpoint)
    [whole] = evaluate_many(ckpt.model, [b"".join(parts)], config_for("sparse", ckpt.dyneval), stats=ckpt.stats)
    assert sum(r.bits for r in results) == pytest.approx(whole.bits, rel=1e-5)
    assert engine.get_session(sid, None).stats.bytes_observed == sum(map(len, parts))


def test_stop_finishes_running_and_queued_work(engine: Engine) -> None:
    data = [t.encode() * 3 for t in texts(6, seed=3)]

    async def main() -> list[TextScore]:
        ids = [(await engine.create_session(owner=None))[0].id for _ in data]
        work = [asyncio.ensure_future(engine.score(d, session_id=i, adapt=True))
                for d, i in zip(data, ids, strict=True)]
        await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.stop)
        with pytest.raises(Exception, match="not running"):
            await engine.score(b"too late")
        return list(await asyncio.gather(*work))

    results = asyncio.run(main())
    assert [r.bytes for r in results] == [len(d) for d in data]


def test_overload_is_refused_at_admission(tiny_checkpoint: Path) -> None:
    e = Engine(tiny_checkpoint, config=EngineConfig(max_batch=1, max_queue=2, max_wait_ms=0))
    e.start()
    try:
        async def main() -> list[Any]:
            return list(await asyncio.gather(*(e.score(b"x" * 400) for _ in range(12)), return_exceptions=True))

        outcomes = asyncio.run(main())
        refused = [o for o in outcomes if isinstance(o, EngineOverloaded)]
        assert refused and all(o.retry_after_s == 1 for o in refused)
        assert any(isinstance(o, TextScore) for o in outcomes)
        assert e.stats.queued == 0
    finally:
        e.stop()


# -- over HTTP ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batching(tiny_checkpoint: Path, serve_app: Any) -> Iterator[str]:
    settings = Settings(checkpoint=tiny_checkpoint, max_batch=16, max_wait_ms=20, max_queue=256)
    with serve_app(settings) as live:
        yield live.url


def test_concurrent_sessions_get_what_they_would_get_alone(batching: str) -> None:
    corpus = texts(50, seed=4)

    def create(client: httpx.Client) -> str:
        r = client.post("/v1/sessions", json={})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    with httpx.Client(base_url=batching, timeout=120) as client:
        alone = []
        for text in corpus:  # one at a time: each request has the engine to itself
            r = client.post(f"/v1/sessions/{create(client)}/observe", json={"text": text})
            assert r.status_code == 200, r.text
            alone.append(r.json())
        rows_before = metric_samples(client, "adaptlm_batch_rows_bucket")
        ids = [create(client) for _ in corpus]

    async def together() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=batching, timeout=120, limits=limits) as client:
            responses = await asyncio.gather(*(client.post(f"/v1/sessions/{i}/observe", json={"text": t})
                                               for i, t in zip(ids, corpus, strict=True)))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        return [dict(r.json()) for r in responses]

    concurrent = asyncio.run(together())
    for a, b in zip(alone, concurrent, strict=True):
        assert b["bits"] == pytest.approx(a["bits"], rel=1e-5)
        assert b["static_bits"] == pytest.approx(a["static_bits"], rel=1e-5)
        assert (b["bytes"], b["updates"]) == (a["bytes"], a["updates"])
    with httpx.Client(base_url=batching) as client:
        after = dict(metric_samples(client, "adaptlm_batch_rows_bucket"))
    # batches with more than one session (> 2 rows) happened, and were labelled with the model and kernel
    grew = {k: v - dict(rows_before).get(k, 0) for k, v in after.items() if 'work="text"' in k}
    over_two = sum(v for k, v in grew.items() if 'le="+Inf"' in k) - sum(v for k, v in grew.items() if 'le="2.0"' in k)
    assert over_two > 0
    assert all('kernel="reference"' in k and 'model="' in k for k in after)


def test_a_full_queue_answers_429(tiny_checkpoint: Path, serve_app: Any, assert_error: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_batch=1, max_queue=2, max_wait_ms=0, retry_after_s=3)

    async def flood(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return list(await asyncio.gather(*(client.post("/v1/score", json={"text": "abc " * 300})
                                               for _ in range(30))))

    with serve_app(settings) as live:
        responses = asyncio.run(flood(live.url))
        with httpx.Client(base_url=live.url) as client:
            queue_depth = dict(metric_samples(client, "adaptlm_queue_depth"))
            reasons = dict(metric_samples(client, "adaptlm_refused_requests_total"))
    refused = [r for r in responses if r.status_code == 429]
    assert sum(v for k, v in reasons.items() if 'reason="queue_full"' in k) == len(refused)
    assert all(v == 0 for k, v in reasons.items() if 'reason="queue_full"' not in k)
    assert refused and any(r.status_code == 200 for r in responses)
    for r in refused:
        assert assert_error(r, 429, "rate_limit_error")["code"] == "queue_full"
        assert r.headers["retry-after"] == "3"
    assert list(queue_depth.values()) == [0.0]


def test_a_departed_client_cancels_its_queued_work(tiny_checkpoint: Path, serve_app: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_batch=2, max_wait_ms=0)
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=120) as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        blocker = client.post("/v1/sessions", json={}).json()["id"]
        done = threading.Event()

        def occupy() -> None:  # a long observe fills the batch (two rows)
            with httpx.Client(base_url=live.url, timeout=120) as other:
                other.post(f"/v1/sessions/{blocker}/observe", json={"text": "long text " * 1500})
            done.set()

        thread = threading.Thread(target=occupy)
        thread.start()
        time.sleep(0.3)
        with pytest.raises(httpx.TimeoutException):  # queued behind the long observe; the client gives up
            client.post(f"/v1/sessions/{sid}/observe", json={"text": "never observed"}, timeout=0.3)
        thread.join()
        assert done.is_set()
        deadline = time.monotonic() + 10
        while dict(metric_samples(client, "adaptlm_cancelled_work_total")).popitem()[1] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 0
        assert client.post(f"/v1/sessions/{sid}/observe", json={"text": "now"}).status_code == 200


def test_a_batch_the_device_cannot_hold_is_a_retryable_503(batching: str, assert_error: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # a GPU that cannot hold a batch raises torch.OutOfMemoryError in the engine's step: the requests in it are
    # refused for capacity (503 + Retry-After, counted as such), their sessions keep what they had (nothing of a failed
    # step is written back), and the retry is served
    import models.session as session_model  # the engine's text step runs `SessionModel.step`

    real, raised = session_model.batch_step, []

    def out_of_memory_once(*args: Any, **kwargs: Any) -> Any:
        if not raised:
            raised.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; secret-detail)")
        return real(*args, **kwargs)

    with httpx.Client(base_url=batching, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        before = dict(metric_samples(client, "adaptlm_refused_requests_total"))
        monkeypatch.setattr(session_model, "batch_step", out_of_memory_once)
        r = client.post(f"/v1/sessions/{sid}/observe", json={"text": "a text the device could not hold"})
        assert assert_error(r, 503, "service_unavailable_error")["code"] == "device_out_of_memory"
        assert r.headers["retry-after"] == "1" and "secret" not in r.text and "GiB" not in r.text
        assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 0
        r = client.post(f"/v1/sessions/{sid}/observe", json={"text": "a text the device could not hold"})
        assert r.status_code == 200, r.text
        assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 32
        after = dict(metric_samples(client, "adaptlm_refused_requests_total"))
    grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert list(grown.values()) == [1.0] and 'reason="device_out_of_memory"' in next(iter(grown))
