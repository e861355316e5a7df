"""The Redis session store against a real redis-server: the store's interface (as the memory store's tests, with
real time for the TTL), sessions that survive a restart, servers that share them, owners, expiry, a Redis that
goes away, and a shutdown that finishes the work in flight."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
from safetensors.torch import load

from models.adaptation import evaluate
from models.checkpoint import load_checkpoint
from server.engine import (
    RedisSessionStore,
    Session,
    SessionConflict,
    SessionStats,
    SessionStoreFull,
    SessionStoreUnavailable,
    export_session,
)
from server.engine._redis_form import join
from server.settings import Settings
from tests.server._stores import (
    SESSIONS,
    evictions_follow_the_lru_walk,
    expired_sessions_make_room_first,
    several_victims_until_within_share,
    stale_reads_are_refused,
    stand_in_session,
    the_oldest_sessions_protected,
)
from trainer.evaluation import config_for

HASH = "c" * 64
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."
MORE = "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this"


def make(session_id: str, owner: str | None = None, *, k: int = 4, ttl: float = 60.0, seed: int = 0) -> Session:
    now = time.time()
    # `created` in whole seconds: every export the same size (the header holds it; a float's repr varies)
    return stand_in_session(session_id, owner, k=k, ttl=ttl, seed=seed, created=float(int(now)) - 5, last_used=now)


TEMPLATE = dataclasses.replace(make(""), stats=SessionStats(), memories={})
SIZE = len(export_session(make("x"), HASH, SESSIONS))  # what a session takes in Redis: its export


def store_at(url: str, **limits: Any) -> RedisSessionStore:
    store = RedisSessionStore(url, max_sessions=limits.pop("max_sessions", 100),
                              max_bytes=limits.pop("max_bytes", 10**9), **limits)
    store.bind(HASH, TEMPLATE, SESSIONS)
    return store


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisSessionStore]:
    s = store_at(redis_url)
    yield s
    s.close()


def stored_export(fields: dict[bytes, bytes]) -> bytes:
    """The export a stored record's hash holds (its state fields: the parts, or one `blob`)."""
    return join({k: v for k, v in fields.items() if k in (b"blob", b"hdr", b"lay") or k.startswith(b"c:")})[0]


def same(a: Session, b: Session) -> bool:
    tensors = [(a.state, b.state), (a.static_state, b.static_state)]
    return (a.id, a.owner, a.config, a.stats, a.last_token, a.ttl_s, a.created) == (
        b.id, b.owner, b.config, b.stats, b.last_token, b.ttl_s, b.created) and all(
        torch.equal(x.tensors[k], y.tensors[k]) for x, y in tensors for k in y.tensors) and all(
        torch.equal(a.adapter.mats[k], b.adapter.mats[k]) for k in b.adapter.mats)


# -- the store's interface ---------------------------------------------------------------------------------


def test_round_trip_and_accounting(store: RedisSessionStore) -> None:
    original = make("a", owner="alice", seed=3)
    store.insert(original)
    got = store.get("a", "alice", touch=False)
    assert got is not None and same(got, original) and got.last_used == original.last_used
    touched = store.get("a", "alice")
    assert touched is not None and touched.last_used > original.last_used and same(touched, original)
    assert store.contains("a") and not store.contains("b")
    stats = store.stats()
    assert (stats.sessions, stats.bytes, dict(stats.evictions)) == (1, SIZE, {"ttl": 0, "lru": 0})


def test_nothing_is_pickled(store: RedisSessionStore, redis_url: str) -> None:
    store.insert(make("a", owner="alice"))
    with redis.Redis.from_url(redis_url) as r:
        keys = r.keys("adaptlm:*:s:a")
        assert len(keys) == 1
        fields = r.hgetall(keys[0])
        assert all(value[:1] != b"\x80" for value in fields.values())  # not a pickle
        blob = stored_export(fields)
        meta = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
        assert meta["format"] == "adaptlm-session" and meta["model_hash"] == HASH
        assert set(load(blob)) == {"state.h", "state.c", "static.h", "static.c", "adapter.h"}
        assert r.hget(keys[0], "owner") == b"alice"
        assert 0 < r.pttl(keys[0]) <= 60_000


