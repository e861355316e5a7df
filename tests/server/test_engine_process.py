"""The engine in its own process (`EngineHost`, `RemoteEngine`): an HTTP worker's app answers as the one-process app
does, every engine error crosses with its type and fields (so its HTTP answer is the same), the engine's queue
refuses for all workers (429), a worker's caller that goes away cancels the engine's work, and one scrape of
/metrics carries the engine's counters.

Here the engine and its host run in the test process (as in `adaptlm serve`'s parent) and the app with its
RemoteEngine in a uvicorn thread: the wire and both ends are the real ones, without starting processes.
`adaptlm serve` with workers, as a process tree, is tests/server/test_workers.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgpack
import numpy as np
import pytest
import zmq

from models.sampling import SamplingParams
from server.app import rate_limiter, start_engine
from server.engine import (
    Engine,
    EngineHost,
    EngineStats,
    Finished,
    PromptScored,
    RemoteEngine,
    TextScore,
    Token,
    TokenLogprob,
)
from server.engine._errors import EngineOverloaded, InvalidSessionSettings, SessionConflict, SessionNotFound
from server.engine._remote import _error_state, _Hello, _rebuild_error
from server.engine._wire import pack, unpack
from server.settings import Settings
from tests.server.conftest import AssertErrorFn, LiveServer, ParseSSEFn, ServeFn


@contextmanager
def engine_host(settings: Settings) -> Iterator[tuple[Engine, str]]:
    """The engine of `settings`, served at an ipc address (what `serve_workers` runs in its own process)."""
    engine = start_engine(settings)
    with tempfile.TemporaryDirectory(prefix="adaptlm-test-") as private:
        address = f"ipc://{private}/engine"
        host = EngineHost(engine, address, take_rate=rate_limiter(settings).take)
        host.start()
        try:
            yield engine, address
        finally:
            host.stop()
            engine.stop()
            engine.store.close()


@contextmanager
def remote_server(serve_app: ServeFn, settings: Settings) -> Iterator[tuple[LiveServer, Engine]]:
    with engine_host(settings) as (engine, address), serve_app(settings, engine=RemoteEngine(address)) as live:
        yield live, engine


@pytest.fixture(scope="module")
def remote(serve_app: ServeFn, tiny_checkpoint: Path) -> Iterator[tuple[LiveServer, Engine]]:
    with remote_server(serve_app, Settings(checkpoint=tiny_checkpoint, suggest_budget_ms=0)) as served:
        yield served


def _without_times(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("id", "session_id", "created", "last_used", "expires_at")}


def _session_walk(url: str) -> list[Any]:
    """One session's life over HTTP, every answer kept (ids and times left out)."""
    out: list[Any] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        out.append(c.post("/v1/score", json={"text": "The cat sat on the mat.", "logprobs": True}).json())
        created = c.post("/v1/sessions", json={"adaptation": {"lr": 0.01}, "initial_text": "Dear Sir, "})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        out.append(_without_times(created.json()))
        for text in ("Thank you for the report. ", "Thank you for the letter. "):
            out.append(c.post(f"/v1/sessions/{sid}/observe", json={"text": text}).json())
        out.append(c.post(f"/v1/sessions/{sid}/suggest", json={"context": "Thank you for the re", "k": 3}).json())
        out.append(_without_times(c.post("/v1/score", json={"text": "the report", "session_id": sid}).json()))
        out.append(_without_times(c.get(f"/v1/sessions/{sid}").json()))
        out.append(c.post("/v1/generate", json={"prompt": "Thank", "max_tokens": 12, "seed": 3,
                                                "session_id": sid}).json())
        state = c.get(f"/v1/sessions/{sid}/state")
        assert state.status_code == 200
        imported = c.put(f"/v1/sessions/{sid}-copy/state", content=state.content)
        out.append(_without_times(imported.json()))
        out.append(_without_times(c.post(f"/v1/sessions/{sid}/reset").json()))
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204
        out.append(c.get(f"/v1/sessions/{sid}").status_code)
    return out


def test_a_worker_answers_as_the_one_process_server(live: LiveServer, remote: tuple[LiveServer, Engine],
                                                    parse_sse: ParseSSEFn) -> None:
    assert _session_walk(remote[0].url) == _session_walk(live.url)
    body = {"model": "tiny", "prompt": ["Once upon", "The end"], "max_tokens": 8, "n": 2, "seed": 5, "stream": True,
            "logprobs": 2}
    streams = []
    for server in (live, remote[0]):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            with c.stream("POST", "/v1/completions", json={**body, "model": model}) as r:
                assert r.status_code == 200
                events = [json.loads(e) for e in parse_sse(r.iter_lines()) if e != "[DONE]"]
        # the choices' events interleave as the engine's rounds fall, and a batch's rows make the last digits
        by_choice: dict[int, list[Any]] = {}
        for event in events:
            for choice in event["choices"]:
                logprobs = choice["logprobs"] or {}
                by_choice.setdefault(choice["index"], []).append(
                    (choice["text"], choice["finish_reason"], logprobs.get("tokens"), logprobs.get("token_logprobs")))
        streams.append(by_choice)
    (one, many), texts = streams, [{i: [e[:3] for e in events] for i, events in s.items()} for s in streams]
    assert texts[1] == texts[0] and sorted(one) == [0, 1, 2, 3]
    for i in one:
        assert [e[3] for e in many[i]] == [pytest.approx(e[3], abs=1e-4) for e in one[i]]


