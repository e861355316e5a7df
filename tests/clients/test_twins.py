"""`Client` and `AsyncClient` are one SDK: the same scripted server (httpx.MockTransport) gives the same outcome
through either, for every retry decision (refusals, conflicts, connections not made or broken, a probe, a
Retry-After over the cap, an error body that breaks while read) and every way a stream can end (done, an error event,
cut short, a last event without its blank line, a broken connection, a bad event, a refused opening, closed early)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from adaptlm_client import AdaptlmError, AsyncClient, Client, RetryPolicy

SSE = {"content-type": "text/event-stream"}
SCORE = {"model": "m", "bits": 8.0, "bytes": 1, "bits_per_byte": 8.0}
OBSERVED = {"bits": 8.0, "bytes": 1, "bits_per_byte": 8.0, "static_bits": 9.0, "static_bits_per_byte": 9.0,
            "updates": 0, "nonfinite_reset": False}
DONE = ('{"finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, '
        '"timings": {"first_token_seconds": 0.1, "total_seconds": 0.2}}')
SESSION = "some-session-0123456789"
POLICY = RetryPolicy(max_retries=2, backoff_s=0.0, max_delay_s=10.0)


@dataclass(frozen=True)
class Answer:
    """One scripted answer: a status with a body (`broken`: the body's connection breaks after `body`), or a
    transport error raised instead."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    broken: bool = False
    raises: type[httpx.TransportError] | None = None


def error(status: int, type_: str, code: str | None = None, retry_after: str | None = "0") -> Answer:
    body = {"error": {"message": f"m{status}", "type": type_, "param": None, "code": code}}
    return Answer(status, json.dumps(body).encode(), {"Retry-After": retry_after} if retry_after is not None else {})


def ok(body: dict[str, Any]) -> Answer:
    return Answer(200, json.dumps(body).encode(), {"content-type": "application/json"})


def events(*data: str, end: str = "\n\n", request_id: str = "req-7", broken: bool = False) -> Answer:
    text = "".join(f"data: {d}\n\n" for d in data[:-1]) + (f"data: {data[-1]}{end}" if data else "")
    return Answer(200, text.encode(), {**SSE, "X-Request-ID": request_id}, broken=broken)


def _sync_body(answer: Answer) -> Iterator[bytes]:
    yield answer.body
    raise httpx.ReadError("peer went away")


async def _async_body(answer: Answer) -> AsyncIterator[bytes]:
    yield answer.body
    raise httpx.ReadError("peer went away")


class Script:
    """A transport answering with `answers` in turn (the last from then on), noting each request's headers."""

    def __init__(self, answers: tuple[Answer, ...], is_async: bool) -> None:
        self.answers, self.is_async = answers, is_async
        self.seen: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request.headers)
        answer = self.answers[min(len(self.seen), len(self.answers)) - 1]
        if answer.raises is not None:
            raise answer.raises("scripted failure", request=request)
        if answer.broken:
            stream = _async_body(answer) if self.is_async else _sync_body(answer)
            return httpx.Response(answer.status, headers=answer.headers, content=stream)
        return httpx.Response(answer.status, headers=answer.headers, content=answer.body)


def outcome(value: Any, exc: BaseException | None, script: Script, **more: Any) -> dict[str, Any]:
    """What a caller can see of a call, comparable across the two clients."""
    seen = {"attempts": len(script.seen), "keys": len({h.get("Idempotency-Key") for h in script.seen}), **more}
    if exc is not None:
        assert isinstance(exc, AdaptlmError), repr(exc)
        return {**seen, "error": (type(exc).__name__, str(exc), exc.status, exc.type, exc.param, exc.code,
                                  exc.retry_after, exc.request_id)}
    return {**seen, "value": value.model_dump() if hasattr(value, "model_dump") else value}


