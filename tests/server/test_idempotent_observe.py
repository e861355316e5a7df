"""An observe under an `Idempotency-Key` is applied once (issue 37, item 5): the key is written with the session's
new state, in the same store write, so that a retry after an answer that was lost (a 503 that came once the write had
landed) answers as the first did instead of observing the text again; the SDK sends a key with each observe."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

import server.app as app_module
from adaptlm_client import Client, RetryPolicy
from server.engine import MemorySessionStore, SessionStore, SessionStoreUnavailable
from server.engine._session import APPLIED_KEPT, Applied, applied_of, keyed
from server.settings import Settings
from tests.server.test_redis_store import make as stand_in_session

TEXT = "The meeting has moved to Thursday afternoon, same room as last week.\n"
ANSWER = {"bits": 1.5, "bytes": 3, "static_bits": 2.0, "updates": 1, "nonfinite_reset": False, "tokens": 3,
          "pending_bytes": 0}


@contextmanager
def losing_replies(monkeypatch: pytest.MonkeyPatch, settings: Settings, serve: Callable[..., Any],
                   lost: list[int]) -> Iterator[str]:
    """A server whose store loses the reply of its next `len(lost)` updates: each is written, then raises as a
    connection dropped after Redis ran the script would (503, `Retry-After: 0` to keep the test short)."""
    real = app_module._session_store

    def store_of(s: Settings) -> SessionStore:
        store = real(s)
        update = store.update

        def update_then_lose(session: Any) -> Any:
            written = update(session)
            if lost:
                lost.pop()
                raise SessionStoreUnavailable("could not use the session store (ConnectionError)", retry_after_s=0)
            return written

        store.update = update_then_lose  # type: ignore[method-assign]
        return store

    monkeypatch.setattr(app_module, "_session_store", store_of)
    with serve(settings) as live:
        yield live.url


@pytest.fixture(params=["memory", "redis"])
def store_setting(request: pytest.FixtureRequest) -> str:
    return "memory" if request.param == "memory" else request.getfixturevalue("redis_url")


def test_an_observe_whose_reply_was_lost_is_applied_once(tiny_checkpoint: Path, serve_app: Any, store_setting: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    lost: list[int] = []
    settings = Settings(checkpoint=tiny_checkpoint, session_store=store_setting)  # type: ignore[arg-type]
    with losing_replies(monkeypatch, settings, serve_app, lost) as url:
        seen: list[httpx.Response] = []
        transport = httpx.HTTPTransport()

        class Recording(httpx.BaseTransport):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                response = transport.handle_request(request)
                seen.append(response)
                return response

        with Client(url, transport=Recording(), retry=RetryPolicy(max_retries=3)) as client:
            twin, session = client.create_session(), client.create_session()
            expected = twin.observe(TEXT)  # the same text on a twin session, no reply lost
            assert [r.status_code for r in seen] == [201, 201, 200]
            lost.append(1)
            seen.clear()
            answer = session.observe(TEXT)
            assert [r.status_code for r in seen] == [503, 200]
            keys = {r.request.headers["idempotency-key"] for r in seen}
            assert len(keys) == 1 and seen[1].headers["idempotent-replayed"] == "true"
            # applied once, and the retry answered as the lost reply would have
            assert session.get().stats.bytes_observed == len(TEXT.encode())
            assert twin.get().stats.bytes_observed == len(TEXT.encode())
            assert answer == expected
            assert session.get().stats == twin.get().stats
            # a new observe is a new key: applied
            assert session.observe(TEXT).bytes == len(TEXT.encode())
            assert session.get().stats.bytes_observed == 2 * len(TEXT.encode())


def observe(client: httpx.Client, sid: str, text: str, key: str | None) -> httpx.Response:
    return client.post(f"/v1/sessions/{sid}/observe", json={"text": text},
                       headers={"Idempotency-Key": key} if key is not None else {})


def test_a_key_is_applied_once_and_answers_as_it_did(client: httpx.Client, assert_error: Any) -> None:
    sid = client.post("/v1/sessions", json={}).json()["id"]
    first = observe(client, sid, TEXT, "7f4c1f2e-2b5e-4f0e-9c1e-0a3f5d6b7c8d")
    assert first.status_code == 200 and first.headers["idempotent-replayed"] == "false"
    again = observe(client, sid, TEXT, '"7f4c1f2e-2b5e-4f0e-9c1e-0a3f5d6b7c8d"')  # its Structured Field form
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT)
    # the key names one observe: another text under it is refused, nothing applied
    other = observe(client, sid, TEXT + "!", "7f4c1f2e-2b5e-4f0e-9c1e-0a3f5d6b7c8d")
    assert assert_error(other, 422, "validation_error", param="Idempotency-Key")["code"] == "idempotency_key_reused"
    # a reset keeps the keys (a retry after it still applies nothing); without a key, every observe applies
    assert client.post(f"/v1/sessions/{sid}/reset").status_code == 200
    assert observe(client, sid, TEXT, "7f4c1f2e-2b5e-4f0e-9c1e-0a3f5d6b7c8d").headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in observe(client, sid, TEXT, None).headers
    observe(client, sid, TEXT, None)
    assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 2 * len(TEXT)
    # so does a re-import of its own export (the export carries no keys; the replaced record's are kept)
    blob = client.get(f"/v1/sessions/{sid}/state").content
    assert client.put(f"/v1/sessions/{sid}/state", content=blob).status_code == 200
    assert observe(client, sid, TEXT, "7f4c1f2e-2b5e-4f0e-9c1e-0a3f5d6b7c8d").headers["idempotent-replayed"] == "true"
    assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 2 * len(TEXT)


@pytest.mark.parametrize("key", ["", "a b", "x" * 129, "ключ", '"unterminated', "a\tb"])
def test_a_malformed_key_is_a_422_in_the_error_shape(client: httpx.Client, assert_error: Any, key: str) -> None:
    sid = client.post("/v1/sessions", json={}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/observe", json={"text": TEXT},
                    headers=[(b"Idempotency-Key", key.encode())])
    assert_error(r, 422, "validation_error", param="Idempotency-Key")
    assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == 0


def entry(key: str) -> Applied:
    return Applied(key, "d" * 32, ANSWER)


def test_a_session_keeps_its_last_keys_through_writes_and_a_snapshot(tmp_path: Path) -> None:
    """Bounded: the last APPLIED_KEPT keys, oldest out first; kept through writes without a key (a reset), an
    insert over the same owner's record (an import), and the memory store's snapshot."""
    from tests.server._stores import SESSIONS
    from tests.server.test_redis_store import HASH, TEMPLATE

    store = MemorySessionStore(max_sessions=10, max_bytes=10**9, snapshot=tmp_path / "sessions.zip")
    store.bind(HASH, TEMPLATE, SESSIONS)
    record = store.insert(stand_in_session("a", "alice"))
    for i in range(APPLIED_KEPT + 3):
        read = store.get("a", "alice")
        assert read is not None
        record = store.update(keyed(read, applied=applied_of(read), observing=entry(f"k{i}")))  # type: ignore[assignment]
    keys = [e.key for e in applied_of(store.get("a", "alice"))]
    assert keys == [f"k{i}" for i in range(3, APPLIED_KEPT + 3)]
    plain = dataclasses.replace(stand_in_session("a", "alice", seed=2), revision=record.revision)
    store.update(plain)  # a write without a key (a reset)
    store.insert(stand_in_session("a", "alice", seed=3))  # an import over it
    assert [e.key for e in applied_of(store.get("a", "alice"))] == keys
    store.insert(stand_in_session("b", "bob"))
    assert applied_of(store.get("b", "bob")) == ()
    store.close()
    restored = MemorySessionStore(max_sessions=10, max_bytes=10**9, snapshot=tmp_path / "sessions.zip")
    restored.bind(HASH, TEMPLATE, SESSIONS)
    back = applied_of(restored.get("a", "alice"))
    assert [e.key for e in back] == keys and back[-1].answer == ANSWER


def test_the_redis_store_writes_the_key_with_the_state(redis_url: str) -> None:
    """In the update script, with the blob: read back with the record; a second write of the same key from an older
    read is refused (nothing written); the bound holds."""
    from server.engine import SessionConflict
    from tests.server.test_redis_store import store_at

    store = store_at(redis_url)
    store.insert(stand_in_session("a", "alice"))
    read = store.get("a", "alice")
    assert read is not None and applied_of(read) == ()
    store.update(keyed(read, applied=(), observing=entry("k0")))
    stored = store.get("a", "alice")
    assert stored is not None and applied_of(stored) == (entry("k0"),)
    with pytest.raises(SessionConflict):  # stale, and its key applied
        store.update(keyed(read, applied=(), observing=entry("k0")))
    for i in range(1, APPLIED_KEPT + 2):
        stored = store.get("a", "alice")
        assert stored is not None
        store.update(keyed(stored, applied=applied_of(stored), observing=entry(f"k{i}")))
    stored = store.get("a", "alice")
    assert stored is not None
    assert [e.key for e in applied_of(stored)] == [f"k{i}" for i in range(2, APPLIED_KEPT + 2)]
    store.insert(stand_in_session("a", "alice", seed=3))  # an import over it keeps them; another owner's would not
    assert len(applied_of(store.get("a", "alice"))) == APPLIED_KEPT
