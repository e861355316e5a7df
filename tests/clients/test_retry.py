"""Retries of 429 and 503, of a 409 session_conflict, and of connections that could not be made: the policy's
arithmetic, its timing (httpx.MockTransport), and a real server's refusals (a tiny work queue flooded; a session
store full of busy sessions)."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest

from adaptlm_client import (
    APIConnectionError,
    AsyncClient,
    Client,
    ConflictError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RetryPolicy,
    ScoreResponse,
    ServiceUnavailableError,
)
from adaptlm_client._retry import parse_retry_after
from server.settings import Settings
from tests.clients.conftest import RecordingTransport, serve

SCORE = {"model": "m", "bits": 8.0, "bytes": 1, "bits_per_byte": 8.0}


def test_parse_retry_after() -> None:
    now = 1_700_000_000.0
    soon = format_datetime(datetime.fromtimestamp(now, UTC) + timedelta(seconds=10), usegmt=True)
    past = format_datetime(datetime.fromtimestamp(now, UTC) - timedelta(seconds=10), usegmt=True)
    assert parse_retry_after("3") == 3.0 and parse_retry_after(" 1.5 ") == 1.5 and parse_retry_after("0") == 0.0
    assert parse_retry_after(soon, now=lambda: now) == pytest.approx(10.0)
    assert parse_retry_after(past, now=lambda: now) == 0.0 and parse_retry_after("-5") == 0.0
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(bad) is None


def test_policy_delays() -> None:
    policy = RetryPolicy(max_retries=3, backoff_s=1.0, max_delay_s=5.0)
    assert policy.delay(0, 429, 2.0) == 2.0 and policy.delay(2, 503, 0.0) == 0.0
    assert policy.delay(3, 429, 1.0) is None  # out of retries
    assert policy.delay(0, 429, 6.0) is None  # the server asks for longer than we wait: raise, never retry early
    for status in (400, 404, 409, 422, 500, 502):
        assert policy.delay(0, status, 1.0) is None
    # a 409 session_conflict (nothing was applied) is retried; a 409 of another code is not
    assert policy.delay(0, 409, 1.0, "session_conflict") == 1.0
    assert policy.delay(3, 409, 1.0, "session_conflict") is None  # out of retries
    assert policy.delay(0, 409, 1.0, "checkpoint_mismatch") is None
    assert RetryPolicy(codes=frozenset()).delay(0, 409, 1.0, "session_conflict") is None
    for n, (low, high) in enumerate([(0.5, 1.0), (1.0, 2.0), (2.0, 4.0)]):
        assert all(low <= policy.delay(n, 503, None) <= high for _ in range(50))  # type: ignore[operator]
    assert RetryPolicy(backoff_s=100, max_delay_s=3).delay(0, 429, None) == 3.0
    assert RetryPolicy(max_retries=0).delay(0, 429, 0.0) is None
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)



def scripted(*answers: httpx.Response) -> tuple[httpx.MockTransport, list[tuple[float, httpx.Request]]]:
    """A transport giving (copies of) `answers` in turn, the last one from then on, noting when each request came."""
    seen: list[tuple[float, httpx.Request]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((time.monotonic(), request))
        answer = answers[min(len(seen), len(answers)) - 1]
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    return httpx.MockTransport(handler), seen


def refused(status: int = 429, retry_after: str | None = "0", **error: str) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    body = {"error": {"message": "busy", "type": "rate_limit_error" if status == 429 else "service_unavailable_error",
                      "param": None, "code": None, **error}}
    return httpx.Response(status, headers=headers, json=body)


def test_retry_after_is_honoured_for_posts() -> None:
    transport, seen = scripted(refused(429, "0.3"), refused(503, "0.2"), httpx.Response(200, json=SCORE))
    with Client("http://adaptlm.test", transport=transport) as c:
        assert isinstance(c.score("x"), ScoreResponse)
    times = [t for t, _ in seen]
    assert len(seen) == 3 and times[1] - times[0] >= 0.3 and times[2] - times[1] >= 0.2
    assert len({r.content for _, r in seen}) == 1 and seen[0][1].method == "POST"  # the same body each time


def conflict(code: str, retry_after: str | None = "0.2") -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    body = {"error": {"message": "changed meanwhile", "type": "conflict_error", "param": "session_id", "code": code}}
    return httpx.Response(409, headers=headers, json=body)


OBSERVED = {"bits": 8.0, "bytes": 1, "bits_per_byte": 8.0, "static_bits": 9.0, "static_bits_per_byte": 9.0,
            "updates": 0, "nonfinite_reset": False}


def test_a_session_conflict_is_retried_and_another_conflict_is_not() -> None:
    # 409 session_conflict: another replica wrote the session while this request worked on it, and the server
    # applied nothing of it: sent again after Retry-After, the same body
    transport, seen = scripted(conflict("session_conflict"), httpx.Response(200, json=OBSERVED))
    with Client("http://adaptlm.test", transport=transport) as c:
        assert c.observe("some-session-0123456789", "x").bits == 8.0
    assert len(seen) == 2 and seen[1][0] - seen[0][0] >= 0.2 and len({r.content for _, r in seen}) == 1
    transport, seen = scripted(conflict("session_conflict"))
    with Client("http://adaptlm.test", transport=transport, retry=RetryPolicy(max_retries=2)) as c, \
            pytest.raises(ConflictError) as e:
        c.observe("some-session-0123456789", "x")
    assert len(seen) == 3 and (e.value.status, e.value.code, e.value.retry_after) == (409, "session_conflict", 0.2)
    # a session export of another checkpoint is a 409 too: the same request would be refused again
    transport, seen = scripted(conflict("checkpoint_mismatch", retry_after=None))
    with Client("http://adaptlm.test", transport=transport) as c, pytest.raises(ConflictError) as e:
        c.import_state("some-session-0123456789", b"blob")
    assert len(seen) == 1 and e.value.code == "checkpoint_mismatch"

    async def main() -> float:
        transport, _ = scripted(conflict("session_conflict", "0"), httpx.Response(200, json=SCORE))
        async with AsyncClient("http://adaptlm.test", transport=transport) as ac:
            return (await ac.score("x", session_id="some-session-0123456789", adapt=True)).bits

    assert asyncio.run(main()) == 8.0


def test_attempts_are_bounded() -> None:
    transport, seen = scripted(refused(503, "0"))
    with Client("http://adaptlm.test", transport=transport, retry=RetryPolicy(max_retries=3)) as c:
        with pytest.raises(ServiceUnavailableError) as e:
            c.create_session()
    assert len(seen) == 4 and e.value.retry_after == 0.0


def test_a_retry_after_over_the_cap_is_raised_at_once() -> None:
    transport, seen = scripted(refused(429, "100"), httpx.Response(200, json=SCORE))
    started = time.monotonic()
    with Client("http://adaptlm.test", transport=transport, retry=RetryPolicy(max_delay_s=10)) as c:
        with pytest.raises(RateLimitError) as e:
            c.score("x")
    assert len(seen) == 1 and time.monotonic() - started < 5
    assert (e.value.status, e.value.retry_after) == (429, 100.0)


def test_backoff_without_retry_after() -> None:
    transport, seen = scripted(refused(503, None), httpx.Response(200, json=SCORE))
    with Client("http://adaptlm.test", transport=transport, retry=RetryPolicy(backoff_s=0.2)) as c:
        c.score("x")
    assert len(seen) == 2 and seen[1][0] - seen[0][0] >= 0.1


@pytest.mark.parametrize("answer", [httpx.Response(500, json={"error": {"message": "bug", "type": "server_error"}}),
                                    httpx.Response(404, json={"error": {"message": "no", "type": "not_found_error"}})])
def test_other_errors_are_not_retried(answer: httpx.Response) -> None:
    transport, seen = scripted(answer)
    with Client("http://adaptlm.test", transport=transport) as c, \
            pytest.raises((InternalServerError, NotFoundError)):
        c.score("x")
    assert len(seen) == 1


def test_readiness_and_broken_connections_are_not_retried() -> None:
    transport, seen = scripted(refused(503, "0"))
    with Client("http://adaptlm.test", transport=transport) as c, pytest.raises(ServiceUnavailableError):
        c.ready()  # "not ready" is the answer
    assert len(seen) == 1
    calls: list[httpx.Request] = []

    def broken(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadError("connection reset by peer", request=request)  # the request went: maybe done

    with Client("http://adaptlm.test", transport=httpx.MockTransport(broken)) as c, \
            pytest.raises(APIConnectionError):
        c.reset_session("some-session-0123456789")
    assert len(calls) == 1


def test_an_observe_is_sent_with_one_key_on_all_its_tries() -> None:
    """An observe carries an Idempotency-Key (the server applies a key once), the same on each retry: after a 503 and
    after a connection that broke once the request went, which for other requests is not retried."""
    calls: list[httpx.Request] = []

    def broken(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ReadError("connection reset by peer", request=request)

    with Client("http://adaptlm.test", transport=httpx.MockTransport(broken), retry=RetryPolicy(backoff_s=0)) as c, \
            pytest.raises(APIConnectionError):
        c.observe("some-session-0123456789", "x")
    keys = [r.headers["Idempotency-Key"] for r in calls]
    assert len(keys) == 3 and len(set(keys)) == 1 and len(keys[0]) == 36
    observed = {"bits": 1.0, "bytes": 1, "bits_per_byte": 1.0, "static_bits": 1.0, "static_bits_per_byte": 1.0,
                "updates": 0, "nonfinite_reset": False, "tokens": 1, "pending_bytes": 0}
    transport, seen = scripted(refused(503, "0"), httpx.Response(200, json=observed))
    with Client("http://adaptlm.test", transport=transport) as c:
        c.observe("some-session-0123456789", "x")
        c.observe("some-session-0123456789", "x", idempotency_key="mine-1")
    keys = [request.headers["Idempotency-Key"] for _, request in seen]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2] == "mine-1"

    async def main() -> None:
        async with AsyncClient("http://adaptlm.test", transport=httpx.MockTransport(broken),
                               retry=RetryPolicy(backoff_s=0)) as ac:
            await ac.observe("some-session-0123456789", "x")

    calls.clear()
    with pytest.raises(APIConnectionError):
        asyncio.run(main())
    assert len(calls) == 3 and len({r.headers["Idempotency-Key"] for r in calls}) == 1


def _refused_then(failures: int, exc: type[httpx.TransportError]) -> tuple[httpx.MockTransport, list[float]]:
    """A server whose connection cannot be made `failures` times (`exc`), then answers; -> the transport, the
    times of the attempts."""
    attempts: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(time.monotonic())
        if len(attempts) <= failures:
            raise exc("connection refused", request=request)
        return httpx.Response(200, json=SCORE)
    return httpx.MockTransport(handler), attempts


@pytest.mark.parametrize("exc", [httpx.ConnectError, httpx.ConnectTimeout])
def test_a_connection_that_could_not_be_made_is_retried(exc: type[httpx.TransportError]) -> None:
    # nothing was sent (a server restarting, a replica gone): POSTs too, with the policy's backoff and bound
    policy = RetryPolicy(max_retries=2, backoff_s=0.05)
    transport, attempts = _refused_then(2, exc)
    with Client("http://adaptlm.test", transport=transport, retry=policy) as c:
        assert isinstance(c.score("x"), ScoreResponse)
    assert len(attempts) == 3 and attempts[1] - attempts[0] >= 0.025 and attempts[2] - attempts[1] >= 0.05
    transport, attempts = _refused_then(3, exc)
    with Client("http://adaptlm.test", transport=transport, retry=policy) as c, pytest.raises(APIConnectionError):
        c.observe("some-session-0123456789", "x")
    assert len(attempts) == 3  # at most max_retries retries
    for no_retry in (RetryPolicy(connect=False), RetryPolicy(max_retries=0)):
        transport, attempts = _refused_then(1, exc)
        with Client("http://adaptlm.test", transport=transport, retry=no_retry) as c, \
                pytest.raises(APIConnectionError):
            c.score("x")
        assert len(attempts) == 1
    transport, attempts = _refused_then(1, exc)
    with Client("http://adaptlm.test", transport=transport, retry=policy) as c, pytest.raises(APIConnectionError):
        c.health()  # a probe's failure is its answer
    assert len(attempts) == 1

    async def main() -> int:
        transport, attempts = _refused_then(2, exc)
        async with AsyncClient("http://adaptlm.test", transport=transport, retry=policy) as ac:
            await ac.score("x")
        return len(attempts)

    assert asyncio.run(main()) == 3


def test_opening_a_stream_is_retried() -> None:
    events = (b'data: {"text": "hi"}\n\ndata: {"finish_reason": "length", "usage": {"prompt_tokens": 1, '
              b'"completion_tokens": 2, "total_tokens": 3}, "timings": {"first_token_seconds": 0, "total_seconds": 0}}'
              b"\n\n")
    ok = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events)
    transport, seen = scripted(refused(429, "0.1"), ok)
    with Client("http://adaptlm.test", transport=transport) as c, c.generate_stream("x") as stream:
        assert list(stream) == ["hi"]
    assert len(seen) == 2 and stream.result.usage.total_tokens == 3

    async def main() -> list[str]:
        transport, _ = scripted(refused(503, "0.1"), ok)
        async with AsyncClient("http://adaptlm.test", transport=transport) as ac:
            return [chunk async for chunk in ac.generate_stream("x")]

    assert asyncio.run(main()) == ["hi"]


def test_async_retry_after_is_honoured() -> None:
    transport, seen = scripted(refused(429, "0.3"), httpx.Response(200, json=SCORE))

    async def main() -> ScoreResponse:
        async with AsyncClient("http://adaptlm.test", transport=transport) as ac:
            return await ac.score("x")

    assert asyncio.run(main()).bits == 8.0
    assert len(seen) == 2 and seen[1][0] - seen[0][0] >= 0.3


# -- a real server -------------------------------------------------------------------------------------------

TEXT = "abc " * 300


def flood(url: str, n: int, retry: RetryPolicy, transport: RecordingTransport) -> list[object]:
    async def main() -> list[object]:
        async with AsyncClient(url, timeout=120, retry=retry, transport=transport) as client:
            return list(await asyncio.gather(*(client.score(TEXT) for _ in range(n)), return_exceptions=True))
    return asyncio.run(main())


def test_a_full_queue_is_429_then_retried(tiny_checkpoint: Path) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_batch=1, max_queue=2, max_wait_ms=0, retry_after_s=1)
    with serve(settings) as live:
        once = RecordingTransport()
        results = flood(live.url, 20, RetryPolicy(max_retries=0), once)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors and len(errors) < len(results)
        for error in errors:
            assert isinstance(error, RateLimitError), error
            assert (error.status, error.code, error.retry_after) == (429, "queue_full", 1.0)

        patient = RecordingTransport()
        started = time.monotonic()
        results = flood(live.url, 9, RetryPolicy(max_retries=30, max_delay_s=5), patient)
        assert all(isinstance(r, ScoreResponse) for r in results), results
        assert 429 in patient.statuses() and time.monotonic() - started >= 1.0
        assert patient.retry_gaps() and min(patient.retry_gaps()) >= 1.0  # never before Retry-After


def test_a_full_session_store_is_503_then_retried(tiny_checkpoint: Path) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_sessions=1, retry_after_s=1)
    with serve(settings) as live:
        recording = RecordingTransport()
        with Client(live.url, timeout=120, transport=recording,
                    retry=RetryPolicy(max_retries=30, max_delay_s=5)) as client:
            busy = client.create_session()
            thread = threading.Thread(target=busy.observe, args=("busy " * 600,))  # 150 segments
            thread.start()
            engine, deadline = live.app.state.engine, time.monotonic() + 60
            while not engine.stats.batch_rows and time.monotonic() < deadline:  # the observe's first model call
                time.sleep(0.01)
            assert engine.stats.batch_rows and engine.stats.updates == 0  # running, not finished
            fresh = client.create_session()  # 503 while the only session is pinned by its observe; then it is evicted
            thread.join()
            assert fresh.id != busy.id and 503 in recording.statuses()
            assert min(recording.retry_gaps()) >= 1.0
            with pytest.raises(NotFoundError):
                busy.get()
