"""Typed errors: each `error.type` of a real server raises its class, with status, param and code; stream error
events, answers not in the one shape and transport failures map into the same hierarchy."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import adaptlm_client
from adaptlm_client import (
    AdaptlmError,
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    RetryPolicy,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from server.protocol import ERROR_TYPES
from server.settings import Settings
from tests.clients.conftest import LiveServer, serve

SSE = {"content-type": "text/event-stream"}


def mock(transport: httpx.MockTransport) -> Client:
    return Client("http://adaptlm.test", transport=transport, retry=RetryPolicy(max_retries=0))


def test_every_error_type_has_its_class() -> None:
    classes = {cls.error_type: cls for cls in vars(adaptlm_client).values()
               if isinstance(cls, type) and issubclass(cls, AdaptlmError) and cls.error_type}
    assert set(classes) == set(ERROR_TYPES)
    for type_, cls in classes.items():
        error = adaptlm_client._errors.error_from_body({"error": {"message": "m", "type": type_}})
        assert type(error) is cls and error.status == cls.default_status and error.type == type_


# -- a real server -------------------------------------------------------------------------------------------


def test_unknown_session_is_not_found(client: Client) -> None:
    for call in (lambda: client.get_session("no-such-session-0123456789"),
                 lambda: client.observe("no-such-session-0123456789", "x"),
                 lambda: client.score("x", session_id="no-such-session-0123456789"),
                 lambda: client.export_state("no-such-session-0123456789")):
        with pytest.raises(NotFoundError) as e:
            call()
        assert (e.value.status, e.value.type, e.value.param, e.value.code) == (
            404, "not_found_error", "session_id", "session_not_found")
        assert e.value.request_id is not None and len(e.value.request_id) == 32  # the server's, for its log


@pytest.mark.parametrize(("kwargs", "param"), [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                               ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 10**9}, "max_tokens"),
                                               ({"adapt_while_generating": True}, "adapt_while_generating")])
def test_invalid_generation_is_422_with_its_param(client: Client, kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(UnprocessableEntityError) as e:
        client.generate("x", **kwargs)  # type: ignore[arg-type]
    assert (e.value.status, e.value.type, e.value.param) == (422, "validation_error", param)
    with pytest.raises(UnprocessableEntityError) as e, client.generate_stream("x", **kwargs):  # type: ignore[arg-type]
        pass
    assert e.value.param == param


def test_invalid_sessions_are_422_with_their_param(client: Client) -> None:
    cases = [(lambda: client.create_session(adapter_size=10**6), "adaptation.adapter_size"),
             (lambda: client.create_session(ttl_s=-1), "ttl_s"),
             (lambda: client.create_session(""), "initial_text"),
             (lambda: client.score("x", adapt=True), "adapt"),
             (lambda: client.import_state("short", b"x"), "session_id"),
             (lambda: client.import_state("valid-session-id-0123456789", b""), "body")]
    for call, param in cases:
        with pytest.raises(UnprocessableEntityError) as e:
            call()
        assert e.value.param == param, e.value
    with pytest.raises(UnprocessableEntityError) as e:
        client.import_state("valid-session-id-0123456789", b"not a session export")
    assert e.value.code == "invalid_session_export"


def test_any_python_text_or_number_reaches_the_server(client: Client, live: LiveServer) -> None:
    """The server is the one judge of what is sent: a lone surrogate (text from a platform that hands out UTF-16
    halves), NaN or infinity, a session id that is not ASCII, raise the server's typed 4xx naming the field, never
    the encoding exception of the layer below (json, httpx's ASCII headers)."""
    session = client.create_session()
    cases = [(lambda: client.score("ab\ud800c"), UnprocessableEntityError, "text", "string_unicode"),
             (lambda: session.observe("I will \udc00"), UnprocessableEntityError, "text", "string_unicode"),
             (lambda: session.suggest("see you tom\ud83d"), UnprocessableEntityError, "context", "string_unicode"),
             (lambda: client.generate("x", temperature=float("nan")), UnprocessableEntityError, "temperature",
              "finite_number"),
             (lambda: client.generate("x", top_p=float("inf")), UnprocessableEntityError, "top_p", "finite_number"),
             (lambda: client.score("x", session_id="sessi\u00f3n-0123456789"), NotFoundError, "session_id",
              "session_not_found"),
             (lambda: client.generate("x", session_id="\ud800-0123456789abcdef"), UnprocessableEntityError,
              "session_id", "string_unicode"),
             (lambda: client.get_session("\ud800-0123456789abcdef"), NotFoundError, "session_id",
              "session_not_found")]
    for call, cls, param, code in cases:
        with pytest.raises(cls) as e:
            call()
        assert (e.value.param, e.value.code) == (param, code), e.value
    with pytest.raises(UnprocessableEntityError) as e, client.generate_stream("x\udfff"):
        pass
    assert e.value.param == "prompt"

    async def main() -> None:
        async with AsyncClient(live.url) as ac:
            with pytest.raises(UnprocessableEntityError) as e:
                await ac.score("\ud800")
            assert e.value.param == "text"

    asyncio.run(main())
    # valid text is sent as UTF-8, not escaped: emoji, combining marks and all
    text = "Ce\u0301sar \U0001f44b\U0001f3fd \u4f60\u597d"
    assert client.score(text).bytes == len(text.encode())


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve(Settings(checkpoint=tiny_checkpoint, api_keys="key-one,key-two")) as live:  # type: ignore[arg-type]
        yield live


def test_api_keys(keyed: LiveServer) -> None:
    for key, code in ((None, "missing_api_key"), ("wrong", "invalid_api_key")):
        with Client(keyed.url, api_key=key) as c:
            assert c.health().status == "ok"  # probes need no key
            with pytest.raises(AuthenticationError) as e:
                c.score("x")
            assert (e.value.status, e.value.type, e.value.code) == (401, "authentication_error", code)
    with Client(keyed.url, api_key="key-one") as one, Client(keyed.url, api_key="key-two") as two:
        assert one.models().data
        session = one.create_session("mine")
        with pytest.raises(NotFoundError):
            two.get_session(session.id)  # a session belongs to its key
        assert session.get().id == session.id


def test_payload_too_large(tiny_checkpoint: Path) -> None:
    with serve(Settings(checkpoint=tiny_checkpoint, max_text_bytes=16, max_body_bytes=1024)) as live, \
            Client(live.url) as c:
        assert c.score("x" * 16).bytes == 16
        with pytest.raises(PayloadTooLargeError) as e:
            c.score("x" * 17)
        assert (e.value.status, e.value.type, e.value.param, e.value.code) == (
            413, "payload_too_large_error", "text", "text_too_long")
        with pytest.raises(PayloadTooLargeError) as e:
            c.import_state("big-session-0123456789", b"\0" * 2000)
        assert e.value.code == "body_too_large"
        with pytest.raises(PayloadTooLargeError) as e:
            c.create_session().observe("é" * 9)
        assert e.value.param == "text"


def test_an_export_of_other_weights_is_a_conflict(client: Client, other_weights_checkpoint: Path) -> None:
    other = other_weights_checkpoint
    blob = client.create_session("text").export()
    with serve(Settings(checkpoint=other)) as live, Client(live.url) as c:
        with pytest.raises(ConflictError) as e:
            c.import_state("moved-session-0123456789", blob)
        assert (e.value.status, e.value.type, e.value.code) == (409, "conflict_error", "checkpoint_mismatch")


def test_a_server_that_is_not_there(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with Client(f"http://127.0.0.1:{port}") as c, pytest.raises(APIConnectionError) as e:
        c.health()
    assert e.value.status is None and f"127.0.0.1:{port}" in e.value.message

    async def main() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}") as ac:
            await ac.score("x")

    with pytest.raises(APIConnectionError):
        asyncio.run(main())


def test_a_timeout(live: LiveServer) -> None:
    with Client(live.url, timeout=httpx.Timeout(10, read=0.05)) as c:
        with pytest.raises(APITimeoutError) as e:
            c.generate("x", max_tokens=4000)
        assert isinstance(e.value, APIConnectionError) and e.value.status is None
        assert c.health().status == "ok"


# -- answers the SDK must survive (httpx.MockTransport) ------------------------------------------------------


def sse(*events: str) -> bytes:
    return "".join(f"data: {event}\n\n" for event in events).encode()


def test_an_error_event_in_a_stream_raises_its_class() -> None:
    error = '{"error": {"message": "the engine has stopped", "type": "service_unavailable_error", "param": null, ' \
            '"code": "engine_unavailable"}}'
    transport = httpx.MockTransport(lambda r: httpx.Response(200, headers={**SSE, "X-Request-ID": "req-7"},
                                                             content=sse('{"text": "ab"}', error)))
    with mock(transport) as c:
        stream = c.generate_stream("x")
        chunks: list[str] = []
        with pytest.raises(ServiceUnavailableError) as e:
            for chunk in stream:
                chunks.append(chunk)
    assert chunks == ["ab"] and stream.text == "ab" and not stream.done
    assert (e.value.status, e.value.code, e.value.message) == (503, "engine_unavailable", "the engine has stopped")
    assert e.value.request_id == "req-7"

    async def main() -> list[str]:
        got: list[str] = []
        async with AsyncClient("http://adaptlm.test", transport=transport) as ac:
            with pytest.raises(ServiceUnavailableError) as e:
                async for chunk in ac.generate_stream("x"):
                    got.append(chunk)
        assert e.value.request_id == "req-7"
        return got

    assert asyncio.run(main()) == ["ab"]


def test_a_stream_cut_short_is_an_error() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200, headers=SSE, content=sse('{"text": "ab"}')))
    with mock(transport) as c, pytest.raises(AdaptlmError, match="ended before its last event"):
        list(c.generate_stream("x"))


