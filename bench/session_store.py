"""Time of one insert into a full session store whose least recently used sessions may not be evicted.

To make room, a store evicts only the idle sessions of owners over their share (`owner_max_sessions`), least
recently used first. The worst case for a store that walks its LRU order from the oldest: `--keys` owners with an
equal share (`Settings.session_share`: the store's sessions over the keys), all but the last filled to it first
(the oldest sessions, none of them evictable), then the last filled to its share, so that the store is full; each
further insert of the last owner's puts it over its share and evicts its own oldest session, which comes after
every other owner's. For comparison, the easy case: one owner and no share (plain LRU), whose oldest session goes
at once.

Both stores, small sessions (a 2 x 8 state, a 4 x 4 adapter; TTL an hour, so none expires): the in-process one,
and Redis (a redis-server of its own on a unix socket in a temporary directory, stopped at the end). Prints the
median and the slowest of `--inserts` inserts, each timed alone, in milliseconds.

    python -m bench.session_store [--sizes 10000,100000] [--keys 100] [--inserts 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import statistics
import subprocess
import time
from functools import cache

import redis
import torch

from bench._common import ROOT, machine_line, redis_on_loopback
from models.adaptation import AdapterMemory, AdapterSettings, DynEvalConfig
from models.base import State
from models.memory import SessionConfig
from models.mlstm import MLSTM, MLSTMConfig
from models.session import SessionModel
from models.tokenizer import ByteTokenizer
from models.wordcache import WordCache, WordsMemory, WordsSettings
from server.engine import MemorySessionStore, RedisSessionStore, Session, SessionStats, SessionStore

MODEL_HASH = "b" * 64


def commit() -> str:
    r = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


@cache
def sessions() -> SessionModel:
    """The model of the template's records (what a store reads them back with): an mLSTM of 8 units, whose state is
    "h" and "c", an adapter of k = 4 on "h", a word cache."""
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=8, embed_dim=8))
    adapter = AdapterMemory(model, None, DynEvalConfig(mode="sparse", rule="sgd"), 4, 8)
    return SessionModel(model, ByteTokenizer(), {"adapter": adapter, "words": WordsMemory()})


def template() -> Session:
    g = torch.Generator().manual_seed(0)
    state = {"h": torch.randn(1, 8, generator=g), "c": torch.randn(1, 8, generator=g)}
    now = time.time()
    config = SessionConfig({"adapter": AdapterSettings(lr=1e-3, decay=2e-3, size=4), "words": WordsSettings()})
    return Session(id="", owner=None, created=float(int(now)), last_used=now, ttl_s=3600.0, config=config,
                   state=State(state), static_state=State({n: t + 1 for n, t in state.items()}), last_token=10,
                   memories={"adapter": State({"h": torch.randn(1, 4, 4, generator=g)}), "words": WordCache()},
                   stats=SessionStats())


def make_store(kind: str, url: str, n: int, share: int | None) -> SessionStore:
    limits = {"max_sessions": n, "max_bytes": 1 << 40, "owner_max_sessions": share,
              "owner_max_bytes": 1 << 40 if share else None}
    store: SessionStore
    if kind == "memory":
        store = MemorySessionStore(**limits)  # type: ignore[arg-type]
    else:
        with redis.Redis.from_url(url) as client:
            client.flushdb()
        store = RedisSessionStore(url, **limits)  # type: ignore[arg-type]
    store.bind(MODEL_HASH, template(), sessions())
    return store


def case(kind: str, url: str, n: int, keys: int, inserts: int) -> list[float]:
    """Fill a store of `n` sessions as the module docstring says (keys = 1: plain LRU), then time inserts of the
    last owner's -> milliseconds per insert."""
    base = template()
    owners = [hashlib.sha256(f"key-{k}".encode()).hexdigest() for k in range(keys)]
    share = n // keys if keys > 1 else None
    store = make_store(kind, url, n, share)
    per = n // keys
    i = 0
    for k, owner in enumerate(owners):
        for _ in range(per if k < keys - 1 else n - per * (keys - 1)):
            store.insert(dataclasses.replace(base, id=f"s{i:07d}", owner=owner, last_used=time.time()))
            i += 1
    assert store.stats().sessions == n
    times = []
    for _ in range(inserts):
        session = dataclasses.replace(base, id=f"s{i:07d}", owner=owners[-1], last_used=time.time())
        t0 = time.perf_counter()
        store.insert(session)
        times.append((time.perf_counter() - t0) * 1000)
        i += 1
    stats = store.stats()
    assert stats.sessions == n and stats.evictions["lru"] == inserts, stats
    store.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000", help="sessions in the full store (default 10000,100000)")
    ap.add_argument("--keys", type=int, default=100, help="owners of an equal share in the worst case (default 100)")
    ap.add_argument("--inserts", type=int, default=20, help="inserts timed per case (default 20)")
    ap.add_argument("--stores", default="memory,redis", help="which stores (default memory,redis)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.keys < 2 or args.inserts < 1 or min(sizes) < args.keys:
        ap.error("--keys must be at least 2, --inserts at least 1, and every size at least --keys")
    print(f"# an insert into a full session store: {machine_line()}, commit {commit()}")
    print(f"# worst case: {args.keys} owners of an equal share, the oldest {args.keys - 1} shares unevictable; "
          f"{args.inserts} inserts each")
    print("| store | sessions | oldest sessions | median ms per insert | slowest ms |")
    print("| --- | ---: | --- | ---: | ---: |")
    with redis_on_loopback(unix_socket=True) as url:
        for n in sizes:
            for kind in args.stores.split(","):
                for keys, what in ((args.keys, f"protected ({args.keys - 1} of {args.keys} shares)"),
                                   (1, "evictable (plain LRU)")):
                    times = case(kind, url, n, keys, args.inserts)
                    print(f"| {kind} | {n:,} | {what} | {statistics.median(times):.3f} | {max(times):.3f} |",
                          flush=True)


if __name__ == "__main__":
    main()