CALLS: dict[str, tuple[str, tuple[Any, ...]]] = {  # a call: the method of either client, its arguments
    "score": ("score", ("x",)),
    "observe": ("observe", (SESSION, "x")),
    "ready": ("ready", ()),
    "health": ("health", ()),
    "import": ("import_state", (SESSION, b"blob")),
    "reset": ("reset_session", (SESSION,)),
}
# (name, the call, the script, then what comes of it: how many requests, the error's class or None for an answer)
RETRIES: list[tuple[str, str, tuple[Answer, ...], int, str | None]] = [
    ("refused then served", "score", (error(429, "rate_limit_error"), error(503, "service_unavailable_error"),
                                      ok(SCORE)), 3, None),
    ("refused to the bound", "score", (error(503, "service_unavailable_error"),), 3, "ServiceUnavailableError"),
    ("retry-after over the cap", "score", (error(429, "rate_limit_error", retry_after="100"), ok(SCORE)), 1,
     "RateLimitError"),
    ("backoff without retry-after", "score", (error(503, "service_unavailable_error", retry_after=None), ok(SCORE)),
     2, None),
    ("session conflict retried", "observe", (error(409, "conflict_error", "session_conflict"), ok(OBSERVED)), 2,
     None),
    ("other conflict raised", "import", (error(409, "conflict_error", "checkpoint_mismatch", retry_after=None),), 1,
     "ConflictError"),
    ("not found", "score", (error(404, "not_found_error", retry_after=None), ok(SCORE)), 1, "NotFoundError"),
    ("server error", "score", (error(500, "server_error", retry_after=None), ok(SCORE)), 1, "InternalServerError"),
    ("not the one shape", "score", (Answer(502, b"<html>Bad Gateway</html>"), ok(SCORE)), 1, "InternalServerError"),
    ("a probe's refusal is its answer", "ready", (error(503, "service_unavailable_error"), ok({"status": "ready"})),
     1, "ServiceUnavailableError"),
    ("connection not made, then served", "score", (Answer(raises=httpx.ConnectError),
                                                   Answer(raises=httpx.ConnectTimeout), ok(SCORE)), 3, None),
    ("connection never made", "observe", (Answer(raises=httpx.ConnectError),), 3, "APIConnectionError"),
    ("a probe's connection not made", "health", (Answer(raises=httpx.ConnectError), ok({"status": "ok"})), 1,
     "APIConnectionError"),
    ("broken after sent", "reset", (Answer(raises=httpx.ReadError), ok(SCORE)), 1, "APIConnectionError"),
    ("timed out after sent", "score", (Answer(raises=httpx.ReadTimeout), ok(SCORE)), 1, "APITimeoutError"),
    ("an observe broken after sent, with its key", "observe", (Answer(raises=httpx.ReadError),
                                                               Answer(raises=httpx.WriteError), ok(OBSERVED)), 3,
     None),
    ("an error body broken while read", "score", (Answer(503, b'{"err', broken=True), ok(SCORE)), 1,
     "APIConnectionError"),
]


def run_sync(method: str, args: tuple[Any, ...], script: Script) -> dict[str, Any]:
    with Client("http://adaptlm.test", transport=httpx.MockTransport(script), retry=POLICY) as c:
        try:
            value = getattr(c, method)(*args)
        except Exception as e:  # noqa: BLE001 (compared below)
            return outcome(None, e, script)
    return outcome(value, None, script)


def run_async(method: str, args: tuple[Any, ...], script: Script) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with AsyncClient("http://adaptlm.test", transport=httpx.MockTransport(script), retry=POLICY) as ac:
            try:
                value = await getattr(ac, method)(*args)
            except Exception as e:  # noqa: BLE001
                return outcome(None, e, script)
        return outcome(value, None, script)

    return asyncio.run(main())


def both(run: Callable[[bool], dict[str, Any]]) -> dict[str, Any]:
    """The outcome through `Client`, checked to be the outcome through `AsyncClient`."""
    sync, async_ = run(False), run(True)
    assert sync == async_
    return sync


@pytest.mark.parametrize(("name", "call", "answers", "attempts", "raised"), RETRIES, ids=[r[0] for r in RETRIES])
def test_both_clients_retry_alike(name: str, call: str, answers: tuple[Answer, ...], attempts: int,
                                  raised: str | None) -> None:
    method, args = CALLS[call]
    seen = both(lambda is_async: (run_async if is_async else run_sync)(method, args, Script(answers, is_async)))
    assert (seen["attempts"], seen["error"][0] if "error" in seen else None) == (attempts, raised)
    if call == "observe":
        assert seen["keys"] == 1  # one Idempotency-Key on all its tries
    if name == "retry-after over the cap":
        assert seen["error"][6] == 100.0  # retry_after: what the server asked for