def test_lru_eviction_by_count_keeps_the_recently_used(redis_url: str) -> None:
    store = store_at(redis_url, max_sessions=2)
    store.insert(make("a"))
    store.insert(make("b"))
    assert store.get("a", None) is not None  # a is now the most recently used
    store.insert(make("c"))
    assert store.get("b", None) is None
    assert store.get("a", None) is not None and store.get("c", None) is not None
    stats = store.stats()
    assert (stats.sessions, stats.bytes, stats.evictions["lru"], stats.evictions["ttl"]) == (2, 2 * SIZE, 1, 0)


def test_memory_budget_evicts_by_bytes(redis_url: str) -> None:
    store = store_at(redis_url, max_bytes=2 * SIZE + 10)
    for name in "abc":
        store.insert(make(name))
    assert [store.contains(n) for n in "abc"] == [False, True, True]
    assert store.stats().bytes == 2 * SIZE
    with pytest.raises(SessionStoreFull):  # larger than the whole budget: refused, nothing evicted
        store.insert(make("big", k=64))
    assert store.stats().sessions == 2 and store.stats().evictions["lru"] == 1 and not store.contains("big")


def test_pinned_sessions_are_never_evicted(redis_url: str) -> None:
    store = store_at(redis_url, max_sessions=2)
    store.insert(make("a"))
    store.insert(make("b"))
    store.pin("a")
    store.pin("b")
    with pytest.raises(SessionStoreFull):
        store.insert(make("c"))
    assert store.contains("a") and store.contains("b") and store.stats().evictions["lru"] == 0
    store.unpin("b")
    store.insert(make("c"))
    assert store.contains("a") and not store.contains("b") and store.contains("c")


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_evictions_follow_the_lru_walk(redis_url: str, share: bool, seed: int) -> None:
    # 150 random steps (each checks all 24 ids against Redis); the memory store's test takes 300
    evictions_follow_the_lru_walk(lambda **limits: store_at(redis_url, **limits), make,
                                  lambda s: len(export_session(s, HASH, SESSIONS)), share=share, seed=seed, steps=150)


def test_the_oldest_sessions_protected_by_a_share_are_passed_over(redis_url: str) -> None:
    the_oldest_sessions_protected(lambda **limits: store_at(redis_url, **limits), make)


def test_several_victims_are_taken_until_their_owners_are_within_their_share(redis_url: str) -> None:
    several_victims_until_within_share(lambda **limits: store_at(redis_url, **limits), make,
                                       lambda s: len(export_session(s, HASH, SESSIONS)))


def test_expired_sessions_make_room_before_live_ones_are_evicted(redis_url: str) -> None:
    # Redis drops the expired keys; their index entries wait for a sweep, and must not count as live sessions
    expired_sessions_make_room_first(lambda **limits: store_at(redis_url, **limits), make, time.sleep)


def test_sessions_used_at_the_same_time_are_evicted_in_the_lru_orders_order(redis_url: str) -> None:
    # the LRU order is a sorted set by last use, a tie ordered by id: the victims, read from each owner's own sorted
    # set, are merged in that order (the ids here are inserted against it)
    store = store_at(redis_url, max_sessions=4, owner_max_sessions=1, owner_max_bytes=10**9)
    t = time.time()
    for name, owner in (("s3", "bob"), ("s2", "alice"), ("s1", "bob"), ("s0", "alice")):
        store.insert(dataclasses.replace(make(name, owner), last_used=t))
    store.insert(dataclasses.replace(make("s4", "carol"), last_used=t))  # alice and bob over their share
    assert [store.contains(f"s{i}") for i in range(5)] == [False, True, True, True, True]
    store.insert(dataclasses.replace(make("s5", "carol"), last_used=t))  # bob and carol over theirs now
    assert [store.contains(f"s{i}") for i in range(6)] == [False, False, True, True, True, True]


