"""The in-process session store (LRU, TTL, memory budget, pins, owners) and the session export format."""

from __future__ import annotations

import dataclasses
import json
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from server.engine import (
    MemorySessionStore,
    Session,
    SessionImportError,
    SessionStats,
    SessionStoreFull,
    export_session,
    import_session,
)
from tests.server._stores import (
    SESSIONS,
    evictions_follow_the_lru_walk,
    expired_sessions_make_room_first,
    several_victims_until_within_share,
    stale_reads_are_refused,
    stand_in_session,
    stand_in_sessions,
    the_oldest_sessions_protected,
)

HASH = "a" * 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(session_id: str, owner: str | None = None, *, k: int = 4, ttl: float = 60.0, seed: int = 0) -> Session:
    return stand_in_session(session_id, owner, k=k, ttl=ttl, seed=seed, created=1000.0, last_used=1000.0)


SIZE = make("x").nbytes  # 2 states of 2 x 8 floats, a 4 x 4 adapter


def test_sizes_and_stats() -> None:
    assert SIZE == (4 * 8 + 16) * 4
    s = make("x")
    assert s.stats.bits_per_byte == 2.5 and s.stats.static_bits_per_byte == 2.75
    assert s.stats.gain_over_static == pytest.approx(1 - 100 / 110)
    assert SessionStats().bits_per_byte is None and SessionStats().gain_over_static is None


def test_lru_eviction_by_count_keeps_the_recently_used() -> None:
    store = MemorySessionStore(max_sessions=2, max_bytes=10**9, clock=Clock())
    store.insert(make("a"))
    store.insert(make("b"))
    assert store.get("a", None) is not None  # a is now the most recently used
    store.insert(make("c"))
    assert store.get("b", None) is None
    assert store.get("a", None) is not None and store.get("c", None) is not None
    stats = store.stats()
    assert (stats.sessions, stats.bytes, stats.evictions["lru"], stats.evictions["ttl"]) == (2, 2 * SIZE, 1, 0)


def test_memory_budget_evicts_by_bytes() -> None:
    store = MemorySessionStore(max_sessions=100, max_bytes=2 * SIZE + 10, clock=Clock())
    for name in "abc":
        store.insert(make(name))
    assert [store.contains(n) for n in "abc"] == [False, True, True]
    assert store.stats().bytes == 2 * SIZE
    with pytest.raises(SessionStoreFull):  # larger than the whole budget: refused, nothing evicted
        store.insert(make("big", k=64))
    assert store.stats().sessions == 2 and store.stats().evictions["lru"] == 1


def test_pinned_sessions_are_never_evicted() -> None:
    store = MemorySessionStore(max_sessions=2, max_bytes=10**9, clock=Clock())
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
@pytest.mark.parametrize("seed", range(3))
def test_evictions_follow_the_lru_walk(share: bool, seed: int) -> None:
    evictions_follow_the_lru_walk(lambda **limits: MemorySessionStore(**limits, clock=Clock()), make,
                                  lambda s: s.nbytes, share=share, seed=seed)


def test_the_oldest_sessions_protected_by_a_share_are_passed_over() -> None:
    the_oldest_sessions_protected(lambda **limits: MemorySessionStore(**limits, clock=Clock()), make)


def test_several_victims_are_taken_until_their_owners_are_within_their_share() -> None:
    several_victims_until_within_share(lambda **limits: MemorySessionStore(**limits, clock=Clock()), make,
                                       lambda s: s.nbytes)


def test_expired_sessions_make_room_before_live_ones_are_evicted() -> None:
    clock = Clock()

    def pass_time(seconds: float) -> None:
        clock.now += seconds

    expired_sessions_make_room_first(lambda **limits: MemorySessionStore(**limits, clock=clock), make, pass_time)


