"""Session ids per API key (issue 37, item 6): a PUT onto an id that another key's session holds answers as a PUT onto
a free id (it was a 404, which told that the id exists under another key); the importer's session is stored under an
alias of its own that it reaches by the id it sent, and the other key's session is untouched."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from server.engine import MemorySessionStore
from server.engine._session import new_session_id
from server.settings import Settings

KEY_A, KEY_B = "idspace-key-a", "idspace-key-b"
TEXT_A = "Alice's notes: the garden needs water on Tuesdays and Fridays.\n"
TEXT_B = "Bob's draft: quarterly numbers are due before the board meets.\n"
VARYING = {"date", "x-request-id", "content-length"}  # what differs between any two answers
CLOCKS = {"id", "created", "last_used", "expires_at"}


@pytest.fixture(scope="module", params=["memory", "redis"])
def url(request: pytest.FixtureRequest, tiny_checkpoint: Path, serve_app: Any) -> Iterator[str]:
    store = "memory" if request.param == "memory" else request.getfixturevalue("redis_server")
    settings = Settings(checkpoint=tiny_checkpoint, session_store=store,  # type: ignore[arg-type]
                        api_keys=f"{KEY_A},{KEY_B}")
    with serve_app(settings) as live:
        yield live.url


@pytest.fixture
def a(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as client:
        yield client


@pytest.fixture
def b(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60) as client:
        yield client


def header(blob: bytes) -> dict[str, Any]:
    """An export's metadata, its session's JSON read."""
    meta = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    return {**meta, "session": json.loads(meta["session"])}


def same_export(one: bytes, other: bytes, *, created: bool = True) -> bool:
    """The two exports hold the same tensors and metadata (their bytes may differ: safetensors writes the metadata's
    keys in a hash map's order); `created` False: but for the session's creation time."""
    mine, others = header(one), header(other)
    if not created:
        del mine["session"]["created"], others["session"]["created"]
    tensors, theirs = load(one), load(other)
    return mine == others and tensors.keys() == theirs.keys() and all(torch.equal(tensors[k], theirs[k])
                                                                      for k in tensors)


def session_with(client: httpx.Client, text: str) -> str:
    sid = client.post("/v1/sessions", json={}).json()["id"]
    assert client.post(f"/v1/sessions/{sid}/observe", json={"text": text}).status_code == 200
    return str(sid)


def test_a_put_onto_another_keys_id_answers_as_onto_a_free_id(a: httpx.Client, b: httpx.Client) -> None:
    x = session_with(a, TEXT_A)
    blob_a = a.get(f"/v1/sessions/{x}/state").content
    blob_b = b.get(f"/v1/sessions/{session_with(b, TEXT_B)}/state").content
    free = new_session_id()  # as long as x: the same shape of answer
    onto_taken = b.put(f"/v1/sessions/{x}/state", content=blob_b)
    onto_free = b.put(f"/v1/sessions/{free}/state", content=blob_b)
    assert onto_taken.status_code == onto_free.status_code == 200, onto_taken.text
    assert {k: v for k, v in onto_taken.headers.items() if k not in VARYING} == \
        {k: v for k, v in onto_free.headers.items() if k not in VARYING}
    taken, fresh = onto_taken.json(), onto_free.json()
    assert (taken["id"], fresh["id"]) == (x, free)
    assert {k: v for k, v in taken.items() if k not in CLOCKS} == {k: v for k, v in fresh.items() if k not in CLOCKS}
    assert taken["stats"]["bytes_observed"] == len(TEXT_B)
    # each key reaches its own session at x; a's is as it was
    assert b.get(f"/v1/sessions/{x}").json()["stats"]["bytes_observed"] == len(TEXT_B)
    assert a.get(f"/v1/sessions/{x}").json()["stats"]["bytes_observed"] == len(TEXT_A)
    assert same_export(a.get(f"/v1/sessions/{x}/state").content, blob_a)
    assert same_export(b.get(f"/v1/sessions/{x}/state").content, b.get(f"/v1/sessions/{free}/state").content,
                       created=False)


def test_the_importer_works_on_its_own_session_at_the_id(a: httpx.Client, b: httpx.Client, url: str) -> None:
    x = session_with(a, TEXT_A)
    blob_a = a.get(f"/v1/sessions/{x}/state").content
    assert b.put(f"/v1/sessions/{x}/state", content=b.get(f"/v1/sessions/{session_with(b, TEXT_B)}/state").content
                 ).status_code == 200
    seen: list[httpx.Response] = []
    # every route that names a session reaches b's, and says x
    seen.append(observed := b.post(f"/v1/sessions/{x}/observe", json={"text": TEXT_B},
                                   headers={"Idempotency-Key": "idspace-1"}))
    assert observed.status_code == 200 and observed.json()["bytes"] == len(TEXT_B)
    seen.append(again := b.post(f"/v1/sessions/{x}/observe", json={"text": TEXT_B},
                                headers={"Idempotency-Key": "idspace-1"}))
    assert again.headers["idempotent-replayed"] == "true"
    seen.append(scored := b.post("/v1/score", json={"text": "Bob", "session_id": x, "adapt": True}))
    assert scored.status_code == 200, scored.text
    seen.append(gen := b.post("/v1/generate", json={"prompt": " ", "max_tokens": 4, "seed": 1, "session_id": x,
                                                    "adapt_while_generating": True}))
    assert gen.status_code == 200, gen.text
    seen.append(suggested := b.post(f"/v1/sessions/{x}/suggest", json={"context": "Bo", "k": 2}))
    assert suggested.status_code == 200, suggested.text
    # a read answers the last committed record: the generation's adaptation follows its answer, in the session's turn
    deadline = time.monotonic() + 30
    while (stats := b.get(f"/v1/sessions/{x}")).json()["stats"]["bytes_observed"] <= 2 * len(TEXT_B) + 3 \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    seen.append(stats)
    assert stats.json()["id"] == x and stats.json()["stats"]["bytes_observed"] > 2 * len(TEXT_B) + 3
    seen.append(exported := b.get(f"/v1/sessions/{x}/state"))
    assert exported.headers["content-disposition"] == f'attachment; filename="session-{x}.safetensors"'
    seen.append(reset := b.post(f"/v1/sessions/{x}/reset"))
    assert reset.json()["id"] == x and reset.json()["stats"]["bytes_observed"] == 0
    assert same_export(a.get(f"/v1/sessions/{x}/state").content, blob_a)  # a's untouched by all of it
    # each deletes its own, in either order; an alias cannot be named by a client
    assert a.delete(f"/v1/sessions/{x}").status_code == 204
    assert b.get(f"/v1/sessions/{x}").status_code == 200
    assert a.get(f"/v1/sessions/{x}").status_code == 404
    seen.append(named := b.get(f"/v1/sessions/{x}~{'0' * 16}"))
    assert named.status_code == 404
    assert b.delete(f"/v1/sessions/{x}").status_code == 204
    seen.append(gone := b.get(f"/v1/sessions/{x}"))
    assert gone.status_code == 404 and x in gone.json()["error"]["message"]
    seen.append(b.post(f"/v1/sessions/{x}/observe", json={"text": TEXT_B}))
    assert seen[-1].status_code == 404
    seen.append(httpx.get(f"{url}/metrics"))
    for response in seen:  # nothing any answer carries shows the alias
        shown = json.dumps(header(response.content)) if response is exported else response.text
        assert "~" not in shown.replace(f"{x}~{'0' * 16}", "") and "~" not in str(response.headers), \
            response.request.url


def test_a_key_with_its_own_session_at_the_id_replaces_it(a: httpx.Client, b: httpx.Client) -> None:
    x = session_with(a, TEXT_A)
    blob_a = a.get(f"/v1/sessions/{x}/state").content
    empty = a.get(f"/v1/sessions/{a.post('/v1/sessions', json={}).json()['id']}/state").content
    assert b.put(f"/v1/sessions/{x}/state", content=blob_a).status_code == 200  # b's alias, a's blob
    assert a.put(f"/v1/sessions/{x}/state", content=empty).json()["stats"]["bytes_observed"] == 0  # a's own
    assert b.get(f"/v1/sessions/{x}").json()["stats"]["bytes_observed"] == len(TEXT_A)
    assert b.put(f"/v1/sessions/{x}/state", content=empty).status_code == 200  # b replaces its alias
    assert b.get(f"/v1/sessions/{x}").json()["stats"]["bytes_observed"] == 0
    # once a's is gone, b's import still lands on b's one session there
    assert a.delete(f"/v1/sessions/{x}").status_code == 204
    assert b.put(f"/v1/sessions/{x}/state", content=blob_a).status_code == 200
    assert a.get(f"/v1/sessions/{x}").status_code == 404
    assert b.delete(f"/v1/sessions/{x}").status_code == 204
    assert b.get(f"/v1/sessions/{x}").status_code == 404


class CountingStore(MemorySessionStore):
    """Counts the reads: a session's id costs one, its owner's alias a second only where the id is not its."""

    def __init__(self) -> None:
        super().__init__(max_sessions=10, max_bytes=1 << 30)
        self.reads = 0

    def contains(self, session_id: str) -> bool:
        self.reads += 1
        return super().contains(session_id)

    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Any:
        self.reads += 1
        return super().get(session_id, owner, touch=touch)


def test_looking_a_session_up_costs_one_read_where_the_id_is_the_owners() -> None:
    from server.engine import SessionNotFound
    from server.engine._idspace import alias_of, public_id
    from server.engine._session_service import SessionService
    from tests.server.test_redis_store import make

    store = CountingStore()
    service = SessionService(store, ttl_s=60.0, max_ttl_s=60.0, retry_after_s=1)
    x = new_session_id()
    store.insert(make(x, "owner-a"))
    assert service.resolve(x, None) == x and store.reads == 0  # no keys: no resolving
    assert service.resolve(x, "owner-a") == x and store.reads == 1
    assert service.get(x, "owner-a").id == x and store.reads == 2
    with pytest.raises(SessionNotFound, match=x):
        service.get(x, "owner-b")
    assert store.reads == 4  # another owner's: a miss, then its alias (a miss too)
    store.insert(make(alias_of(x, "owner-b"), "owner-b"))
    assert service.route(x, "owner-b") == x  # not looked up since
    assert service.get(x, "owner-b").id == alias_of(x, "owner-b")
    assert service.route(x, "owner-b") == service.resolve(x, "owner-b") == alias_of(x, "owner-b")
    assert service.get(x, "owner-a").id == x and service.route(x, "owner-a") == x
    assert public_id(alias_of(x, "owner-b")) == x and alias_of(x, "owner-b") != alias_of(x, "owner-a")
    with pytest.raises(SessionNotFound, match=f"'{x}'"):
        service.get(alias_of(x, "owner-a"), "owner-a")  # named as its owner knows it