# (name, the script, chunks read before the block is left (None: all), then what comes of it: the chunks, and the
# error's class and request id, or None and whether the stream finished)
STREAMS: list[tuple[str, tuple[Answer, ...], int | None, list[str], str | None, str | bool | None]] = [
    ("done", (events('{"text": "a"}', '{"text": "b"}', DONE),), None, ["a", "b"], None, True),
    ("an error event", (events('{"text": "ab"}', '{"error": {"message": "stopped", "type": '
                                                 '"service_unavailable_error", "code": "engine_unavailable"}}'),),
     None, ["ab"], "ServiceUnavailableError", "req-7"),
    ("cut short", (events('{"text": "ab"}', request_id="req-9"),), None, ["ab"], "AdaptlmError", "req-9"),
    ("last event without its blank line", (events('{"text": "a"}', DONE, end=""),), None, ["a"], None, True),
    ("last chunk without its blank line, then cut", (events('{"text": "a"}', '{"text": "b"}', end=""),), None,
     ["a", "b"], "AdaptlmError", "req-7"),
    ("framing", (Answer(200, (': keep-alive\r\nevent: message\r\ndata: {"text": "a"}\r\n\r\ndata:{"text": "b"}\n\n'
                              f"data: {DONE}\n\n").encode(), SSE),), None, ["a", "b"], None, True),
    ("broken mid-stream", (events('{"text": "a"}', '{"text": "b"}', broken=True),), None, ["a", "b"],
     "APIConnectionError", None),
    ("not JSON", (events('{"text": "a"}', "{oops"),), None, ["a"], "AdaptlmError", "req-7"),
    ("not an object", (events("[1]"),), None, [], "AdaptlmError", "req-7"),
    ("not an event", (events('{"text": 5}'),), None, [], "AdaptlmError", "req-7"),
    ("opening refused, then served", (error(429, "rate_limit_error"), events('{"text": "a"}', DONE)), None, ["a"],
     None, True),
    ("opening refused for good", (error(404, "not_found_error", retry_after=None),), None, [], "NotFoundError",
     None),
    ("closed early", (events('{"text": "a"}', '{"text": "b"}', DONE),), 1, ["a"], None, False),
]


def stream_sync(script: Script, take: int | None) -> dict[str, Any]:
    chunks: list[str] = []
    with Client("http://adaptlm.test", transport=httpx.MockTransport(script), retry=POLICY) as c:
        stream = c.generate_stream("x")
        try:
            with stream:
                for chunk in stream:
                    chunks.append(chunk)
                    if take is not None and len(chunks) == take:
                        break
            after = list(stream)
        except Exception as e:  # noqa: BLE001
            return outcome(None, e, script, chunks=chunks, text=stream.text, done=stream.done)
    return outcome(stream.result if stream.done else None, None, script, chunks=chunks, text=stream.text,
                   done=stream.done, after=after)


def stream_async(script: Script, take: int | None) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        chunks: list[str] = []
        async with AsyncClient("http://adaptlm.test", transport=httpx.MockTransport(script), retry=POLICY) as ac:
            stream = ac.generate_stream("x")
            try:
                async with stream:
                    async for chunk in stream:
                        chunks.append(chunk)
                        if take is not None and len(chunks) == take:
                            break
                after = [chunk async for chunk in stream]
            except Exception as e:  # noqa: BLE001
                return outcome(None, e, script, chunks=chunks, text=stream.text, done=stream.done)
        return outcome(stream.result if stream.done else None, None, script, chunks=chunks, text=stream.text,
                       done=stream.done, after=after)

    return asyncio.run(main())


@pytest.mark.parametrize(("name", "answers", "take", "chunks", "raised", "last"), STREAMS,
                         ids=[s[0] for s in STREAMS])
def test_both_clients_stream_alike(name: str, answers: tuple[Answer, ...], take: int | None, chunks: list[str],
                                   raised: str | None, last: str | bool | None) -> None:
    seen = both(lambda is_async: (stream_async if is_async else stream_sync)(Script(answers, is_async), take))
    assert seen["chunks"] == chunks and seen["text"] == "".join(chunks)
    if raised is not None:
        assert (seen["error"][0], seen["error"][7], seen["done"]) == (raised, last, False)  # [7]: its request id
    else:
        assert "error" not in seen and seen["done"] is last and seen["after"] == []
        assert (seen["value"] is not None) == last  # the final event, once finished