def test_touches_do_not_grow_the_expiry_heap() -> None:
    """Each touch leaves a stale entry in the heap by expiry: it is rebuilt before they pile up, and a stale entry
    (the expiry a touch since moved on) expires nothing."""
    clock = Clock()
    store = MemorySessionStore(max_sessions=10, max_bytes=10**9, clock=clock)
    store.insert(make("a", ttl=10))
    store.insert(make("b", ttl=10))
    for _ in range(1000):
        clock.now += 0.01
        assert store.get("a", None) is not None
    assert len(store._expiry) <= 2 * 2 + 64
    clock.now += 5  # b's expiry (1010) has passed, a's (1020) has not
    assert store.sweep() == 1 and store.contains("a") and not store.contains("b")


def test_ttl_expiry_is_counted_and_extended_by_use() -> None:
    clock = Clock()
    store = MemorySessionStore(max_sessions=10, max_bytes=10**9, clock=clock)
    store.insert(make("a", ttl=10))
    store.insert(make("b", ttl=10))
    clock.now += 8
    assert store.get("a", None) is not None  # touched: a lives until 1018
    clock.now += 5
    assert store.get("b", None) is None
    assert store.get("a", None) is not None
    assert store.stats().evictions["ttl"] == 1
    clock.now += 11
    store.pin("a")
    assert store.sweep() == 0 and store.get("a", None, touch=False) is not None  # in use: not expired
    store.unpin("a")
    assert store.sweep() == 1 and store.stats().sessions == 0 and store.stats().evictions["ttl"] == 2


def test_owners_see_only_their_sessions() -> None:
    store = MemorySessionStore(max_sessions=10, max_bytes=10**9, clock=Clock())
    store.insert(make("a", owner="alice"))
    assert store.get("a", "bob") is None and store.get("a", None) is None
    assert not store.delete("a", "bob")
    assert store.contains("a") and store.get("a", "alice") is not None
    assert store.delete("a", "alice") and not store.contains("a")


def test_update_only_replaces_a_present_session() -> None:
    store = MemorySessionStore(max_sessions=10, max_bytes=10**9, clock=Clock())
    inserted = store.insert(make("a"))
    newer = dataclasses.replace(make("a", seed=1), last_token=33, revision=inserted.revision)
    assert store.update(newer)
    got = store.get("a", None)
    assert got is not None and got.last_token == 33
    store.delete("a", None)
    assert store.update(dataclasses.replace(newer, revision=got.revision)) is None and not store.contains("a")


def test_an_update_from_a_stale_read_is_refused() -> None:
    store = MemorySessionStore(max_sessions=10, max_bytes=10**9, clock=Clock())
    old = stale_reads_are_refused(store, store, make, lambda _: SIZE)
    # the revision is the store's bookkeeping, not part of an export
    meta = _meta(export_session(old, HASH, SESSIONS))
    assert meta == _meta(export_session(dataclasses.replace(old, revision=None), HASH, SESSIONS))
    assert "revision" not in meta["session"] and old.revision not in meta["session"]
    assert import_session(export_session(old, HASH, SESSIONS), model_hash=HASH, template=make("b"),
                          sessions=SESSIONS)[0].revision is None


def test_concurrent_use_keeps_the_books() -> None:
    store = MemorySessionStore(max_sessions=50, max_bytes=10**9)

    def work(t: int) -> None:
        for i in range(200):
            name = f"s{(t * 7 + i) % 80}"
            store.insert(make(name))
            store.get(name, None)
            if i % 3 == 0:
                store.delete(f"s{(t + i) % 80}", None)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = store.stats()
    assert stats.sessions <= 50 and stats.bytes == stats.sessions * SIZE


# -- export and import -----------------------------------------------------------------------------------


def test_export_import_round_trip() -> None:
    original = make("a", owner="alice", seed=3)
    blob = export_session(original, HASH, SESSIONS)
    template = dataclasses.replace(make("b", owner="bob", seed=9), stats=SessionStats())
    session, config = import_session(blob, model_hash=HASH, template=template, sessions=SESSIONS)
    assert (session.id, session.owner, session.created) == ("b", "bob", template.created)
    assert config == original.config == session.config
    assert session.stats == original.stats and session.last_token == original.last_token
    for a, b in ((session.state, original.state), (session.static_state, original.static_state)):
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)
    assert torch.equal(session.adapter.mats["h"], original.adapter.mats["h"])
    again = export_session(session, HASH, SESSIONS)  # the blob carries no id or owner: the same content
    assert _meta(again) == _meta(blob)
    assert all(torch.equal(t, load(blob)[k]) for k, t in load(again).items())