def test_ttl_expiry_is_counted_and_extended_by_use(store: RedisSessionStore) -> None:
    store.insert(make("a", ttl=1.0))
    store.insert(make("b", ttl=1.0))
    time.sleep(0.6)
    assert store.get("a", None) is not None  # touched: a lives 1 s from now
    time.sleep(0.6)
    assert store.get("b", None) is None
    assert store.get("a", None) is not None
    assert store.sweep() == 1 and store.stats().evictions["ttl"] == 1 and store.stats().sessions == 1
    store.pin("a")
    time.sleep(1.2)
    assert store.sweep() == 0 and store.get("a", None, touch=False) is not None  # in use: not expired
    store.unpin("a")  # its time is up: it goes now
    time.sleep(0.05)
    assert store.get("a", None) is None
    assert store.sweep() == 1 and store.stats().sessions == 0 and store.stats().evictions["ttl"] == 2
    assert store.stats().bytes == 0


def test_owners_see_only_their_sessions(store: RedisSessionStore) -> None:
    store.insert(make("a", owner="alice"))
    assert store.get("a", "bob") is None and store.get("a", None) is None
    assert not store.delete("a", "bob")
    assert store.contains("a") and store.get("a", "alice") is not None
    assert store.delete("a", "alice") and not store.contains("a")
    assert store.stats().sessions == 0 and store.stats().bytes == 0


def test_update_only_replaces_a_present_session(store: RedisSessionStore) -> None:
    inserted = store.insert(make("a"))
    newer = dataclasses.replace(make("a", seed=1), last_token=33, revision=inserted.revision)
    assert store.update(newer)
    got = store.get("a", None)
    assert got is not None and got.last_token == 33 and same(dataclasses.replace(got, last_used=0),
                                                             dataclasses.replace(newer, last_used=0))
    store.delete("a", None)
    assert store.update(dataclasses.replace(newer, revision=got.revision)) is None and not store.contains("a")


def test_an_update_from_a_stale_read_is_refused(redis_url: str) -> None:
    # two servers on one Redis
    old = stale_reads_are_refused(store_at(redis_url), store_at(redis_url), make,
                                  lambda got: len(export_session(got, HASH, SESSIONS)))
    with redis.Redis.from_url(redis_url) as r:  # the blob (an export) carries no revision
        blob = stored_export(r.hgetall(r.keys("adaptlm:*:s:a")[0]))
        assert b"revision" not in blob and old.revision.encode() not in blob  # type: ignore[union-attr]


def test_a_record_written_before_revisions_can_be_updated_once(store: RedisSessionStore, redis_url: str) -> None:
    # a session a server of an older version wrote has no revision: work that read it may write it, once
    store.insert(make("a"))
    with redis.Redis.from_url(redis_url) as r:
        r.hdel(r.keys("adaptlm:*:s:a")[0], "revision")
    first, second = store.get("a", None), store.get("a", None)
    assert first is not None and second is not None and first.revision == ""
    assert store.update(dataclasses.replace(first, last_token=33)) is not None
    with pytest.raises(SessionConflict):
        store.update(second)


def test_two_stores_share_sessions_and_leases(redis_url: str) -> None:
    one, two = store_at(redis_url, max_sessions=2), store_at(redis_url, max_sessions=2)
    original = make("a", owner="alice")
    one.insert(original)
    got = two.get("a", "alice")
    assert got is not None and same(got, original)
    one.insert(make("b"))
    one.pin("a")  # work in flight on the first server
    two.pin("b")
    with pytest.raises(SessionStoreFull):  # neither may be evicted by either server
        two.insert(make("c"))
    one.unpin("a")
    two.insert(make("c"))
    assert not one.contains("a") and one.contains("b") and one.contains("c")
    assert two.stats().evictions["lru"] == 1 and one.stats().evictions["lru"] == 0
    assert one.stats().sessions == two.stats().sessions == 2


def test_a_lapsed_lease_no_longer_protects(redis_url: str) -> None:
    crashed = store_at(redis_url, lease_s=0.3)
    crashed.insert(make("a"))
    crashed.pin("a")  # and never unpins: its server died
    other = store_at(redis_url, max_sessions=1)
    with pytest.raises(SessionStoreFull):
        other.insert(make("b"))
    time.sleep(0.5)
    other.insert(make("b"))
    assert not other.contains("a") and other.contains("b")


