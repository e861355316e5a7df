"""`Client` and `Session` against a real server: every endpoint, answers typed with the protocol models."""

from __future__ import annotations

import httpx
import pytest

from adaptlm_client import (
    AdaptlmError,
    AsyncClient,
    Client,
    GenerateDone,
    GenerateResponse,
    GenerateStream,
    NotFoundError,
    ObserveResponse,
    ScoreResponse,
    Session,
    SessionResponse,
)
from tests.clients.conftest import LiveServer

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife.")
MORE = " However little known the feelings or views of such a man may be on his first entering a neighbourhood."


def test_health_ready_and_models(client: Client) -> None:
    assert client.health().status == "ok"
    ready = client.ready()
    assert ready.status == "ready" and ready.model
    models = client.models()
    assert [m.id for m in models.data] == [ready.model]


def test_score_matches_the_raw_api(client: Client, live: LiveServer) -> None:
    result = client.score(TEXT, logprobs=True)
    assert isinstance(result, ScoreResponse)
    raw = httpx.post(f"{live.url}/v1/score", json={"text": TEXT, "logprobs": True}).json()
    assert result.model_dump() == ScoreResponse.model_validate(raw).model_dump()
    assert result.bytes == len(TEXT.encode()) and result.logprobs is not None and len(result.logprobs) == result.bytes
    assert client.score(TEXT).logprobs is None


def test_generate_whole_and_streamed_agree(client: Client) -> None:
    whole = client.generate("The ", max_tokens=30, seed=7, temperature=0.9, top_k=20, top_p=0.95)
    assert isinstance(whole, GenerateResponse)
    assert whole.finish_reason == "length" and whole.usage.completion_tokens == 30
    with client.generate_stream("The ", max_tokens=30, seed=7, temperature=0.9, top_k=20, top_p=0.95) as stream:
        assert isinstance(stream, GenerateStream)
        with pytest.raises(RuntimeError, match="not finished"):
            stream.result  # noqa: B018
        chunks = list(stream)
    assert len(chunks) > 1 and "".join(chunks) == stream.text == whole.text
    assert isinstance(stream.result, GenerateDone)
    assert stream.result.finish_reason == "length" and stream.result.usage == whole.usage
    assert 0 <= stream.result.timings.first_token_seconds <= stream.result.timings.total_seconds


def test_stream_without_a_block_and_with_stop(client: Client) -> None:
    text = client.generate("The ", max_tokens=60, seed=3).text
    stop = next(text[i:i + 2] for i in range(10, len(text) - 2) if text.find(text[i:i + 2]) == i
                and "\ufffd" not in text[i:i + 2])
    stream = client.generate_stream("The ", max_tokens=60, seed=3, stop=[stop])
    assert "".join(stream) == text[:text.index(stop)]
    assert stream.result.finish_reason == "stop"
    assert list(stream) == []  # read once


def test_leaving_a_stream_early_closes_it(client: Client) -> None:
    with client.generate_stream("The ", max_tokens=2000, seed=1) as stream:
        first = next(iter(stream))
    assert first and not stream.done
    assert list(stream) == []
    assert client.health().status == "ok"  # the pool still works


def test_session_lifecycle(client: Client) -> None:
    session = client.create_session(TEXT, ttl_s=600, adapter_size=16)
    assert isinstance(session, Session) and isinstance(session.info, SessionResponse)
    assert session.info.id == session.id and session.info.adaptation.adapter_size == 16
    assert session.info.observed is not None and session.info.observed.bytes == len(TEXT.encode())
    assert session.info.ttl_s == 600

    observed = session.observe(MORE)
    assert isinstance(observed, ObserveResponse) and observed.updates > 0
    info = session.get()
    assert info is session.info and info.stats.bytes_observed == len((TEXT + MORE).encode())
    assert client.get_session(session.id).stats == info.stats

    probe = session.score("a fortune")
    assert probe.session_id == session.id
    assert session.score("a fortune") == probe  # scoring without adapting leaves the session as it was
    adapted = session.score("a fortune", adapt=True)
    assert session.get().stats.bytes_observed == info.stats.bytes_observed + len(b"a fortune")
    assert adapted.bits == pytest.approx(probe.bits, rel=1e-6)  # scored before adapting (another batch path)

    generated = session.generate("Yours ", max_tokens=10, seed=2)
    assert generated.usage.completion_tokens == 10
    with session.generate_stream("Yours ", max_tokens=10, seed=2) as stream:
        assert "".join(stream) == generated.text

    reset = session.reset()
    assert reset.id == session.id and reset.stats.bytes_observed == 0 and session.info is reset
    session.delete()
    with pytest.raises(NotFoundError) as e:
        session.get()
    assert e.value.param == "session_id"


def test_client_level_session_calls(client: Client) -> None:
    sid = client.create_session().id
    assert client.observe(sid, TEXT).bytes == len(TEXT.encode())
    assert client.score(MORE, session_id=sid, adapt=True).session_id == sid
    assert client.generate("x", max_tokens=3, session_id=sid, adapt_while_generating=True).usage.completion_tokens == 3
    assert client.reset_session(sid).stats.bytes_observed == 0
    assert client.session(sid).get().id == sid
    client.delete_session(sid)
    with pytest.raises(NotFoundError):
        client.delete_session(sid)


