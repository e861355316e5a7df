"""Checks shared by the tests of both session stores (test_session_store.py, test_redis_store.py)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, OrderedDict
from collections.abc import Callable

import pytest
import torch

from models.adaptation import AdapterMemory, AdapterSettings, DynEvalConfig
from models.base import LanguageModel, Site, State
from models.session import SessionModel
from models.tokenizer import ByteTokenizer
from models.wordcache import WordCache, WordsMemory, WordsSettings
from server.engine import Session, SessionConfig, SessionConflict, SessionStats, SessionStore, SessionStoreFull


class StandInNetwork(LanguageModel):
    """What the store tests' sessions are of: a state of h and c (1, dim), one adaptation site "h"; never run."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dim = dim
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the device and dtype of the sessions' tensors

    def init_state(self, batch: int) -> State:
        return State({"h": torch.zeros(batch, self.dim), "c": torch.zeros(batch, self.dim)})

    def adaptation_sites(self) -> list[Site]:
        return [Site("h", self.dim)]


def stand_in_sessions(dim: int = 8) -> SessionModel:
    """The sessions' model of `StandInNetwork`: the adapter (k up to 16) and the word cache, as a server has."""
    net = StandInNetwork(dim)
    adapter = AdapterMemory(net, None, DynEvalConfig(mode="sparse", rule="sgd_decay", lr=1e-3, decay=2e-3), 4, 16)
    return SessionModel(net, ByteTokenizer(), {"adapter": adapter, "words": WordsMemory()})


SESSIONS = stand_in_sessions()


def stand_in_session(session_id: str, owner: str | None, *, k: int, ttl: float, seed: int, created: float,
                     last_used: float) -> Session:
    """A session of `SESSIONS` with random states and adapter (`seed`), k the adapter's size."""
    g = torch.Generator().manual_seed(seed)
    state = {"h": torch.randn(1, 8, generator=g), "c": torch.randn(1, 8, generator=g)}
    config = SessionConfig({"adapter": AdapterSettings(lr=1e-3, decay=2e-3, size=k), "words": WordsSettings()})
    return Session(id=session_id, owner=owner, created=created, last_used=last_used, ttl_s=ttl, config=config,
                   state=State(state), static_state=State({n: t + 1 for n, t in state.items()}), last_token=10,
                   memories={"adapter": State({"h": torch.randn(1, k, k, generator=g)}), "words": WordCache()},
                   stats=SessionStats(bytes_observed=40, updates=2, bits=100.0, static_bits=110.0))


def stale_reads_are_refused(one: SessionStore, two: SessionStore, make: Callable[[str], Session],
                            stored_bytes: Callable[[Session], int]) -> Session:
    """Two pieces of work (two replicas' observes: `one` and `two` see the same sessions) read the same record and
    both write: the first write wins, the second is refused and changes nothing, instead of silently undoing the
    first; a read of the new record may write; a session deleted and created again (or replaced by an import) takes
    no write from a read of the old one. -> that old record. `stored_bytes(session)`: what the store counts for it."""
    one.insert(make("a"))
    first, second = one.get("a", None), two.get("a", None)
    assert first is not None and second is not None and first.revision == second.revision  # a touch is no change
    written = one.update(dataclasses.replace(first, last_token=33, stats=SessionStats(bytes_observed=50)))
    assert written is not None and written.revision not in (None, first.revision)
    with pytest.raises(SessionConflict, match="changed by another request"):
        two.update(dataclasses.replace(second, last_token=44, stats=SessionStats(bytes_observed=60)))
    got = two.get("a", None)
    assert got is not None and (got.last_token, got.stats.bytes_observed, got.revision) == (33, 50, written.revision)
    assert two.stats().bytes == stored_bytes(got)  # the first write's
    assert two.update(dataclasses.replace(got, last_token=55)) is not None
    old = one.get("a", None)
    assert old is not None and two.delete("a", None)
    two.insert(make("a"))
    with pytest.raises(SessionConflict):
        one.update(old)
    return old