def test_concurrent_use_keeps_the_books(redis_url: str) -> None:
    stores = [store_at(redis_url, max_sessions=30) for _ in range(2)]

    def work(t: int) -> None:
        store = stores[t % 2]
        for i in range(60):
            name = f"s{(t * 7 + i) % 50}"
            store.insert(make(name))
            store.get(name, None)
            if i % 3 == 0:
                store.delete(f"s{(t + i) % 50}", None)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = stores[0].stats()
    assert stats.sessions <= 30 and stats.bytes == stats.sessions * SIZE
    assert sum(stores[0].contains(f"s{i}") for i in range(50)) == stats.sessions


def test_an_unreachable_redis_is_reported(start_redis: Any) -> None:
    with start_redis() as url:
        store = store_at(url)
        store.insert(make("a"))
        assert store.stats().sessions == 1
    with pytest.raises(SessionStoreUnavailable):
        store.get("a", None)
    with pytest.raises(SessionStoreUnavailable):
        store.insert(make("b"))
    store.pin("a")  # best effort: logged, never raised (the engine's worker calls these)
    store.unpin("a")
    assert store.sweep() == 0 and store.stats().sessions == 1  # the last statistics seen
    with pytest.raises(SessionStoreUnavailable):
        store_at(url)


# -- servers on Redis ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Path) -> Any:
    return load_checkpoint(tiny_checkpoint)


def create(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def observe(client: httpx.Client, sid: str, text: str) -> dict[str, Any]:
    r = client.post(f"/v1/sessions/{sid}/observe", json={"text": text})
    assert r.status_code == 200, r.text
    return dict(r.json())


def probe(client: httpx.Client, sid: str) -> dict[str, Any]:
    r = client.post("/v1/score", json={"text": "truth is a fortune", "session_id": sid, "logprobs": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def export(client: httpx.Client, sid: str) -> dict[str, Any]:
    """The session's export, as comparable values (its creation time left out)."""
    blob = client.get(f"/v1/sessions/{sid}/state").content
    meta = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    meta["session"] = json.loads(meta["session"])
    return {"meta": meta, "tensors": {k: v.tolist() for k, v in load(blob).items()}}


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {labels}")


def test_a_session_survives_a_restart(tiny_checkpoint: Path, redis_url: str, serve_app: Any, ckpt: Any) -> None:
    # no time budget: on a loaded machine the budget could cut one of the two searches compared below
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url,  # type: ignore[arg-type]
                        suggest_budget_ms=0)
    first = TEXT[:60]  # whole segments: the observe after the restart continues the same evaluation
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        created = create(c, initial_text=first)
        sid = created["id"]
        before, exported = probe(c, sid), export(c, sid)
        suggested = c.post(f"/v1/sessions/{sid}/suggest", json={"context": "the tru"}).json()
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        assert probe(c, sid) == before  # bit-identical scores from the restored state and adapter
        assert export(c, sid) == exported
        assert c.post(f"/v1/sessions/{sid}/suggest", json={"context": "the tru"}).json() == suggested
        after = observe(c, sid, MORE)
        assert c.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(first) + len(MORE)
    reference = evaluate(ckpt.model, (first + MORE).encode(), config_for("sparse", ckpt.dyneval), stats=ckpt.stats)
    assert created["observed"]["bits"] + after["bits"] == pytest.approx(reference.bits, rel=1e-5)


def test_two_servers_share_sessions(tiny_checkpoint: Path, redis_url: str, serve_app: Any,
                                    assert_error: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url)  # type: ignore[arg-type]
    with serve_app(settings) as one, serve_app(settings) as two, httpx.Client(base_url=one.url, timeout=60) as a, \
            httpx.Client(base_url=two.url, timeout=60) as b:
        sid = create(a, initial_text=TEXT)["id"]
        assert b.get(f"/v1/sessions/{sid}").json()["stats"] == a.get(f"/v1/sessions/{sid}").json()["stats"]
        observe(b, sid, MORE)
        assert a.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT) + len(MORE)
        assert probe(a, sid) == probe(b, sid) and export(a, sid) == export(b, sid)
        assert metric(a, "adaptlm_active_sessions") == metric(b, "adaptlm_active_sessions") == 1
        assert b.delete(f"/v1/sessions/{sid}").status_code == 204
        assert_error(a.get(f"/v1/sessions/{sid}"), 404, "not_found_error", "session_id")


def hold_next_update(live: Any) -> tuple[threading.Event, threading.Event]:
    """Hold the next session write of `live`'s engine (on its worker thread) until `release` is set; `held` is set
    once it waits: its work has read the session and done its computing, and has written nothing yet."""
    store = live.app.state.engine.store
    held, release = threading.Event(), threading.Event()
    original = store.update

    def update(session: Session) -> Session | None:
        del store.update  # this write only
        held.set()
        release.wait(60)
        return original(session)  # type: ignore[no-any-return]

    store.update = update
    return held, release


def test_two_servers_working_on_one_session_at_once_apply_one_and_refuse_the_other(
        tiny_checkpoint: Path, redis_url: str, serve_app: Any, assert_error: Any) -> None:
    # what a request without the affinity header may do: run on another replica while the session's other work does
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url)  # type: ignore[arg-type]
    late, early = TEXT[:40], MORE[:60]
    with serve_app(settings) as one, serve_app(settings) as two, httpx.Client(base_url=one.url, timeout=60) as a, \
            httpx.Client(base_url=two.url, timeout=60) as b:
        sid = create(a, initial_text=TEXT)["id"]

        def race(path: str, body: dict[str, Any] | None) -> httpx.Response:
            """`path` on server one, held before its write while server two observes `early` in full."""
            held, release = hold_next_update(one)
            answers: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: answers.append(a.post(path, json=body)))
            thread.start()
            try:
                assert held.wait(60)  # server one has read the session and computed
                observe(b, sid, early)  # server two read the same record: it writes first
            finally:
                release.set()
                thread.join(60)
            return answers[0]

        refused = race(f"/v1/sessions/{sid}/observe", {"text": late})
        error = assert_error(refused, 409, "conflict_error", "session_id")
        assert error["code"] == "session_conflict" and "nothing of this request was applied" in error["message"]
        assert refused.headers["retry-after"] == "1"
        assert a.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT) + len(early)
        assert metric(a, "adaptlm_refused_requests_total", reason="session_conflict") == 1
        observe(a, sid, late)  # sent again: it continues from the session as server two left it
        stats = b.get(f"/v1/sessions/{sid}").json()["stats"]
        assert stats["bytes_observed"] == len(TEXT) + len(early) + len(late)
        reference = create(b, initial_text=TEXT)["id"]  # one server given the applied observes, in their order
        observe(b, reference, early)
        observe(b, reference, late)
        assert {**probe(a, sid), "session_id": None} == {**probe(b, reference), "session_id": None}
        assert b.get(f"/v1/sessions/{reference}").json()["stats"] == stats

        refused = race(f"/v1/sessions/{sid}/reset", None)  # a reset is checked as well
        assert assert_error(refused, 409, "conflict_error", "session_id")["code"] == "session_conflict"
        assert a.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == stats["bytes_observed"] + len(early)