def _meta(blob: bytes) -> dict[str, str]:
    meta: dict[str, str] = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    return meta


def test_a_version_1_export_of_the_next_byte_imports_as_the_next_token() -> None:
    """The format written before the record's `last_byte` became `last_token` (version 1, with flat settings),
    built here by hand (not by `export_session`), still imports; exports (version 2) name the next token
    `last_token`."""
    from safetensors.torch import save

    original = make("a", seed=4)
    tensors = {"state.h": original.state.tensors["h"], "state.c": original.state.tensors["c"],
               "static.h": original.static_state.tensors["h"], "static.c": original.static_state.tensors["c"],
               "adapter.h": original.adapter.mats["h"]}
    meta = {"ttl_s": 60.0, "created": 1000.0, "last_byte": 33,
            "config": {"lr": 1e-3, "decay": 2e-3, "adapter_size": 4},  # before the word cache: no cache_weight
            "stats": {"bytes_observed": 40, "updates": 2, "nonfinite_resets": 0, "bits": 100.0, "static_bits": 110.0}}
    blob = save(tensors, metadata={"format": "adaptlm-session", "version": "1", "model_hash": HASH,
                                   "session": json.dumps(meta)})
    session, config = import_session(blob, model_hash=HASH, template=make("b"), sessions=SESSIONS)
    assert session.last_token == 33 and config == original.config and session.stats == original.stats
    assert torch.equal(session.adapter.mats["h"], original.adapter.mats["h"])
    again = _meta(export_session(session, HASH, SESSIONS))
    assert again["version"] == "2" and json.loads(again["session"])["last_token"] == 33
    assert "last_byte" not in json.loads(again["session"])


def test_import_from_other_weights_is_a_conflict() -> None:
    blob = export_session(make("a"), HASH, SESSIONS)
    with pytest.raises(SessionImportError, match="other weights") as info:
        import_session(blob, model_hash="b" * 64, template=make("b"), sessions=SESSIONS)
    assert info.value.conflict