class LruWalk:
    """The eviction rule both stores keep, as the walk it was first written as: to make room for a session, walk
    every stored session from the least recently used, skipping the one it replaces, the pinned ones and those of an
    owner within its share (the new session counted for its owner, the replaced record not counted, each victim
    taken off its owner's count as it is chosen), and take the rest until the new one fits; if it still does not
    fit, refuse and change nothing. (No session expires here: expired ones go first, and are tested apart.)"""

    def __init__(self, max_sessions: int, max_bytes: int, owner_max_sessions: int, owner_max_bytes: int) -> None:
        self.limits = (max_sessions, max_bytes, owner_max_sessions, owner_max_bytes)
        self.order: OrderedDict[str, tuple[str | None, int]] = OrderedDict()  # id -> (owner, bytes), LRU first
        self.pins: Counter[str] = Counter()

    def insert(self, key: str, owner: str | None, size: int) -> bool:
        max_n, max_b, own_n, own_b = self.limits
        owned, owned_b = Counter[str | None](), Counter[str | None]()
        for o, b in self.order.values():
            owned[o] += 1
            owned_b[o] += b
        count, total = len(self.order) + 1, sum(owned_b.values()) + size
        if key in self.order:
            o, b = self.order[key]
            count, total, owned[o], owned_b[o] = count - 1, total - b, owned[o] - 1, owned_b[o] - b
        owned[owner] += 1
        owned_b[owner] += size
        victims = []
        for k, (o, b) in self.order.items():
            if count <= max_n and total <= max_b:
                break
            if k == key or self.pins[k] or (owned[o] <= own_n and owned_b[o] <= own_b):
                continue
            victims.append(k)
            count, total, owned[o], owned_b[o] = count - 1, total - b, owned[o] - 1, owned_b[o] - b
        if count > max_n or total > max_b:
            return False
        for k in victims:
            del self.order[k]
        self.order.pop(key, None)
        self.order[key] = (owner, size)
        return True


def evictions_follow_the_lru_walk(new_store: Callable[..., SessionStore], make: Callable[..., Session],
                                  stored_bytes: Callable[[Session], int], *, share: bool, seed: int,
                                  steps: int = 300) -> None:
    """Random inserts (two sizes), reads, pins, unpins and deletes by four owners (one of them None) on a small store,
    its count and bytes both binding; after each, the store holds the sessions `LruWalk` holds, and refuses where it
    refuses. `new_store(**limits)`: an empty store; `make(id, owner, k=...)`: a session (60 s TTL)."""
    unit = stored_bytes(make("x", None, k=4))
    limits = {"max_sessions": 10, "max_bytes": 9 * unit, "owner_max_sessions": 4 if share else 0,
              "owner_max_bytes": 4 * unit if share else 0}
    store, walk = new_store(**limits), LruWalk(**limits)
    rng = random.Random(seed)
    ids = [f"s{i:02d}" for i in range(24)]
    for step in range(steps):
        key, op = rng.choice(ids), rng.random()
        if op < 0.55:
            session = make(key, rng.choice(["alice", "bob", "carol", None]), k=rng.choice([4, 4, 10]))
            try:
                store.insert(session)
                stored = True
            except SessionStoreFull:
                stored = False
            assert stored == walk.insert(key, session.owner, stored_bytes(session)), step
        elif op < 0.75 and key in walk.order:
            assert store.get(key, walk.order[key][0]) is not None, step
            walk.order.move_to_end(key)
        elif op < 0.9:
            if walk.pins[key] and rng.random() < 0.6:
                store.unpin(key)
                walk.pins[key] -= 1
            else:
                store.pin(key)
                walk.pins[key] += 1
        elif key in walk.order:
            assert store.delete(key, walk.order.pop(key)[0]), step
        assert [k for k in ids if store.contains(k)] == sorted(walk.order), step
    stats = store.stats()
    assert (stats.sessions, stats.bytes) == (len(walk.order), sum(b for _, b in walk.order.values()))
    assert stats.evictions["ttl"] == 0