def test_a_generation_adapts_its_session_even_when_another_server_changed_it_meanwhile(
        tiny_checkpoint: Path, redis_url: str, serve_app: Any) -> None:
    # adapt_while_generating: the answer goes out, then the session observes prompt + generated; another server's
    # observe lands between that observe's read and its write, so the write is refused and the observe done again
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url)  # type: ignore[arg-type]
    early, prompt = MORE[:60], "It is a truth"
    with serve_app(settings) as one, serve_app(settings) as two, httpx.Client(base_url=one.url, timeout=60) as a, \
            httpx.Client(base_url=two.url, timeout=60) as b:
        sid = create(a, initial_text=TEXT)["id"]
        held, release = hold_next_update(one)
        try:
            generated = a.post("/v1/generate", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                     "session_id": sid, "adapt_while_generating": True})
            assert generated.status_code == 200, generated.text
            assert held.wait(60)  # server one's observe of the generation has read the session and computed
            observe(b, sid, early)  # server two writes first
        finally:
            release.set()
        text = prompt + generated.json()["text"]
        deadline = time.monotonic() + 30
        while (stats := a.get(f"/v1/sessions/{sid}").json()["stats"])["bytes_observed"] < len(TEXT) + len(early) \
                + len(text.encode()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["bytes_observed"] == len(TEXT) + len(early) + len(text.encode())  # nothing lost
        reference = create(b, initial_text=TEXT)["id"]  # one server given the observes in the order applied
        observe(b, reference, early)
        observe(b, reference, text)
        assert {**probe(a, sid), "session_id": None} == {**probe(b, reference), "session_id": None}


def test_owners_are_kept_in_redis(tiny_checkpoint: Path, redis_url: str, serve_app: Any, assert_error: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url, api_keys="key-a,key-b")  # type: ignore[arg-type]
    with serve_app(settings) as one, serve_app(settings) as two, \
            httpx.Client(base_url=one.url, headers={"authorization": "Bearer key-a"}) as a, \
            httpx.Client(base_url=two.url, headers={"authorization": "Bearer key-b"}) as b, \
            httpx.Client(base_url=two.url, headers={"authorization": "Bearer key-a"}) as a_on_two:
        sid = create(a, initial_text=TEXT)["id"]
        blob = a.get(f"/v1/sessions/{sid}/state").content
        for r in (b.get(f"/v1/sessions/{sid}"), b.delete(f"/v1/sessions/{sid}"),
                  b.post(f"/v1/sessions/{sid}/observe", json={"text": "a"}),
                  b.post(f"/v1/sessions/{sid}/suggest", json={"context": "a"})):
            assert_error(r, 404, "not_found_error", "session_id")
        assert a_on_two.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT)
        # b's import onto a's id is b's own session there (test_session_idspace.py), on every server
        assert b.put(f"/v1/sessions/{sid}/state", content=blob).json()["id"] == sid
        with httpx.Client(base_url=one.url, headers={"authorization": "Bearer key-b"}) as b_on_one:
            assert b_on_one.post(f"/v1/sessions/{sid}/observe", json={"text": "a"}).status_code == 200
            assert b_on_one.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT) + 1
        assert b.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT) + 1
        assert a_on_two.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len(TEXT)