def test_sse_framing() -> None:
    done = '{"finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, ' \
           '"timings": {"first_token_seconds": 0.1, "total_seconds": 0.2}}'
    # comments, other fields, CRLF line ends, a last event without its blank line
    body = (': keep-alive\r\nevent: message\r\ndata: {"text": "a"}\r\n\r\ndata:{"text": "b"}\n\n'
            f"data: {done}").encode()
    transport = httpx.MockTransport(lambda r: httpx.Response(200, headers=SSE, content=body))
    with mock(transport) as c:
        stream = c.generate_stream("x")
        assert list(stream) == ["a", "b"]
    assert stream.result.finish_reason == "stop" and stream.result.usage.total_tokens == 3


@pytest.mark.parametrize(("status", "content", "cls"), [
    (502, b"<html>Bad Gateway</html>", InternalServerError),
    (504, b"", InternalServerError),
    (418, b'{"error": {"message": "teapot", "type": "teapot_error"}}', BadRequestError),
    (404, b'{"detail": "Not Found"}', NotFoundError),
    (503, b'{"error": "down"}', ServiceUnavailableError),
])
def test_answers_not_in_the_one_shape(status: int, content: bytes, cls: type[AdaptlmError]) -> None:
    with mock(httpx.MockTransport(lambda r: httpx.Response(status, content=content))) as c:
        with pytest.raises(cls) as e:
            c.models()
    assert type(e.value) is cls and e.value.status == status and e.value.message


def test_a_success_that_is_not_the_promised_shape() -> None:
    with mock(httpx.MockTransport(lambda r: httpx.Response(200, json={"unexpected": True}))) as c:
        with pytest.raises(AdaptlmError, match="not a ScoreResponse") as e:
            c.score("x")
    assert type(e.value) is AdaptlmError


def test_a_broken_connection_mid_stream() -> None:
    def chunks() -> Iterator[bytes]:
        yield b'data: {"text": "a"}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection")

    transport = httpx.MockTransport(lambda r: httpx.Response(200, headers=SSE, content=chunks()))
    with mock(transport) as c, pytest.raises(APIConnectionError, match="peer closed"):
        list(c.generate_stream("x"))