def _with_meta(blob: bytes, **changes: str) -> bytes:
    """The blob with its safetensors header metadata changed (same tensors)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"].update(changes)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + blob[8 + n :]


@pytest.mark.parametrize("mangle", ["empty", "garbage", "plain-safetensors", "version", "truncated", "session-json",
                                    "bad-byte", "shape"])
def test_invalid_exports_are_refused(mangle: str) -> None:
    from safetensors.torch import save

    good = export_session(make("a"), HASH, SESSIONS)
    meta = json.loads(_meta(good)["session"])
    blob = {
        "empty": b"",
        "garbage": b"\x00" * 64,
        "plain-safetensors": save({"x": torch.zeros(2)}),
        "version": _with_meta(good, version="99"),
        "truncated": good[:-10],
        "session-json": _with_meta(good, session="{not json"),
        "bad-byte": _with_meta(good, session=json.dumps({**meta, "last_token": 300})),
        "shape": export_session(make("a", k=5), HASH, SESSIONS),
    }[mangle]
    # "shape": an export of a model whose states are of 8 units, into one whose are of 9
    sessions = SESSIONS if mangle != "shape" else stand_in_sessions(dim=9)
    with pytest.raises(SessionImportError) as info:
        import_session(blob, model_hash=HASH, template=make("b"), sessions=sessions)
    assert not info.value.conflict


# -- the memory store's snapshot -------------------------------------------------------------------------------


def same_session(a: Session, b: Session) -> bool:
    return (a.id, a.owner, a.created, a.last_used, a.ttl_s, a.config, a.stats, a.last_token) == \
        (b.id, b.owner, b.created, b.last_used, b.ttl_s, b.config, b.stats, b.last_token) and \
        all(torch.equal(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors) and \
        all(torch.equal(a.static_state.tensors[k], b.static_state.tensors[k]) for k in a.static_state.tensors) and \
        all(torch.equal(a.adapter.mats[k], b.adapter.mats[k]) for k in a.adapter.mats)


def test_a_snapshot_brings_the_sessions_back(tmp_path: Path) -> None:
    clock, path = Clock(), tmp_path / "state" / "sessions.zip"
    one = MemorySessionStore(max_sessions=10, max_bytes=1 << 20, clock=clock, snapshot=path)
    one.bind(HASH, make("template"), SESSIONS)
    sessions = [make("a", "key-1", seed=1), make("b", None, k=2, seed=2), make("c", "key-2", seed=3, ttl=5.0)]
    for s in sessions:
        one.insert(s)
    one.get("a", "key-1")  # now the most recently used
    one.close()
    assert path.exists() and not list(path.parent.glob(".*tmp"))
    with zipfile.ZipFile(path) as z:  # a zip of safetensors exports and a JSON index: nothing to unpickle
        assert sorted(z.namelist()) == ["0.safetensors", "1.safetensors", "2.safetensors", "index.json"]
        index = json.loads(z.read("index.json"))
        assert [e["id"] for e in index["sessions"]] == ["b", "c", "a"]  # least recently used first
    clock.now += 10  # "c" (ttl 5 s) expires while the server is down
    two = MemorySessionStore(max_sessions=10, max_bytes=1 << 20, clock=clock, snapshot=path)
    two.bind(HASH, make("template"), SESSIONS)
    assert two.stats().sessions == 2 and two.get("c", "key-2") is None
    assert same_session(two.get("b", None, touch=False), sessions[1])  # type: ignore[arg-type]
    restored = two.get("a", "key-1", touch=False)
    assert restored is not None and restored.last_used == 1000.0 and same_session(
        restored, dataclasses.replace(sessions[0], last_used=1000.0))
    assert two.get("a", "key-2") is None  # owners come back too
    # the LRU order came back: one more session over the limit evicts "b", the least recently used
    small = MemorySessionStore(max_sessions=2, max_bytes=1 << 20, clock=clock, snapshot=path)
    small.bind(HASH, make("template"), SESSIONS)
    small.insert(make("d"))
    assert small.get("b", None) is None and small.get("a", "key-1") is not None


def test_a_snapshot_of_other_weights_or_a_broken_one_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "sessions.zip"
    one = MemorySessionStore(max_sessions=10, max_bytes=1 << 20, snapshot=path)
    one.bind(HASH, make("template"), SESSIONS)
    one.insert(make("a"))
    one.close()
    other = MemorySessionStore(max_sessions=10, max_bytes=1 << 20, snapshot=path)
    other.bind("b" * 64, make("template"), SESSIONS)  # other weights: nothing restored, the server still starts
    assert other.stats().sessions == 0
    path.write_bytes(b"not a zip at all")
    broken = MemorySessionStore(max_sessions=10, max_bytes=1 << 20, snapshot=path)
    broken.bind(HASH, make("template"), SESSIONS)
    assert broken.stats().sessions == 0
    without = MemorySessionStore(max_sessions=10, max_bytes=1 << 20)  # no path: nothing written
    without.bind(HASH, make("template"), SESSIONS)
    without.insert(make("a"))
    without.close()


def test_session_ids_never_start_with_a_dash() -> None:
    """A command line reads a leading "-" as an option; 1 id in 64 of token_urlsafe starts with one."""
    from server.engine._session import new_session_id

    ids = [new_session_id() for _ in range(4000)]
    assert len(set(ids)) == len(ids) and all(len(i) == 32 and not i.startswith("-") for i in ids)


def test_a_header_nested_past_the_recursion_limit_is_a_bad_export() -> None:
    """Within the header size limit JSON can nest 200,000 deep: json.loads raises RecursionError, which must be
    an import error (422), not a 500."""
    from server.engine._errors import SessionImportError
    from server.engine._export import import_session

    header = b"[" * 200_000 + b"]" * 200_000
    blob = len(header).to_bytes(8, "little") + header
    with pytest.raises(SessionImportError, match="bad header"):
        import_session(blob, model_hash="0" * 64, template=None, sessions=None)  # type: ignore[arg-type]