def test_ttl_expiry_and_lru_eviction_over_http(tiny_checkpoint: Path, redis_url: str, serve_app: Any,
                                               assert_error: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url, max_sessions=2)  # type: ignore[arg-type]
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        short = create(c, ttl_s=0.5)["id"]
        time.sleep(0.8)
        assert_error(c.get(f"/v1/sessions/{short}"), 404, "not_found_error", "session_id")
        deadline = time.monotonic() + 5  # the engine sweeps every second
        while metric(c, "adaptlm_session_evictions_total", reason="ttl") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(c, "adaptlm_session_evictions_total", reason="ttl") == 1
        a, b = create(c)["id"], create(c)["id"]
        assert c.get(f"/v1/sessions/{a}").status_code == 200  # a is now more recently used than b
        d = create(c)["id"]
        assert_error(c.get(f"/v1/sessions/{b}"), 404, "not_found_error", "session_id")
        assert c.get(f"/v1/sessions/{a}").status_code == 200 and c.get(f"/v1/sessions/{d}").status_code == 200
        assert metric(c, "adaptlm_session_evictions_total", reason="lru") == 1
        assert metric(c, "adaptlm_active_sessions") == 2
        size = len(c.get(f"/v1/sessions/{a}/state").content)
        assert metric(c, "adaptlm_session_store_bytes") == 2 * size


def test_shutdown_finishes_work_in_flight(tiny_checkpoint: Path, redis_url: str, serve_app: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, session_store=redis_url)  # type: ignore[arg-type]
    long = "busy " * 600  # 150 segments: the server stops after the first, while the others are still to come
    answers: list[httpx.Response] = []
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        sid = create(c)["id"]
        thread = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{live.url}/v1/sessions/{sid}/observe", json={"text": long}, timeout=120)))
        thread.start()
        engine, deadline = live.app.state.engine, time.monotonic() + 60
        while not engine.stats.batch_rows and time.monotonic() < deadline:  # the observe's first model call
            time.sleep(0.01)
        assert engine.stats.batch_rows and engine.stats.updates == 0  # running, not finished
    thread.join()  # the server stopped (lifespan end) while the observe ran: it was finished, then written
    assert answers and answers[0].status_code == 200, answers
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        stats = c.get(f"/v1/sessions/{sid}").json()["stats"]
        assert stats["bytes_observed"] == len(long) and stats["updates"] == math.ceil(len(long) / 20)


