"""A write to Redis sends only the parts of a session that changed since the revision it read (server/engine/
_redis_form.py): the stored record is still exactly the session's export, whoever wrote which part; the revision's
compare-and-set, the idempotency keys and the byte accounting keep their guarantees; a server whose copy is stale
reads the whole newer record; a record of the form before the parts (one `blob` field) still reads. The stand-in
sessions are small, so the chunk is made small here (CHUNK: a few chunks a tensor, as the adapter's 65)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from safetensors.torch import load
from safetensors.torch import save as save_tensors
from starlette.testclient import TestClient

from models.base import State
from server.app import create_app
from server.engine import (
    RedisSessionStore,
    Session,
    SessionConflict,
    SessionImportError,
    SessionStats,
    _redis_form,
    export_session,
)
from server.engine._redis_form import Stored, join, split
from server.engine._session import Applied, applied_of, keyed
from server.settings import Settings
from tests.server._stores import SESSIONS, stale_reads_are_refused
from tests.server.test_redis_store import HASH, make, same, store_at, stored_export

CHUNK = 64  # bytes a chunk in these tests: the stand-in adapter (16 x 16 floats) is 16 chunks


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_redis_form, "CHUNK", CHUNK)


@pytest.fixture
def stores(redis_url: str) -> Iterator[list[RedisSessionStore]]:
    made = [store_at(redis_url) for _ in range(3)]
    yield made
    for store in made:
        store.close()


def written_bytes(url: str) -> Callable[[Callable[[], Any]], int]:
    """`measure(call)`: the bytes Redis's clients sent it while `call` ran, less what the INFO calls take."""
    client = redis.Redis.from_url(url)

    def between(call: Callable[[], Any]) -> int:
        before = int(client.info("stats")["total_net_input_bytes"])
        call()
        return int(client.info("stats")["total_net_input_bytes"]) - before

    idle = min(between(lambda: None) for _ in range(3))
    return lambda call: between(call) - idle


def big(session_id: str, owner: str | None = None, seed: int = 0) -> Session:
    return make(session_id, owner, k=16, seed=seed)


def with_row(session: Session, row: int, value: float) -> Session:
    """The session with one row of its adapter changed (one chunk of 64 bytes)."""
    m = session.memories["adapter"].tensors["h"].clone()
    m[0, row] = value
    return dataclasses.replace(session, memories={**session.memories, "adapter": State({"h": m})})


def record(url: str, session_id: str) -> dict[bytes, bytes]:
    with redis.Redis.from_url(url) as r:
        keys = r.keys(f"adaptlm:*:s:{session_id}")
        assert len(keys) == 1
        return r.hgetall(keys[0])


def parsed(blob: bytes) -> tuple[Any, bytes]:
    """An export's header (JSON: safetensors writes its metadata in no fixed order) and its tensors' bytes."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def assert_stored_is(url: str, session: Session) -> None:
    """The record in Redis is `session`'s export, and holds no part that is not one of it."""
    fields = record(url, session.id)
    expected = export_session(session, HASH, SESSIONS)
    assert parsed(stored_export(fields)) == parsed(expected)
    state = {k for k in fields if k in (b"blob", b"hdr", b"lay") or k.startswith(b"c:")}
    assert state == set(split(expected).fields)


# -- the stored form --------------------------------------------------------------------------------------------


def window_blob(window: torch.Tensor) -> bytes:
    return save_tensors({"copy.hist": window, "w": torch.arange(40, dtype=torch.float32)},
                        metadata={"format": "adaptlm-session"})