def test_export_import_round_trip(client: Client) -> None:
    source = client.create_session(TEXT, adapter_size=32)
    blob = source.export()
    assert isinstance(blob, bytes) and isinstance(client.export_state(source.id), bytes)
    target = client.import_state("imported-by-the-sdk-0123", blob)
    assert isinstance(target, Session) and target.id == "imported-by-the-sdk-0123"
    assert target.info is not None and source.info is not None
    assert target.info.stats == source.get().stats and target.info.adaptation == source.info.adaptation
    # the copy continues exactly as the original
    assert target.observe(MORE) == source.observe(MORE)
    assert target.score("the end").bits == source.score("the end").bits
    # importing again replaces it
    fresh = client.create_session().export()
    replaced = client.import_state(target.id, fresh).info
    assert replaced is not None and replaced.stats.bytes_observed == 0


def test_session_ids_are_escaped_in_paths(client: Client) -> None:
    with pytest.raises(NotFoundError):
        client.get_session("../../healthz")
    with pytest.raises(ValueError, match="empty"):
        client.get_session("")


def test_user_agent_and_api_key_headers() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"status": "ok"})

    with Client("http://adaptlm.test", api_key="sk-123", headers={"X-Extra": "1"},
                transport=httpx.MockTransport(handler)) as c:
        c.health()
    with Client("http://adaptlm.test", transport=httpx.MockTransport(handler)) as c:
        c.health()
    keyed, plain = seen
    assert keyed.headers["authorization"] == "Bearer sk-123" and keyed.headers["x-extra"] == "1"
    assert keyed.headers["user-agent"].startswith("adaptlm-python/")
    assert "authorization" not in plain.headers


def test_request_bodies_leave_out_what_was_not_given() -> None:
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(200, json={"text": "", "finish_reason": "length",
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}})

    with Client("http://adaptlm.test", transport=httpx.MockTransport(handler)) as c:
        c.generate("a")
        c.generate("a", max_tokens=5, temperature=0, stop=["x"])
        with pytest.raises(AdaptlmError):  # the mock's answer is no session: only the body matters here
            c.create_session(lr=0, copy_model=False)
    assert bodies == [b'{"prompt":"a"}', b'{"prompt":"a","max_tokens":5,"temperature":0,"stop":["x"]}',
                      b'{"adaptation":{"lr":0,"copy_model":false}}']
    with pytest.raises(TypeError, match="list of strings"):
        Client().generate("a", stop="x")


def test_suggest(client: Client) -> None:
    session = client.create_session(TEXT)
    s = session.suggest("It is a tr", k=3, n_chars=4)
    assert s.prefix == "tr"
    assert 1 <= len(s.completions) <= 3 and len(s.next_chars) <= 4
    assert all(w.text.startswith("tr") for w in s.completions)
    probs = [w.prob for w in s.completions]
    assert probs == sorted(probs, reverse=True) and all(0 < p <= 1 for p in probs)
    # the same call through the client, and the session is left unchanged
    assert client.suggest(session.id, "It is a tr", k=3, n_chars=4) == s
    assert session.get().stats.bytes_observed == len(TEXT.encode())
    with pytest.raises(NotFoundError):
        client.suggest("no-such-session-0000", "x")


def test_requests_naming_a_session_in_their_body_carry_it_in_a_header() -> None:
    """A balancer cannot read bodies: score and generate under a session send X-Session-Id (what the shipped
    nginx configuration hashes on); requests without a session send none."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500, json={"error": {"message": "x", "type": "internal_error"}})

    with Client(base_url="http://replica", transport=httpx.MockTransport(handler)) as c:
        for call in (lambda: c.score("hi", session_id="abc"), lambda: c.generate("hi", session_id="abc"),
                     lambda: c.score("hi")):
            with pytest.raises(Exception):  # noqa: B017 (only the request is looked at)
                call()
    assert [r.headers.get("x-session-id") for r in seen] == ["abc", "abc", None]


def test_base_url_needs_a_scheme_and_keeps_a_path_prefix() -> None:
    """"localhost:8000" is refused when the client is made (it would otherwise fail at the first request as a
    connection error, which reads like a server that is down); a proxy's path prefix is kept, with or without
    its trailing slash."""
    for bad in ("localhost:8000", "127.0.0.1:8000", "/adaptlm/", "ftp://127.0.0.1:8000"):
        with pytest.raises(ValueError, match="http:// or https://"):
            Client(bad)
        with pytest.raises(ValueError, match="http:// or https://"):
            AsyncClient(bad)
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.raw_path.decode())
        return httpx.Response(200, json={"status": "ok"})

    for base in ("http://proxy.test/adaptlm/", "http://proxy.test/adaptlm", "https://proxy.test"):
        with Client(base, transport=httpx.MockTransport(handler)) as c:
            c.health()
    assert paths == ["/adaptlm/healthz", "/adaptlm/healthz", "/healthz"]