def test_a_redis_that_goes_away_answers_503(tiny_checkpoint: Path, serve_app: Any, start_redis: Any,
                                             assert_error: Any) -> None:
    with start_redis() as url:
        settings = Settings(checkpoint=tiny_checkpoint, session_store=url)  # type: ignore[arg-type]
        live_server = serve_app(settings)
        live = live_server.__enter__()
        c = httpx.Client(base_url=live.url, timeout=60)
        sid = create(c)["id"]
    try:  # redis-server has stopped
        for r in (c.get(f"/v1/sessions/{sid}"), c.post(f"/v1/sessions/{sid}/observe", json={"text": "a"}),
                  c.post(f"/v1/sessions/{sid}/suggest", json={"context": "a"}), c.post("/v1/sessions", json={})):
            error = assert_error(r, 503, "service_unavailable_error")
            assert error["code"] == "session_store_unavailable" and r.headers["retry-after"] == "1"
        assert c.post("/v1/score", json={"text": "static scoring still works"}).status_code == 200
        assert c.get("/metrics").status_code == 200
    finally:
        c.close()
        live_server.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="failed to start"), serve_app(settings):
        pass


def test_serve_with_an_unreachable_redis_says_so_in_one_line(tiny_checkpoint: Path) -> None:
    # `adaptlm serve` checks the Redis store before it starts: one line naming the address (never the password),
    # status 3 (a failed start-up), no traceback
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = os.environ | {"ADAPTLM_SESSION_STORE": f"redis://:hunter2@127.0.0.1:{port}/2"}
    r = subprocess.run([sys.executable, "-m", "adaptlm", "serve", "--checkpoint", str(tiny_checkpoint),
                        "--port", str(port)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adaptlm: error: the session store "), r.stderr
    assert f"redis://127.0.0.1:{port}/2 does not answer" in lines[0] and "hunter2" not in r.stderr


def owner_books(url: str) -> tuple[dict[str, int], dict[str, int]]:
    """The owner index as the scripts keep it (owner -> sessions, owner -> bytes), after checking that it names every
    indexed session once, under the owner its record holds, and forgets an owner with no session left (owners are
    API keys, and keys are retired: their entries would pile up in every insert's read of the owners)."""
    with redis.Redis.from_url(url, decode_responses=True) as r:
        ns = f"adaptlm:{{{HASH[:16]}}}"
        index = r.hgetall(f"{ns}:owner")
        sizes = {i: int(s) for i, s in r.hgetall(f"{ns}:size").items()}
        assert set(index) <= set(sizes)
        for i, owner in index.items():
            assert r.hget(f"{ns}:s:{i}", "owner") in (owner, None)  # None: expired, not swept yet
        counts = {o: r.zcard(f"{ns}:o:{o}") for o in set(index.values())}
        assert counts == {o: list(index.values()).count(o) for o in set(index.values())}
        obytes = {o: int(b) for o, b in r.hgetall(f"{ns}:obytes").items()}
        assert obytes == {o: sum(sizes[i] for i, w in index.items() if w == o) for o in set(index.values())}
        return counts, obytes


def forget_owner_index(url: str) -> None:
    """Make the stored records look as a server of the version before the owner index wrote them."""
    with redis.Redis.from_url(url) as r:
        ns = f"adaptlm:{{{HASH[:16]}}}"
        r.delete(f"{ns}:owner", f"{ns}:obytes", *r.keys(f"{ns}:o:*"))
        for key in r.keys(f"{ns}:s:*"):
            r.hdel(key, "revision")


def test_records_written_before_the_owner_index_still_make_room(redis_url: str) -> None:
    # after an upgrade the store is full of records no owner index counts: they make room as before (least
    # recently used first), and are not taken for sessions of an owner within its share (which nothing evicts)
    store = store_at(redis_url, max_sessions=3, owner_max_sessions=3, owner_max_bytes=10**9)
    for name in "abc":
        store.insert(make(name, owner="alice"))
    forget_owner_index(redis_url)
    store.insert(make("d", owner="alice"))
    assert [store.contains(n) for n in "abcd"] == [False, True, True, True]
    store.insert(make("e", owner="bob"))  # bob's first: alice's oldest (of the old version) makes room
    assert [store.contains(n) for n in "bcde"] == [False, True, True, True]
    assert owner_books(redis_url) == ({"alice": 1, "bob": 1}, {"alice": SIZE, "bob": SIZE})
    store.insert(make("c", owner="alice"))  # an old record replaced: it is counted now, once
    assert owner_books(redis_url) == ({"alice": 2, "bob": 1}, {"alice": 2 * SIZE, "bob": SIZE})
    assert store.stats().sessions == 3 and store.stats().evictions["lru"] == 2


def test_among_records_written_before_the_owner_index_an_expired_one_is_counted_once(redis_url: str) -> None:
    # the old records' walk comes after the expired sessions were taken out of the books: it steps over them
    store = store_at(redis_url, max_bytes=3 * SIZE)
    store.insert(make("x", ttl=0.3))  # the least recently used, and the walk's first
    store.insert(make("a"))
    store.insert(make("b"))
    forget_owner_index(redis_url)
    time.sleep(0.6)
    big = make("big", k=16)
    assert SIZE < len(export_session(big, HASH, SESSIONS)) <= 2 * SIZE
    store.insert(big)  # x's room, and a's
    assert [store.contains(n) for n in ("x", "a", "b", "big")] == [False, False, True, True]
    stats = store.stats()
    assert dict(stats.evictions) == {"ttl": 1, "lru": 1} and stats.bytes <= 3 * SIZE


def test_the_owner_index_keeps_the_books_on_every_path(redis_url: str) -> None:
    store = store_at(redis_url, max_sessions=4, owner_max_sessions=2, owner_max_bytes=10**9)
    for name in "ab":
        store.insert(make(name, owner="alice"))
    store.insert(make("c", owner="bob"))
    assert owner_books(redis_url) == ({"alice": 2, "bob": 1}, {"alice": 2 * SIZE, "bob": SIZE})
    a = store.get("a", "alice")
    assert a is not None and store.update(dataclasses.replace(a, last_token=3)) is not None  # an update
    store.insert(make("b", owner="bob", k=8))  # replaced under another owner (an import once alice's expired)
    big = len(export_session(make("b", owner="bob", k=8), HASH, SESSIONS))
    assert owner_books(redis_url) == ({"alice": 1, "bob": 2}, {"alice": SIZE, "bob": SIZE + big})
    assert store.delete("c", "bob")  # a delete
    assert owner_books(redis_url) == ({"alice": 1, "bob": 1}, {"alice": SIZE, "bob": big})
    store.insert(make("x", owner="bob", ttl=0.2))
    time.sleep(0.4)
    assert store.sweep() == 1  # an expiry
    assert owner_books(redis_url) == ({"alice": 1, "bob": 1}, {"alice": SIZE, "bob": big})
    for name in "defg":  # evictions: bob over his share gives up his own, alice keeps hers
        store.insert(make(name, owner="bob"))
    assert store.contains("a") and store.stats().sessions == 4
    assert owner_books(redis_url) == ({"alice": 1, "bob": 3}, {"alice": SIZE, "bob": 3 * SIZE})


def test_an_owner_with_no_session_left_is_forgotten(redis_url: str) -> None:
    # deleted, evicted, or its only session written again under another owner: no entry is left for it
    store = store_at(redis_url, max_sessions=2, owner_max_sessions=1, owner_max_bytes=10**9)
    store.insert(make("a", owner="alice"))
    store.insert(make("b", owner="bob"))
    assert store.delete("a", "alice")
    assert owner_books(redis_url) == ({"bob": 1}, {"bob": SIZE})
    store.insert(make("c", owner="bob"))
    store.insert(make("d", owner="carol"))  # bob is over his share: his oldest makes room
    assert owner_books(redis_url) == ({"bob": 1, "carol": 1}, {"bob": SIZE, "carol": SIZE})
    store.insert(make("c", owner="carol"))  # bob's last session written again under carol
    assert owner_books(redis_url) == ({"carol": 2}, {"carol": 2 * SIZE})