def test_a_byte_window_that_slides_rewrites_only_the_slots_of_the_new_bytes() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randint(0, 256, (1, 32 * CHUNK), generator=g, dtype=torch.uint8)
    base = Stored.of(split(window_blob(old)))
    for step in range(3):  # slid three times: the rotation follows it
        new = torch.cat([old[:, 100:], torch.randint(0, 256, (1, 100), generator=g, dtype=torch.uint8)], 1)
        form = split(window_blob(new), base, slid=100)
        changed = [k for k, v in form.digests.items() if base.digests.get(k) != v and k.startswith(b"c:copy")]
        assert len(changed) <= 3, (step, changed)  # 100 new bytes span at most 3 chunks of 64
        blob, read = join(form.fields)
        assert blob == window_blob(new) and read is not None and read.rolls == form.rolls
        assert torch.equal(load(blob)["copy.hist"], new)
        base, old = Stored.of(form), new
    # a wrong hint costs chunks, never bytes: the digests decide what is sent
    new = torch.cat([old[:, 7:], torch.zeros(1, 7, dtype=torch.uint8)], 1)
    form = split(window_blob(new), base, slid=3)
    assert join(form.fields)[0] == window_blob(new)
    assert sum(base.digests.get(k) != v for k, v in form.digests.items()) > 16


def test_parts_that_do_not_make_an_export_are_refused() -> None:
    fields = split(window_blob(torch.zeros(1, 4 * CHUNK, dtype=torch.uint8))).fields
    assert join(fields)[0] == window_blob(torch.zeros(1, 4 * CHUNK, dtype=torch.uint8))
    for broken, message in (({k: v for k, v in fields.items() if k != b"c:copy.hist:2"}, "lacks a part"),
                            ({**fields, b"c:w:0": fields[b"c:w:0"][:-4]}, "has 156 bytes"),
                            ({**fields, b"lay": b'{"v": 2, "chunk": 64, "roll": {}}'}, "version 2"),
                            ({**fields, b"lay": b"[1"}, "layout is corrupt"),
                            ({**fields, b"hdr": b"\x05\0\0\0\0\0\0\0[1, 2"}, "header is corrupt"),
                            ({k: v for k, v in fields.items() if k != b"hdr"}, "no state")):
        with pytest.raises(SessionImportError, match=message):
            join(broken)


# -- the store --------------------------------------------------------------------------------------------------


def test_an_update_sends_only_the_changed_parts(stores: list[RedisSessionStore], redis_url: str) -> None:
    one, _, reader = stores
    measure = written_bytes(redis_url)
    whole = store_at(redis_url, cache_sessions=0)  # keeps no copy: writes every part, as before the parts
    try:
        for store, name in ((one, "a"), (whole, "b")):
            store.insert(big(name))
        sizes = {}
        for store, name in [(one, "a"), (whole, "b")] * 2:  # (the first: Redis is sent the script, once)
            got = store.get(name, None)
            assert got is not None
            changed = dataclasses.replace(with_row(got, 3, got.last_token + 1), last_token=got.last_token + 1)
            sizes[name] = measure(lambda s=store, c=changed: s.update(c))
            assert_stored_is(redis_url, changed)
            read = reader.get(name, None)  # a server that never held it reads the whole record: the same session
            assert read is not None and same(read, changed)
        # the adapter's 16 chunks, of which one changed: at least 14 x 64 bytes not sent
        assert sizes["a"] <= sizes["b"] - 14 * CHUNK, sizes
    finally:
        whole.close()


def test_concurrent_writers_of_parts_still_conflict(stores: list[RedisSessionStore], redis_url: str) -> None:
    one, two, reader = stores
    stale_reads_are_refused(one, two, big, lambda got: len(export_session(got, HASH, SESSIONS)))
    # both hold the same revision and write different parts: the first wins whole, the second changes nothing
    first, second = one.get("a", None), two.get("a", None)
    assert first is not None and second is not None and first.revision == second.revision
    won = one.update(with_row(first, 1, 7.0))
    with pytest.raises(SessionConflict):
        two.update(with_row(second, 9, 8.0))
    assert won is not None
    assert_stored_is(redis_url, won)
    # the loser reads the winner's record (the whole of it: its copy is stale), and its next write is a change of it
    again = two.get("a", None)
    assert again is not None and again.revision == won.revision and same(again, won)
    latest = two.update(with_row(again, 9, 8.0))
    assert latest is not None
    assert_stored_is(redis_url, latest)
    read = reader.get("a", None)
    assert read is not None and same(read, latest)
    assert float(read.memories["adapter"].tensors["h"][0, 1, 0]) == 7.0  # both changes, in order