def test_engine_errors_answer_as_in_one_process(remote: tuple[LiveServer, Engine],
                                                assert_error: AssertErrorFn) -> None:
    with httpx.Client(base_url=remote[0].url, timeout=30) as c:
        assert_error(c.get("/v1/sessions/nope"), 404, "not_found_error", "session_id")
        # the settings the engine checks (the schema's bounds are checked by the worker)
        error = assert_error(c.post("/v1/sessions", json={"adaptation": {"adapter_size": 10**6}}), 422,
                             "validation_error", "adaptation.adapter_size")
        assert error["code"] == "less_than_equal"
        assert_error(c.post("/v1/sessions", json={"ttl_s": 1e12}), 422, "validation_error", "ttl_s")
        sid = c.post("/v1/sessions", json={}).json()["id"]
        key = {"Idempotency-Key": "k-1"}
        first = c.post(f"/v1/sessions/{sid}/observe", json={"text": "abc"}, headers=key)
        again = c.post(f"/v1/sessions/{sid}/observe", json={"text": "abc"}, headers=key)
        assert first.json() == again.json() and again.headers["Idempotent-Replayed"] == "true"
        error = assert_error(c.post(f"/v1/sessions/{sid}/observe", json={"text": "abd"}, headers=key), 422,
                             "validation_error", "Idempotency-Key")
        assert error["code"] == "idempotency_key_reused"
        assert_error(c.put(f"/v1/sessions/{sid}/state", content=b"not a session"), 422, "validation_error")
        assert c.get(f"/v1/sessions/{sid}").status_code == 200  # the bad import lost nothing


@pytest.mark.parametrize("error", [
    EngineOverloaded("the queue is full", retry_after_s=7),
    SessionNotFound("abc"),
    InvalidSessionSettings("too big", param="adapter.lr", code="less_than_equal"),
    SessionConflict("abc"),
    ValueError("empty text: nothing to score"),
])
def test_an_error_crosses_with_its_type_message_and_fields(error: Exception) -> None:
    rebuilt = _rebuild_error(*_error_state(error))
    assert type(rebuilt) is type(error) and str(rebuilt) == str(error) and vars(rebuilt) == vars(error)


def test_an_unknown_error_type_is_never_imported() -> None:
    rebuilt = _rebuild_error("os", "system", ("echo hi",), {})
    assert type(rebuilt) is RuntimeError and "os.system" in str(rebuilt)


def test_the_engine_queue_refuses_for_every_worker(serve_app: ServeFn, tiny_checkpoint: Path,
                                                   assert_error: AssertErrorFn) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_queue=2, max_batch=1, retry_after_s=3)
    text = "It is a truth universally acknowledged. " * 40
    with remote_server(serve_app, settings) as (live, _):
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=live.url, timeout=120) as c:
                return list(await asyncio.gather(*(c.post("/v1/score", json={"text": text}) for _ in range(24))))

        answers = asyncio.run(burst())
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {200, 429} and codes.count(429) >= 8, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert assert_error(refused, 429, "rate_limit_error")["code"] == "queue_full"
        assert refused.headers["Retry-After"] == "3"
        with httpx.Client(base_url=live.url) as c:
            scrape = c.get("/metrics").text
        assert re.search(r'adaptlm_refused_requests_total\{model="[^"]+",reason="queue_full"\} (\d+)', scrape)


