"""Each server keeps the sessions it serves (`RedisSessionStore`'s cache): a read sends its copy's revision and Redis
sends the blob only when the stored revision is another, so a keystroke on a session this server last wrote reads a
few hundred bytes from Redis, not the session; a write elsewhere, a delete elsewhere, a session that moves to
another server and comes back are each seen at the next read (Redis is the truth: a copy is served only once Redis
has said it is current)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
from safetensors.torch import load

from server.engine import RedisSessionStore, Session, SessionConflict, SessionStats
from server.engine._session import Applied, applied_of, keyed
from server.settings import Settings
from tests.server.test_redis_store import MORE, TEXT, make, store_at

KEYSTROKE_MAX = 4096  # bytes read from Redis a keystroke on a session this server holds (issue 35's target)


def read_bytes(url: str) -> Callable[[Callable[[], Any]], int]:
    """`measure(call)`: the bytes Redis sent its clients while `call` ran, less what the two INFO calls that measure
    it take themselves (measured alike, with nothing between them)."""
    client = redis.Redis.from_url(url)

    def sent() -> int:
        return int(client.info("stats")["total_net_output_bytes"])

    def between(call: Callable[[], Any]) -> int:
        before = sent()
        call()
        return sent() - before

    idle = min(between(lambda: None) for _ in range(3))
    return lambda call: between(call) - idle


# -- the store ------------------------------------------------------------------------------------------------


@pytest.fixture
def stores(redis_url: str) -> Iterator[tuple[RedisSessionStore, RedisSessionStore]]:
    one, two = store_at(redis_url), store_at(redis_url)
    yield one, two
    one.close()
    two.close()


def big(session_id: str) -> Session:
    return make(session_id, k=16)  # an adapter of 16x16 floats: a blob of a few kilobytes


def test_a_read_of_an_unchanged_session_sends_no_blob(stores: Any, redis_url: str) -> None:
    one, two = stores
    measure = read_bytes(redis_url)
    written = one.insert(big("a"))
    blob = measure(lambda: two.get("a", None))  # a server that never held it: the whole record
    assert blob > 2000
    assert measure(lambda: one.get("a", None)) < 200  # its own write: the revision matches, the touch is done
    assert measure(lambda: two.get("a", None)) < 200  # read once, then kept
    got = one.get("a", None)
    assert got is not None and got.revision == written.revision and got.last_used > written.last_used
    assert measure(lambda: one.get("a", "someone")) < 200 and one.get("a", "someone") is None  # the owner check


def test_a_write_or_delete_elsewhere_is_seen_at_the_next_read(stores: Any) -> None:
    one, two = stores
    one.insert(big("a"))
    first = one.get("a", None)
    assert first is not None and two.get("a", None) is not None  # both hold it now
    written = two.update(dataclasses.replace(first, last_token=33, stats=SessionStats(bytes_observed=50)))
    assert written is not None
    got = one.get("a", None)  # never the copy it held: Redis has a newer revision
    assert got is not None and (got.revision, got.last_token, got.stats.bytes_observed) == (written.revision, 33, 50)
    with pytest.raises(SessionConflict):  # and the old copy's work is refused, as without a cache
        one.update(dataclasses.replace(first, last_token=44))
    assert one.get("a", None).last_token == 33  # type: ignore[union-attr]
    assert two.delete("a", None)
    assert one.get("a", None) is None  # deleted elsewhere: the copy is not served
    two.insert(big("a"))  # created again under the same id: a new revision
    again = one.get("a", None)
    assert again is not None and again.last_token == 10 and again.stats.bytes_observed == 40


def test_the_idempotency_keys_of_a_kept_copy_are_the_stored_ones(stores: Any) -> None:
    one, two = stores
    one.insert(big("a"))
    got = one.get("a", None)
    assert got is not None
    entry = Applied("k1", "d" * 32, {"bits": 1.0})
    one.update(keyed(dataclasses.replace(got, last_token=20), applied=applied_of(got), observing=entry))
    mine, theirs = one.get("a", None), two.get("a", None)  # its own write's copy, and a read of Redis
    assert applied_of(mine) == applied_of(theirs) == (entry,)
    two.insert(dataclasses.replace(big("a"), last_token=30))  # an import over it: the keys are passed on
    mine = one.get("a", None)
    assert mine is not None and mine.last_token == 30 and applied_of(mine) == (entry,)
    replaced = two.insert(dataclasses.replace(big("a"), last_token=40))  # the insert's record is what it stored
    assert applied_of(replaced) == (entry,) and applied_of(two.get("a", None)) == (entry,)


def test_the_cache_is_bounded_by_count_and_bytes(redis_url: str) -> None:
    measure = read_bytes(redis_url)
    writer = store_at(redis_url)
    for name in "abc":
        writer.insert(big(name))
    by_count, by_bytes = store_at(redis_url, cache_sessions=2), store_at(redis_url, cache_bytes=1)
    try:
        for name in "abc":
            by_count.get(name, None)
        assert measure(lambda: by_count.get("c", None)) < 200
        assert measure(lambda: by_count.get("a", None)) > 2000  # the least recently used made room
        by_bytes.get("a", None)
        assert measure(lambda: by_bytes.get("a", None)) > 2000  # a blob over the budget is not kept
    finally:
        for store in (writer, by_count, by_bytes):
            store.close()


# -- servers on Redis -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_checkpoint: Path, redis_server: str, serve_app: Any) -> Iterator[tuple[str, str]]:
    """Two servers sharing one Redis, as two replicas (no suggestion budget: answers are compared exactly)."""
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_server,  # type: ignore[arg-type]
                        suggest_budget_ms=0)
    with serve_app(settings) as one, serve_app(settings) as two:
        yield one.url, two.url


@pytest.fixture
def clients(servers: tuple[str, str]) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with httpx.Client(base_url=servers[0], timeout=60) as a, httpx.Client(base_url=servers[1], timeout=60) as b:
        yield a, b


def ok(response: httpx.Response) -> Any:
    assert response.status_code in (200, 201), response.text
    return response.json()


def suggest(client: httpx.Client, sid: str, context: str) -> Any:
    return ok(client.post(f"/v1/sessions/{sid}/suggest", json={"context": context, "k": 3}))


def test_a_keystroke_reads_kilobytes_and_suggests_as_a_read_of_the_blob(clients: Any, redis_server: str) -> None:
    a, b = clients
    measure = read_bytes(redis_server)
    sid = ok(a.post("/v1/sessions", json={"initial_text": TEXT}))["id"]
    size = len(a.get(f"/v1/sessions/{sid}/state").content)
    assert size > 4 * KEYSTROKE_MAX  # so that a keystroke that read the blob would fail below
    context = "It is a tru"
    answers: list[Any] = []
    costs = [measure(lambda c=context[:n]: answers.append(suggest(a, sid, c))) for n in range(6, len(context) + 1)]
    assert max(costs) <= KEYSTROKE_MAX, costs
    # the other server reads the session whole, once, and suggests what the one that kept it does
    assert measure(lambda: suggest(b, sid, context[:6])) > size // 2
    assert [suggest(b, sid, context[:n]) for n in range(6, len(context) + 1)] == answers
    observed = measure(lambda: ok(a.post(f"/v1/sessions/{sid}/observe", json={"text": " of a"})))
    assert observed <= KEYSTROKE_MAX  # its write sends the blob to Redis; it reads back no more than a keystroke
    assert suggest(b, sid, context) == suggest(a, sid, context)


def test_a_session_that_moves_to_the_other_server_and_comes_back(clients: Any, redis_server: str) -> None:
    a, b = clients
    measure = read_bytes(redis_server)
    texts = [TEXT[:40], TEXT[40:], MORE[:50], MORE[50:]]
    sid = ok(a.post("/v1/sessions", json={}))["id"]
    ok(a.post(f"/v1/sessions/{sid}/observe", json={"text": texts[0]}))
    ok(b.post(f"/v1/sessions/{sid}/observe", json={"text": texts[1]}))  # the session moved (a failed replica)...
    size = len(b.get(f"/v1/sessions/{sid}/state").content)
    back = measure(lambda: ok(a.post(f"/v1/sessions/{sid}/observe", json={"text": texts[2]})))
    assert back > size // 2  # ...and came back: `a` reloaded it, its copy was stale
    ok(a.post(f"/v1/sessions/{sid}/observe", json={"text": texts[3]}))
    info = ok(b.get(f"/v1/sessions/{sid}"))
    assert info["stats"]["bytes_observed"] == sum(len(t) for t in texts)
    # the same observes on one server, never moved, end in the same state
    replay = ok(a.post("/v1/sessions", json={}))["id"]
    for text in texts:
        ok(a.post(f"/v1/sessions/{replay}/observe", json={"text": text}))
    moved, kept = (load(b.get(f"/v1/sessions/{s}/state").content) for s in (sid, replay))
    assert moved.keys() == kept.keys() and all(torch.equal(moved[k], kept[k]) for k in kept)
    assert ok(a.get(f"/v1/sessions/{replay}"))["stats"] == info["stats"]


def test_a_session_deleted_on_one_server_is_gone_on_the_other(clients: Any) -> None:
    a, b = clients
    sid = ok(a.post("/v1/sessions", json={"initial_text": TEXT[:30]}))["id"]
    suggest(a, sid, "the")
    suggest(b, sid, "the")  # both hold it
    assert b.delete(f"/v1/sessions/{sid}").status_code == 204
    assert a.get(f"/v1/sessions/{sid}").status_code == 404
    assert a.post(f"/v1/sessions/{sid}/suggest", json={"context": "the"}).status_code == 404