def test_a_stale_copy_reads_the_whole_newer_record(stores: list[RedisSessionStore], redis_url: str) -> None:
    one, two, _ = stores
    one.insert(big("a"))
    held = two.get("a", None)  # two holds this revision
    got = one.get("a", None)
    assert held is not None and got is not None
    written = one.update(with_row(got, 0, 2.0))  # a change of one chunk, written by one
    assert written is not None
    sent = redis.Redis.from_url(redis_url)
    before = int(sent.info("stats")["total_net_output_bytes"])
    newer = two.get("a", None)
    read = int(sent.info("stats")["total_net_output_bytes"]) - before
    size = len(export_session(written, HASH, SESSIONS))
    assert newer is not None and newer.revision == written.revision and same(newer, written)
    assert read > size  # the whole record (with its fields' names), not the changed chunk
    assert not same(newer, held)
    sent.close()


def test_an_idempotent_replay_after_a_write_of_parts(stores: list[RedisSessionStore], redis_url: str) -> None:
    one, two, _ = stores
    one.insert(big("a"))
    got = one.get("a", None)
    assert got is not None
    entry = Applied("k1", "d" * 32, {"bits": 1.0})
    written = one.update(keyed(with_row(got, 2, 3.0), applied=applied_of(got), observing=entry))
    assert written is not None and applied_of(written) == (entry,)
    assert_stored_is(redis_url, written)
    # the reply was lost, the client retries on the other server: it reads the key with the state...
    retry = two.get("a", None)
    assert retry is not None and applied_of(retry) == (entry,) and same(retry, written)
    # ...and a write under that key over the current revision is refused (the script's check), changing nothing
    with pytest.raises(SessionConflict):
        two.update(keyed(with_row(retry, 2, 4.0), applied=(), observing=entry))
    assert_stored_is(redis_url, written)
    assert applied_of(one.get("a", None)) == (entry,)


def test_an_import_or_a_reset_replaces_every_part(stores: list[RedisSessionStore], redis_url: str) -> None:
    one, _, reader = stores
    one.insert(big("a", "alice"))
    got = one.get("a", "alice")
    assert got is not None
    # a record of fewer parts (an adapter of 4 x 4: one chunk), written as a change: the others are deleted
    small = one.update(dataclasses.replace(make("a", "alice", k=4, seed=5), revision=got.revision))
    assert small is not None
    assert_stored_is(redis_url, small)
    # an import over it (an insert: every part), then a reset (a fresh adapter: an update of every chunk)
    imported = one.insert(big("a", "alice", seed=7))
    assert_stored_is(redis_url, imported)
    fresh = dataclasses.replace(imported, memories={**imported.memories,
                                                    "adapter": State({"h": torch.zeros(1, 16, 16)})},
                                stats=SessionStats())
    reset = one.update(fresh)
    assert reset is not None
    assert_stored_is(redis_url, reset)
    read = reader.get("a", "alice")
    assert read is not None and same(read, reset)


