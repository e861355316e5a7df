"""A request whose client goes away stops at the next segment of its work, its prompt's reading included, on every
route that runs model work; a request's engine time is bounded (`max_request_engine_s`); /readyz reports an engine
that makes no progress with work waiting (`ready_stall_s`).

The abandoned requests carry a 300 KB text: the tiny model reads it in tens of seconds on a CPU, where the chunks,
segments and tokens between which work stops take milliseconds. Each is abandoned 0.3 s after it was sent
(its connection closed); the next small request must answer within seconds. The tests that time answers run
`alone`."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from server.engine import Budget, Engine, EngineBudgetExceeded, EngineStats
from server.engine._text import Text
from server.engine._work import charge
from server.settings import Settings
from tests.server.conftest import AssertErrorFn, LiveServer, ParseSSEFn, ServeFn

BIG = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
       "of a wife. " * 2800)[:300_000]
ABANDON_AFTER_S = 0.3  # the engine is into the text by then, and far from its end
NEXT_WITHIN_S = 3.0  # the next request's answer (unfixed, it waits for the whole text: tens of seconds)
STALL_S = 0.5


@pytest.fixture(scope="module")
def live(serve_app: ServeFn, tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve_app(Settings(checkpoint=tiny_checkpoint, max_request_engine_s=600, ready_stall_s=STALL_S)) as server:
        yield server


@pytest.fixture
def engine(live: LiveServer) -> Engine:
    engine = live.app.state.engine
    assert isinstance(engine, Engine)
    return engine


def _abandon(url: str, path: str, body: dict[str, Any]) -> None:
    """Send the request on its own connection, wait, and close the connection without reading the answer."""
    address = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(head + data)
        time.sleep(ABANDON_AFTER_S)


def _cancelled(stats: EngineStats) -> int:
    return stats.cancelled + stats.cancelled_work


def _wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _session(client: httpx.Client) -> str:
    r = client.post("/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


# route -> (its path, its body), given a client and the model's name
ROUTES: dict[str, Callable[[httpx.Client, str], tuple[str, dict[str, Any]]]] = {
    "score": lambda c, m: ("/v1/score", {"text": BIG}),
    "observe": lambda c, m: (f"/v1/sessions/{_session(c)}/observe", {"text": BIG}),
    "session creation": lambda c, m: ("/v1/sessions", {"initial_text": BIG}),
    "generate": lambda c, m: ("/v1/generate", {"prompt": BIG, "max_tokens": 5}),
    "generate stream": lambda c, m: ("/v1/generate", {"prompt": BIG, "max_tokens": 5, "stream": True}),
    # every prompt of a completion stops, the one being read and the one waiting for its turn
    "completions": lambda c, m: ("/v1/completions", {"model": m, "prompt": [BIG, BIG[1:]], "max_tokens": 5}),
    "completions stream": lambda c, m: ("/v1/completions", {"model": m, "prompt": [BIG, BIG[1:]], "max_tokens": 5,
                                                            "stream": True}),
}


@pytest.mark.alone
@pytest.mark.parametrize("route", ROUTES)
def test_an_abandoned_request_stops_mid_text_and_the_next_answers_at_once(live: LiveServer, engine: Engine,
                                                                           route: str) -> None:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        path, body = ROUTES[route](client, engine.info.name)
        before = engine.stats
        _abandon(live.url, path, body)
        abandoned = time.monotonic()
        r = client.post("/v1/score", json={"text": "the next request"})
        waited = time.monotonic() - abandoned
    assert r.status_code == 200, r.text
    assert waited < NEXT_WITHIN_S, f"the next request waited {waited:.1f} s after the {route} was abandoned"
    # the abandoned work was stopped (each of a completion's prompts), not read to its end nor cut by the budget
    stopped = 2 if route.startswith("completions") else 1
    _wait_for(lambda: _cancelled(engine.stats) >= _cancelled(before) + stopped and engine.stats.active == 0, 5,
              f"the abandoned {route} was not stopped")
    after = engine.stats
    assert after.prompt_tokens == before.prompt_tokens  # no prompt was read to its end
    assert after.generated_tokens == before.generated_tokens
    assert after.updates == before.updates  # an observe's session kept nothing of it
    assert after.budget_exceeded == before.budget_exceeded
    assert after.queued == 0


@pytest.fixture
def small_budget(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> float:
    """The engine gives each new request a 0.3 s budget (as `max_request_engine_s=0.3` would)."""
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_request_engine_s=0.3))
    return 0.3


@pytest.mark.alone
def test_a_long_prompt_being_read_holds_up_no_other_work(live: LiveServer, engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         assert_error: AssertErrorFn) -> None:
    # read whole at its start, the prompt would hold the score back until its budget ends it: 1.2 s and more
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_request_engine_s=1.5))
    answers: list[httpx.Response] = []
    with httpx.Client(base_url=live.url, timeout=60) as client:
        long = threading.Thread(target=lambda: answers.append(
            client.post("/v1/generate", json={"prompt": BIG, "max_tokens": 5})))
        long.start()
        time.sleep(ABANDON_AFTER_S)
        start = time.monotonic()
        r = client.post("/v1/score", json={"text": "meanwhile"})
        took = time.monotonic() - start
        long.join(60)
    assert r.status_code == 200, r.text
    assert took < 1.0, f"a score waited {took:.1f} s for a prompt being read"
    assert_error(answers[0], 422, "validation_error")


def test_the_settings_budget_reaches_the_engine(engine: Engine) -> None:
    assert engine.config.max_request_engine_s == 600
    assert engine.budget().limit_s == 600


@pytest.mark.alone
def test_a_request_over_its_engine_time_budget_stops_with_a_422(live: LiveServer, engine: Engine, small_budget: float,
                                                                 assert_error: AssertErrorFn) -> None:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        sid = _session(client)
        before = engine.stats
        start = time.monotonic()
        r = client.post("/v1/generate", json={"prompt": BIG, "max_tokens": 5})
        took = time.monotonic() - start
        error = assert_error(r, 422, "validation_error")
        assert error["code"] == "engine_budget_exceeded"
        assert "0.3 s" in error["message"]
        assert took < NEXT_WITHIN_S
        # an observe stopped by the budget leaves its session as it was
        error = assert_error(client.post(f"/v1/sessions/{sid}/observe", json={"text": BIG}), 422,
                             "validation_error")
        assert error["code"] == "engine_budget_exceeded"
        assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 0
        metrics = client.get("/metrics").text
    after = engine.stats
    assert after.budget_exceeded == before.budget_exceeded + 2
    assert after.prompt_tokens == before.prompt_tokens and after.updates == before.updates
    assert "adaptlm_budget_exceeded_total" in metrics


def test_a_streamed_completion_over_its_budget_ends_with_the_error_event(
        live: LiveServer, engine: Engine, small_budget: float, parse_sse: ParseSSEFn) -> None:
    body = {"model": engine.info.name, "prompt": [BIG, BIG[1:]], "max_tokens": 5, "stream": True}
    before = engine.stats
    with httpx.Client(base_url=live.url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                            json=body) as r:
        assert r.status_code == 200
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "engine_budget_exceeded"  # OpenAI's 400
    # both prompts stopped: the budget stops one (perhaps both), and the answer's end the other
    _wait_for(lambda: engine.stats.budget_exceeded + _cancelled(engine.stats)
              == before.budget_exceeded + _cancelled(before) + 2 and engine.stats.active == 0, 5,
              "the completion's prompts were not both stopped")
    assert engine.stats.budget_exceeded > before.budget_exceeded
    assert engine.stats.prompt_tokens == before.prompt_tokens


def test_readyz_reports_an_engine_that_makes_no_progress(live: LiveServer, engine: Engine,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         assert_error: AssertErrorFn) -> None:
    release = threading.Event()
    create = engine.sessions.create

    def stuck(*args: Any, **kwargs: Any) -> Any:  # a model call that does not end: the worker thread is held
        release.wait(30)
        return create(*args, **kwargs)

    monkeypatch.setattr(engine.sessions, "create", stuck)
    with httpx.Client(base_url=live.url, timeout=60) as client:
        assert client.get("/readyz").status_code == 200
        blocked = threading.Thread(target=client.post, args=("/v1/sessions",), kwargs={"json": {}})
        blocked.start()
        try:
            _wait_for(lambda: client.get("/readyz").status_code == 503, 10, "/readyz never reported the stall")
            error = assert_error(client.get("/readyz"), 503, "service_unavailable_error")
            assert error["code"] == "engine_stalled"
            assert client.get("/healthz").status_code == 200  # alive: a stall may end (no restart for it)
        finally:
            release.set()
            blocked.join(30)
        _wait_for(lambda: client.get("/readyz").status_code == 200, 10, "/readyz did not recover")


def test_a_batched_call_is_charged_by_rows_and_a_request_shares_its_budget() -> None:
    shared, alone = Budget(1.0), Budget(1.0)
    first, second = Text(b"a", "static", budget=shared), Text(b"b", "static", budget=shared)
    other = Text(b"c", "observe", budget=alone)
    charge([(first, 1), (second, 1), (other, 2)], 0.8)  # a call of 0.8 s over 4 rows
    assert other.budget.spent_s == pytest.approx(0.4)
    assert shared.spent_s == pytest.approx(0.4)  # its two items' shares, added
    charge([(first, 1)], 0.7)
    assert shared.exceeded and not alone.exceeded
    assert isinstance(shared.error(), EngineBudgetExceeded)