def test_a_caller_that_goes_away_cancels_the_engine_work(remote: tuple[LiveServer, Engine]) -> None:
    live, engine = remote
    before = engine.stats.cancelled_work
    address = urlsplit(live.url)
    data = json.dumps({"text": "A long text to read. " * 15_000}).encode()
    head = (f"POST /v1/score HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(head + data)
        time.sleep(0.5)
    start = time.monotonic()
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post("/v1/score", json={"text": "short"}).status_code == 200
        assert time.monotonic() - start < 10  # not after the 300 KB text
        deadline = time.monotonic() + 10
        while engine.stats.cancelled_work == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats.cancelled_work == before + 1
        scrape = c.get("/metrics").text  # the worker's scrape reads the engine's counter, fresh
    assert re.search(rf"adaptlm_cancelled_work_total\{{[^}}]*\}} {before + 1}\.0", scrape), scrape


def test_a_scrape_carries_the_engine_counters_fresh(remote: tuple[LiveServer, Engine]) -> None:
    live, engine = remote
    observes = 'route="/v1/sessions/{session_id}/observe",status="200"} '

    def observed(scrape: str) -> float:
        return sum(float(line.rpartition(" ")[2]) for line in scrape.splitlines()
                   if line.startswith("adaptlm_http_requests_total") and observes in line)

    with httpx.Client(base_url=live.url, timeout=30) as c:
        before = observed(c.get("/metrics").text)
        sid = c.post("/v1/sessions", json={}).json()["id"]
        c.post(f"/v1/sessions/{sid}/observe", json={"text": "Some words to adapt on. " * 8})
        updates = engine.stats.updates
        assert updates > 0
        scrape = c.get("/metrics").text
    assert re.search(rf"adaptlm_adaptation_updates_total\{{[^}}]*\}} {updates}\.0", scrape)
    assert observed(scrape) == before + 1


def test_a_worker_reports_an_engine_that_stopped(serve_app: ServeFn, tiny_checkpoint: Path,
                                                 assert_error: AssertErrorFn) -> None:
    settings = Settings(checkpoint=tiny_checkpoint)
    with remote_server(serve_app, settings) as (live, engine), httpx.Client(base_url=live.url, timeout=30) as c:
        assert c.get("/readyz").status_code == 200
        threading.Thread(target=engine.stop).start()
        deadline = time.monotonic() + 5
        while c.get("/readyz").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert_error(c.get("/readyz"), 503, "service_unavailable_error")
        assert_error(c.post("/v1/score", json={"text": "abc"}), 503, "service_unavailable_error")


def test_a_key_rate_is_the_server_s_whichever_worker_answers(serve_app: ServeFn, tiny_checkpoint: Path,
                                                              assert_error: AssertErrorFn) -> None:
    """Two workers (two apps, each with its RemoteEngine) on one engine: the key's bucket is kept by the engine's
    process, so three requests through either worker empty it, not three through each."""
    settings = Settings(checkpoint=tiny_checkpoint, api_keys="k1", rate_limit_per_s=0.01, rate_limit_burst=3)
    auth = {"Authorization": "Bearer k1"}
    with engine_host(settings) as (_, address), serve_app(settings, engine=RemoteEngine(address)) as one, \
            serve_app(settings, engine=RemoteEngine(address)) as two:
        codes = [httpx.post(f"{url}/v1/score", json={"text": "abc"}, headers=auth, timeout=30).status_code
                 for url in (one.url, two.url, one.url)]
        assert codes == [200, 200, 200]
        for url in (two.url, one.url):
            refused = httpx.post(f"{url}/v1/score", json={"text": "abc"}, headers=auth, timeout=30)
            assert assert_error(refused, 429, "rate_limit_error")["code"] == "rate_limited"


def test_records_cross_the_wire_as_they_were(remote: tuple[LiveServer, Engine]) -> None:
    """Every record the engine answers with reads back equal (tuples as tuples); a dict a client sent stays a dict
    whatever its keys; a record type not on the list is refused, not built."""
    engine = remote[1]
    hello = _Hello(engine.info, engine.config, engine.session_limits(), "", frozenset(engine.memory_names))
    back = unpack(pack(hello))
    assert back.info == engine.info and back.config == engine.config and back.limits == engine.session_limits()
    assert back.info.tokenizer.to_dict() == engine.info.tokenizer.to_dict()
    events = [PromptScored((TokenLogprob(-1.5, ((3, -0.5), (4, -1.5))),), (3,)),
              Token(0, 97, "a", 0, TokenLogprob(-0.25, ((97, -0.25),)), 12.5, b"x"),
              Finished(0, "length", 1, 0.01, 0.02, 3)]
    assert unpack(pack(events)) == events
    stats = EngineStats(batch_rows={1: 3, 64: 2}, evictions={"ttl": 1})
    assert unpack(pack(stats)) == stats
    score = TextScore(bits=3.5, bytes=2, tokens=2, logprobs=np.array([-1.0, -2.5]), static_bits=4.0)
    assert unpack(pack(score)) == dataclasses.replace(score, logprobs=[-1.0, -2.5])
    params = SamplingParams(max_tokens=5, stop=("\n", "."))
    assert unpack(pack(params)) == params
    asked = {"__t": {"lr": 1}, "adapter": {"x": b"\x00\x01"}}
    assert unpack(pack(asked)) == asked
    forged = msgpack.ExtType(1, pack(["Popen", {"args": ["true"]}]))
    with pytest.raises(ValueError, match="no record 'Popen'"):
        unpack(msgpack.packb(forged))


def test_a_message_that_is_no_call_is_dropped_and_the_engine_serves_on(remote: tuple[LiveServer, Engine]) -> None:
    live = remote[0]
    address = live.app.state.engine.address
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        for frames in ([b"1", b"call", b"\xc1 not msgpack"], [b"2", b"call", pack(["score"])], [b"3"],
                       [b"4", b"call", pack(("no_such_call", [], {}))]):
            sock.send_multipart(frames)
        assert sock.poll(5000)
        rid, status, payload = sock.recv_multipart()  # the unknown call is answered with its error
        assert (rid, status) == (b"4", b"err") and "no_such_call" in str(unpack(payload))
    finally:
        sock.close()
        context.term()
    assert httpx.post(f"{live.url}/v1/score", json={"text": "abc"}, timeout=30).status_code == 200
