"""Sessions in Redis: the `SessionStore` interface over `export_session` blobs (safetensors bytes with JSON
metadata, never pickle), shared by every server that uses the same Redis database and the same weights.

A session survives a restart of the server, and two servers see the same sessions: every change is written
to Redis when the worker commits it (after each observe, reset, import), so there is nothing to flush at
shutdown. Keys, in one namespace per checkpoint, `adaptlm:{<first 16 hex digits of the weights hash>}` (the
braces are a Redis Cluster hash tag: all of a namespace's keys live in one slot, so the scripts may touch
them together):

    <ns>:s:<id>   hash: the export in parts (hdr, lay, c:<tensor>:<i>: _redis_form.py; `blob`, the whole export, in a
                  record written before the parts), owner (the API key's hash, "" for none), created, last_used, ttl,
                  revision (`Session.revision`, new at every write; "" for a record written before revisions),
                  applied (the last observes applied under an idempotency key, one line each, `Applied.encode`;
                  written by the update that writes the observe's state);
                  Redis expires the key ttl seconds after its last use (PEXPIRE, renewed by every use)
    <ns>:lru      sorted set id -> last use (unix time): the LRU order, and the session count
    <ns>:exp      sorted set id -> when it expires: what the sweep looks at
    <ns>:size     hash id -> bytes of its export; <ns>:bytes, their sum: the memory accounting is the size of
                  the stored values (the tensors plus a header of a few to tens of kilobytes)
    <ns>:pins     sorted set "<instance>|<id>" -> lease end: sessions with work in flight on some server
    <ns>:owner    hash id -> owner; <ns>:o:<owner>, sorted set id -> last use; <ns>:obytes, hash owner -> bytes (owners
                  with a session): each owner's sessions: to make room, only owners over their share of the store
                  (`owner_max_sessions`, `owner_max_bytes`) give up sessions, least recently used first; a
                  record of an older server (in no owner's index until a write of this version) makes room as any
                  did before shares

Each server keeps the records it read or wrote (`_Cache`); a read sends its copy's revision, and get.lua answers
the last use time alone (no state) when the stored revision is that one: a keystroke on a session this server holds
reads a few bytes from Redis, and a copy is served only once Redis has confirmed it (a write elsewhere, a delete
elsewhere: the next read loads the whole record, or finds none). An update of a record this server holds at the
revision the work read sends only the parts that changed (the header, the chunks whose digests differ, the names of
parts that are gone); otherwise, and for an insert (a new session, an import), all of them.

Every change touching several keys is one Lua script (redis_scripts/*.lua), atomic across servers. An update
writes only over the revision its work read (`SessionStore.update`): two servers working on one session at once are
ordered by their writes, and the second is refused (SessionConflict), not lost. The limits (`max_sessions`,
`max_bytes`) are the shared store's: a server that inserts evicts the least recently used unpinned sessions of
owners over their share, whichever server made them.

Making room (insert.lua) costs what it removes, not the store's size (the script blocks Redis while it runs): first
expired sessions, however recently used (index entries whose key Redis has dropped, looked for among those whose
time in `<ns>:exp` has passed), then victims read from the sorted sets of the owners over their share only, merged
by last use; pinned sessions met on the way are stepped over one by one, and every owner's count is read once
(owners are API keys: a few). While the store holds records of an older server (counted for no owner), it walks
the whole LRU order instead, past every session of the owners within their share.

Pins: a server that starts work on a session (the engine's `pin`) leases it for `lease_s` seconds, renewed at
every sweep (each second): while leased, Redis does not expire it and no server evicts it. A server that dies
leaves leases that lapse by themselves. At `unpin`, the session's expiry goes back to last use + ttl.

What is observed: a key that Redis expired is found by a sweep (an index entry without its key), which drops
the entry and counts a "ttl" eviction on the server that found it (each expiry is counted once, by one
server). Redis's own maxmemory evictions cannot be told apart from expiry without keyspace notifications:
they count as "ttl" too (run Redis with `maxmemory-policy noeviction` and let `max_bytes` bound the store).
"lru" counts the sessions this server evicted to stay in the limits. Eviction counts are this server's
(a sum over servers is the total); the session count and bytes are the shared store's.

Faults: once a call finds Redis unreachable (refused, or timed out), every call fails at once (503) until a
background ping reaches it again; a session's write carries a deadline in Redis's clock, so that a write that
timed out (its caller answered 503) is not done later by a Redis that was only paused (`update`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from models.session import SessionModel
from server.engine._errors import SessionConflict, SessionImportError, SessionStoreFull, SessionStoreUnavailable
from server.engine._export import export_session, import_session
from server.engine._redis_form import Stored, join, split
from server.engine._session import APPLIED_KEPT, Applied, KeyedSession, Session, applied_of, keyed
from server.engine._store import SessionStore, StoreStats, committed, new_revision

__all__ = ["RedisSessionStore"]

log = logging.getLogger(__name__)


def _scripts() -> dict[str, str]:
    """The Lua scripts of redis_scripts/ (package data), each after prelude.lua: the functions they share."""
    folder = resources.files("server.engine") / "redis_scripts"
    prelude = (folder / "prelude.lua").read_text(encoding="utf-8")
    return {name: prelude + (folder / f"{name}.lua").read_text(encoding="utf-8")
            for name in ("insert", "update", "get", "delete", "pin", "unpin", "sweep")}


_SCRIPTS = _scripts()

_SWEEP_LIMIT = 1000  # index entries a sweep looks at
_PROBE_S = 0.5  # while Redis cannot be reached, how often a background thread tries it again


def _pairs(fields: dict[bytes, bytes]) -> list[bytes]:
    return [x for pair in fields.items() for x in pair]


def _applied(lines: bytes) -> tuple[Applied, ...]:
    return tuple(Applied.decode(line) for line in lines.decode().split("\n"))


class _Cache:
    """The records this server read or wrote, by stored id, least recently used first, bounded by count and by bytes
    (their exports' sizes), each with what was stored of it (`Stored`; None for a record of the form before the
    parts). A record is served only once Redis has said its revision is still the stored one
    (`RedisSessionStore.get`), so a stale entry costs a reload, never a stale answer. Thread-safe."""

    def __init__(self, max_sessions: int, max_bytes: int) -> None:
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._lock = threading.Lock()
        self._records: OrderedDict[str, tuple[Session, int, Stored | None]] = OrderedDict()
        self._bytes = 0

    def get(self, session_id: str) -> Session | None:
        entry = self.entry(session_id)
        return entry[0] if entry is not None else None

    def entry(self, session_id: str) -> tuple[Session, Stored | None] | None:
        with self._lock:
            entry = self._records.get(session_id)
            if entry is None:
                return None
            self._records.move_to_end(session_id)
            return entry[0], entry[2]

    def keeps(self, size: int) -> bool:
        """Whether a record of `size` bytes would be kept (what it takes to keep one is then worth computing)."""
        return size <= self.max_bytes and self.max_sessions >= 1

    def put(self, session: Session, size: int, stored: Stored | None) -> None:
        if not session.revision or not self.keeps(size):
            return
        with self._lock:
            self._pop(session.id)
            self._records[session.id] = (session, size, stored)
            self._bytes += size
            while len(self._records) > self.max_sessions or self._bytes > self.max_bytes:
                self._pop(next(iter(self._records)))

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._pop(session_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def _pop(self, session_id: str) -> None:
        entry = self._records.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry[1]


@dataclasses.dataclass(frozen=True)
class _Bound:
    model_hash: str
    template: Session
    keys: tuple[str, str, str, str, str]  # lru, exp, size, bytes, pins
    ns: str
    sessions: SessionModel


class RedisSessionStore(SessionStore):
    """`SessionStore` in a Redis database (module docstring). Thread-safe (redis-py's connection pool)."""

    def __init__(self, url: str, *, max_sessions: int, max_bytes: int, lease_s: float = 60.0,
                 clock: Callable[[], float] = time.time, timeout_s: float = 5.0, owner_max_sessions: int | None = None,
                 owner_max_bytes: int | None = None, cache_sessions: int | None = None,
                 cache_bytes: int = 256 << 20) -> None:
        if max_sessions < 1 or max_bytes < 1 or lease_s <= 0:
            raise ValueError("max_sessions and max_bytes must be >= 1 and lease_s > 0")
        self.url = url
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        # one owner's share (None: none, plain LRU), as in MemorySessionStore
        self.owner_max_sessions = owner_max_sessions or 0
        self.owner_max_bytes = owner_max_bytes or 0
        self.lease_s = lease_s
        self._clock = clock
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           health_check_interval=30)
        self._timeout_s = timeout_s
        self._skew_s = 0.0  # Redis's clock minus ours (measured at bind and at each sweep)
        self._scripts: dict[str, Script] = {name: self._redis.register_script(source)
                                            for name, source in _SCRIPTS.items()}
        self._bound: _Bound | None = None
        # the records this server served or wrote (at most cache_sessions, max_sessions by default, and cache_bytes
        # of blobs; 0: none): a read sends the copy's revision, and Redis sends the blob only if it changed
        self._cache = _Cache(max_sessions if cache_sessions is None else cache_sessions, cache_bytes)
        self._instance = secrets.token_hex(8)  # names this server's leases
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter({"ttl": 0, "lru": 0})
        self._last_stats = StoreStats(sessions=0, bytes=0, evictions={"ttl": 0, "lru": 0})
        # Set while Redis cannot be reached (a connection refused or a timeout): every call fails at once instead
        # of waiting for its own timeout, which would hold the engine's worker thread (and with it the work that
        # needs no session) for seconds a call; a background thread pings Redis and clears it.
        self._unreachable = threading.Event()
        self._closed = threading.Event()

    # -- the interface -----------------------------------------------------------------------------

    def bind(self, model_hash: str, template: Session, sessions: SessionModel) -> None:
        ns = f"adaptlm:{{{model_hash[:16]}}}"
        keys = (f"{ns}:lru", f"{ns}:exp", f"{ns}:size", f"{ns}:bytes", f"{ns}:pins")
        self._bound = _Bound(model_hash, template, keys, ns, sessions)
        with self._errors("connect to"):
            self._redis.ping()
            self._measure_skew()

    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session | None:
        cached = self._cache.get(session_id)
        known = cached.revision or "" if cached is not None else ""
        fields = self._run("get", session_id, owner or "", "1" if touch else "0", repr(self._clock()), known)
        if fields is None:
            self._cache.drop(session_id)
            return None
        if len(fields) == 1:  # the stored revision is the cached copy's: that copy is the record
            assert cached is not None
            return dataclasses.replace(cached, last_used=float(fields[0]))
        stored_owner, created, last_used, ttl, revision, applied, *state = fields
        bound = self._binding()
        try:
            blob, form = join(dict(zip(state[::2], state[1::2], strict=True)))
            session, _ = import_session(blob, model_hash=bound.model_hash, template=bound.template,
                                        sessions=bound.sessions)
        except SessionImportError as e:
            log.error("session %s in Redis cannot be read (%s); treating it as absent", session_id[:8], e)
            self._cache.drop(session_id)
            return None
        session = dataclasses.replace(session, id=session_id, owner=stored_owner.decode() or None,
                                      created=float(created), last_used=float(last_used), ttl_s=float(ttl),
                                      revision=revision.decode())
        if applied:
            session = keyed(session, applied=_applied(applied))
        stored = Stored.of(form) if form is not None and self._cache.keeps(len(blob)) else None
        self._cache.put(session, len(blob), stored)
        return session

    def contains(self, session_id: str) -> bool:
        bound = self._binding()
        with self._errors("read from"):
            return bool(self._redis.exists(f"{bound.ns}:s:{session_id}"))

    def insert(self, session: Session) -> Session:
        now, revision = self._clock(), new_revision()
        record, blob = self._record(session)
        form = split(blob)
        self._cache.drop(session.id)  # whatever the outcome: the replaced record is not served from here again
        evicted, expired, *kept = self._run("insert", repr(now), *record, str(self._ttl_ms(session, now)),
                                            str(self.max_sessions), str(self.max_bytes), revision,
                                            str(self.owner_max_sessions), str(self.owner_max_bytes),
                                            *_pairs(form.fields))
        with self._lock:
            self._evictions["ttl"] += int(expired)
            if evicted > 0:
                self._evictions["lru"] += int(evicted)
        if evicted < 0:
            raise SessionStoreFull(f"the session store is full (at most {self.max_sessions} sessions and "
                                   f"{self.max_bytes} bytes) and no session can be evicted now")
        # what was stored: the session with the keys a replaced record of its owner passed on (none otherwise)
        stored: Session = dataclasses.replace(session, revision=revision)
        if kept and kept[0]:
            stored = keyed(stored, applied=_applied(kept[0]))
        elif isinstance(stored, KeyedSession):
            stored = keyed(stored, applied=())
        self._cache.put(stored, len(blob), Stored.of(form) if self._cache.keeps(len(blob)) else None)
        return stored

    def update(self, session: Session) -> Session | None:
        # A write that times out is not known to have failed: Redis may run it later (a paused or partitioned
        # Redis reads the command from its socket when it resumes), after the client was answered 503, which
        # promises that nothing was done (clients retry it: an observe would adapt twice). So the write carries a
        # deadline, half the socket timeout after it is sent, in Redis's clock: run later, it writes nothing. This
        # narrows the window, it does not close it: a script run before its deadline whose reply is then lost
        # (Redis paused just after) is done and still answered 503.
        # The revision check also refuses such a late write once the session was written since (by the client's
        # retry, say).
        # An observe under an idempotency key writes the key with its state, in the script: a write whose reply is
        # lost (the window above) is then known by its key, and the client's retry answers as it did instead of
        # observing again.
        deadline = time.time() + self._skew_s + self._timeout_s / 2
        revision = new_revision()
        entry = session.observing if isinstance(session, KeyedSession) else None
        record, _ = committed(session, applied_of(session))  # what was stored, as this write leaves it
        args, blob = self._record(session)
        # The parts that changed over the revision the work read, if this server holds that revision's parts
        # (it read or wrote it); otherwise all of them. The script writes only over that revision.
        cached = self._cache.entry(session.id)
        base = cached[1] if cached is not None and cached[0].revision == session.revision else None
        if base is not None:
            assert cached is not None
            form = split(blob, base, slid=session.stats.bytes_observed - cached[0].stats.bytes_observed)
            digests = form.digests
            sent = {k: v for k, v in form.fields.items() if base.digests.get(k) != digests[k]}
            gone = sorted(set(base.digests) - set(form.fields))
        else:
            form, sent, gone = split(blob), None, []
        state = _pairs(form.fields if sent is None else sent)
        try:
            written = int(self._run("update", *args, str(self._ttl_ms(session, self._clock())),
                                    str(math.floor(deadline * 1000)), session.revision or "", revision,
                                    entry.encode() if entry is not None else "", str(APPLIED_KEPT),
                                    "1" if sent is None else "0", str(len(gone)), *gone, *state))
        except SessionStoreUnavailable:  # written or not, unknown: the next read asks Redis for the record
            self._cache.drop(session.id)
            raise
        if written in (-2, -3):  # -3: its key was applied meanwhile (then so was a revision: -2 comes first)
            self._cache.drop(session.id)  # another server's write: the next read loads it
            raise SessionConflict(session.id)
        if written < 0:
            raise SessionStoreUnavailable("could not use the session store (it answered after the write's deadline; "
                                          "nothing was written)")
        if not written:
            self._cache.drop(session.id)
            return None
        stored = dataclasses.replace(record, revision=revision)
        # this server's own write: never read back
        self._cache.put(stored, len(blob), Stored.of(form) if self._cache.keeps(len(blob)) else None)
        return stored

    def delete(self, session_id: str, owner: str | None) -> bool:
        self._cache.drop(session_id)
        return bool(self._run("delete", session_id, owner or ""))

    def pin(self, session_id: str) -> None:
        with self._lock:
            self._pins[session_id] += 1
            first = self._pins[session_id] == 1
        if first:
            self._lease([session_id])

    def unpin(self, session_id: str) -> None:
        with self._lock:
            self._pins[session_id] -= 1
            last = self._pins[session_id] <= 0
            if last:
                del self._pins[session_id]
        if last:
            try:
                self._run("unpin", f"{self._instance}|{session_id}", session_id, repr(self._clock()))
            except SessionStoreUnavailable as e:  # the lease lapses by itself
                log.warning("could not release the lease of a session: %s", e)

    def sweep(self) -> int:
        with self._lock:
            pinned = list(self._pins)
        self._lease(pinned)
        try:
            expired = int(self._run("sweep", repr(self._clock()), str(_SWEEP_LIMIT)))
            with self._errors("read the time of"):
                self._measure_skew()
        except SessionStoreUnavailable as e:
            log.warning("session sweep failed: %s", e)
            return 0
        with self._lock:
            self._evictions["ttl"] += expired
        return expired

    def stats(self) -> StoreStats:
        bound = self._binding()
        try:
            with self._errors("read from"):
                pipe = self._redis.pipeline(transaction=False)
                pipe.zcard(bound.keys[0])
                pipe.get(bound.keys[3])
                count, total = pipe.execute()
        except SessionStoreUnavailable as e:  # a scrape keeps working: the last values seen
            log.warning("session store statistics unavailable: %s", e)
            with self._lock:
                return dataclasses.replace(self._last_stats, evictions=dict(self._evictions))
        with self._lock:
            self._last_stats = StoreStats(sessions=int(count), bytes=int(total or 0), evictions=dict(self._evictions))
            return self._last_stats

    def close(self) -> None:
        self._closed.set()
        self._redis.close()

    # -- helpers -----------------------------------------------------------------------------------

    def _binding(self) -> _Bound:
        if self._bound is None:
            raise RuntimeError("the store is not bound to a model yet (the engine binds it when it starts)")
        return self._bound

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        if self._unreachable.is_set():
            raise SessionStoreUnavailable(f"could not {what} the session store (unreachable; retried every "
                                          f"{_PROBE_S} s)")
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # The client sees the error's type only: its text names the Redis server's address (the log has it).
            self._set_unreachable()
            log.warning("could not %s the session store: %s", what, e)
            raise SessionStoreUnavailable(f"could not {what} the session store ({type(e).__name__})") from e
        except redis.RedisError as e:
            log.warning("could not %s the session store: %s", what, e)
            raise SessionStoreUnavailable(f"could not {what} the session store ({type(e).__name__})") from e

    def _set_unreachable(self) -> None:
        with self._lock:
            if self._unreachable.is_set() or self._closed.is_set():
                return
            self._unreachable.set()
        log.warning("the session store cannot be reached: session requests answer 503 until it can")
        threading.Thread(target=self._probe, name="redis-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._closed.wait(_PROBE_S):
            try:
                self._redis.ping()
            except redis.RedisError:
                continue
            self._unreachable.clear()
            log.warning("the session store can be reached again")
            return

    def _run(self, script: str, *args: str | bytes) -> Any:
        bound = self._binding()
        with self._errors("use"):
            return self._scripts[script](keys=list(bound.keys), args=[bound.ns, *args])

    def _record(self, session: Session) -> tuple[list[str | bytes], bytes]:
        """A stored session's record as script arguments (id, owner, created, last_used, ttl, expires_at, size), and
        its export."""
        bound = self._binding()
        blob = export_session(session, bound.model_hash, bound.sessions)
        return [session.id, session.owner or "", repr(session.created), repr(session.last_used),
                repr(session.ttl_s), repr(session.expires_at()), str(len(blob))], blob

    def _measure_skew(self) -> None:
        """Redis's clock against ours (to within half a round trip), for the deadlines of writes."""
        before = time.time()
        seconds, micros = self._redis.time()
        after = time.time()
        self._skew_s = seconds + micros / 1e6 - (before + after) / 2

    @staticmethod
    def _ttl_ms(session: Session, now: float) -> int:
        return max(1, math.ceil((session.expires_at() - now) * 1000))

    def _lease(self, session_ids: Sequence[str]) -> None:
        """Lease (or renew the lease of) sessions this server has work for."""
        if not session_ids:
            return
        bound = self._binding()
        until, ms = repr(self._clock() + self.lease_s), str(math.ceil(self.lease_s * 1000))
        try:
            with self._errors("lease sessions in"):
                pipe = self._redis.pipeline(transaction=False)
                for session_id in session_ids:
                    self._scripts["pin"](keys=list(bound.keys),
                                         args=[bound.ns, f"{self._instance}|{session_id}", session_id, until, ms],
                                         client=pipe)
                pipe.execute()
        except SessionStoreUnavailable as e:  # best effort: a session without a lease may expire under its work
            log.warning("could not lease sessions: %s", e)