def the_oldest_sessions_protected(new_store: Callable[..., SessionStore], make: Callable[..., Session]) -> None:
    """Alice's sessions are the oldest and within her share: Bob's inserts over his share evict his own least
    recently used idle session, however many of hers come first; where every owner is within its share, an
    insert is refused and nothing is evicted."""
    store = new_store(max_sessions=8, max_bytes=10**9, owner_max_sessions=4, owner_max_bytes=10**9)
    for i in range(4):
        store.insert(make(f"a{i}", "alice"))
    for i in range(4):
        store.insert(make(f"b{i}", "bob"))
    store.pin("b0")
    store.insert(make("b4", "bob"))  # Bob at 5 of 4: his oldest idle one goes
    assert [store.contains(f"a{i}") for i in range(4)] == [True] * 4
    assert [store.contains(f"b{i}") for i in range(5)] == [True, False, True, True, True]
    assert store.get("b2", "bob") is not None  # now Bob's most recently used
    store.insert(make("b5", "bob"))
    assert [store.contains(f"b{i}") for i in range(6)] == [True, False, True, False, True, True]
    store.insert(make("a4", "alice"))  # Alice over hers: her own oldest goes
    assert [store.contains(f"a{i}") for i in range(5)] == [False, True, True, True, True]
    store.unpin("b0")
    with pytest.raises(SessionStoreFull):  # Carol's first: everyone within their share, nothing to evict
        store.insert(make("c0", "carol"))
    stats = store.stats()
    assert (stats.sessions, stats.evictions["lru"]) == (8, 3) and not store.contains("c0")


def several_victims_until_within_share(new_store: Callable[..., SessionStore], make: Callable[..., Session],
                                       stored_bytes: Callable[[Session], int]) -> None:
    """A large session that needs several victims takes them from the owners over their share, least recently used
    first, each owner until it is within its share."""
    small, big = stored_bytes(make("x")), stored_bytes(make("x", k=32))
    assert big > 3 * small
    store = new_store(max_sessions=100, max_bytes=5 * small + big, owner_max_sessions=2, owner_max_bytes=10**9)
    for name, owner in (("a0", "alice"), ("a1", "alice"), ("b0", "bob"), ("b1", "bob"), ("b2", "bob"),
                        ("c0", "carol"), ("c1", "carol"), ("c2", "carol")):
        store.insert(make(name, owner))
    store.insert(make("b3", "bob", k=32))  # three small ones must go: Bob's two oldest, then Carol's oldest
    assert [n for n in ("a0", "a1", "b0", "b1", "b2", "b3", "c0", "c1", "c2") if store.contains(n)] == [
        "a0", "a1", "b2", "b3", "c1", "c2"]


def expired_sessions_make_room_first(new_store: Callable[..., SessionStore], make: Callable[..., Session],
                                     pass_time: Callable[[float], None]) -> None:
    """In a full store, a session that expired (and no sweep has removed yet) makes room before any live one is
    evicted, however recently it was used; a pinned one does not expire."""
    store = new_store(max_sessions=4, max_bytes=10**9)
    store.insert(make("a"))
    store.insert(make("b"))
    store.insert(make("x", ttl=0.3))
    store.insert(make("y", ttl=0.3))
    store.pin("y")
    pass_time(0.6)  # x and y have expired, a and b (the least recently used) have not
    store.insert(make("c"))
    assert [store.contains(n) for n in "abcxy"] == [True, True, True, False, True]
    assert dict(store.stats().evictions) == {"ttl": 1, "lru": 0}
    store.insert(make("d"))  # nothing expired but the pinned y: the least recently used live one goes
    assert [store.contains(n) for n in "abcdy"] == [False, True, True, True, True]
    assert dict(store.stats().evictions) == {"ttl": 1, "lru": 1}