def test_the_byte_accounting_stays_exact(redis_url: str) -> None:
    store = store_at(redis_url, owner_max_sessions=10, owner_max_bytes=10**9)
    g = torch.Generator().manual_seed(0)
    try:
        kept: dict[str, Session] = {}
        for i in range(6):
            kept[str(i)] = store.insert(make(str(i), "alice" if i % 2 else "bob", k=(4, 8, 16)[i % 3], seed=i))
        for step in range(12):  # changes of one chunk, of sizes (k), of the header (the counters' digits)
            sid = str(int(torch.randint(0, 6, (1,), generator=g)))
            got = store.get(sid, kept[sid].owner)
            assert got is not None
            k = int(torch.randint(0, 3, (1,), generator=g))
            change = (with_row(got, 0, float(step)) if k == 0 else
                      dataclasses.replace(make(sid, got.owner, k=(4, 8, 16)[step % 3], seed=step),
                                          revision=got.revision) if k == 1 else
                      dataclasses.replace(got, stats=SessionStats(bytes_observed=10**step)))
            written = store.update(change)
            assert written is not None
            kept[sid] = written
        store.delete("0", "bob")
        del kept["0"]
        sizes = {sid: len(export_session(s, HASH, SESSIONS)) for sid, s in kept.items()}
        assert store.stats().bytes == sum(sizes.values())
        with redis.Redis.from_url(redis_url) as r:
            ns = r.keys("adaptlm:*:lru")[0].decode().removesuffix(":lru")
            assert {k.decode(): int(v) for k, v in r.hgetall(f"{ns}:size").items()} == sizes
            for owner in ("alice", "bob"):
                assert int(r.hget(f"{ns}:obytes", owner) or 0) == sum(
                    sizes[sid] for sid, s in kept.items() if s.owner == owner)
        for session in kept.values():
            assert_stored_is(redis_url, session)
    finally:
        store.close()


def test_a_record_of_one_blob_reads_and_is_written_in_parts(stores: list[RedisSessionStore], redis_url: str) -> None:
    one, two, _ = stores
    original = one.insert(big("a"))
    with redis.Redis.from_url(redis_url) as r:  # as a server before the parts wrote it
        key = r.keys("adaptlm:*:s:a")[0]
        r.hdel(key, *[k for k in r.hkeys(key) if k in (b"hdr", b"lay") or k.startswith(b"c:")])
        r.hset(key, "blob", export_session(original, HASH, SESSIONS))
    got = two.get("a", None)
    assert got is not None and same(got, original)
    written = two.update(with_row(got, 4, 1.5))  # no parts known: all of them, and the blob goes
    assert written is not None
    assert_stored_is(redis_url, written)
    assert b"blob" not in record(redis_url, "a")
    assert two.stats().bytes == len(export_session(written, HASH, SESSIONS))


# -- a server: the copy model's window ----------------------------------------------------------------------------


def test_an_observe_rewrites_the_history_s_new_bytes_only(copy_checkpoint: Path, redis_url: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A session with a copy model (its byte windows, 2 x 2,048 bytes, in chunks of 256 here) observed through Redis:
    each observe after the first rewrites the adapter, the states and the header, not the windows' kept bytes (the
    history slides by the bytes observed: stored rotated, only the chunks of the new bytes change); the session is
    the memory store's, exactly."""
    monkeypatch.setattr(_redis_form, "CHUNK", 256)
    sent: list[list[str]] = []  # per update: the windows' chunks it sent
    run = RedisSessionStore._run

    def spy(self: RedisSessionStore, script: str, *args: Any) -> Any:
        if script == "update":
            sent.append(sorted(a.decode() for a in args if isinstance(a, bytes) and a.startswith(b"c:copy.")))
        return run(self, script, *args)

    monkeypatch.setattr(RedisSessionStore, "_run", spy)
    # the first fills the history's first 1,300 bytes (6 chunks), which each later observe slides
    texts = [" ".join(f"It is truth number {i}, universally acknowledged." for i in range(27)),
             " That a single man in possession of a good fortune,", " must be in want of a wife."]
    states = {}
    for store in ("memory", redis_url):
        settings = Settings(checkpoint=copy_checkpoint, session_store=store)  # type: ignore[arg-type]
        with TestClient(create_app(settings)) as client:
            sid = client.post("/v1/sessions", json={}).json()["id"]
            for text in texts:
                assert client.post(f"/v1/sessions/{sid}/observe", json={"text": text}).status_code == 200
            states[store] = load(client.get(f"/v1/sessions/{sid}/state").content)
    assert len(sent) == len(texts)
    for chunks in sent[1:]:  # the history's new bytes (50 at most) are in at most 2 chunks: the rest stayed
        assert 1 <= len([c for c in chunks if c.startswith("c:copy.hist:")]) <= 2, sent
    assert states["memory"].keys() == states[redis_url].keys()
    assert all(torch.equal(states["memory"][k], states[redis_url][k]) for k in states["memory"])
