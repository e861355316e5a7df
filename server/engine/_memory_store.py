"""The in-process session store (LRU order, TTL, a memory budget, a count limit) and its snapshot file."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import logging
import os
import threading
import time
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from models.session import SessionModel
from server.engine._errors import SessionConflict, SessionImportError, SessionStoreFull
from server.engine._export import export_session, import_session
from server.engine._session import Applied, Session, applied_of
from server.engine._store import SessionStore, StoreStats, committed, new_revision

__all__ = ["SNAPSHOT_FORMAT", "MemorySessionStore"]

SNAPSHOT_FORMAT = "adaptlm-session-snapshot-1"  # MemorySessionStore's file

log = logging.getLogger(__name__)


class MemorySessionStore(SessionStore):
    """In-process store: an LRU map with per-session TTL, a byte budget and a count limit.

    With a `snapshot` path, the sessions outlive the process: `close` (at shutdown, once the engine has finished
    its work) writes them all to that file, and `bind` (at start-up) reads back those of the same weights that
    have not expired. The file is a zip (stored, not compressed) of `export_session` blobs, one per session,
    and an `index.json` with each one's id, owner (the API key's hash), times and TTL: no pickle. It is
    written to a temporary file and renamed, so a crash mid-write leaves the previous snapshot whole.

    Making room costs what it removes, not the store's size: expired sessions come off a heap by expiry time, and
    victims from the LRU orders of the owners over their share, merged (`_victims`); pinned sessions met on the way
    are stepped over one by one. Finding those owners looks at each owner once (owners are API keys: a few).
    """

    def __init__(self, *, max_sessions: int, max_bytes: int, clock: Callable[[], float] = time.time,
                 snapshot: str | Path | None = None, owner_max_sessions: int | None = None,
                 owner_max_bytes: int | None = None) -> None:
        if max_sessions < 1 or max_bytes < 1:
            raise ValueError("max_sessions and max_bytes must be >= 1")
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        # One owner's share (None: none, plain LRU). Room is made only from owners over their share (counting the
        # new session for its own owner), least recently used first: one API key's creations never push out
        # another key's sessions within its share, and a key alone may still use the whole store.
        self.owner_max_sessions = owner_max_sessions or 0
        self.owner_max_bytes = owner_max_bytes or 0
        self.snapshot = Path(snapshot) if snapshot is not None else None
        self._model_hash: str | None = None
        self._model: SessionModel | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._bytes = 0
        # owner -> its sessions, least recently used first, each with its tick: a number, new at each write and
        # touch, that orders the sessions as `_sessions` does (so that owners' orders merge into the store's)
        self._owned: dict[str | None, OrderedDict[str, int]] = {}
        self._owned_bytes: Counter[str | None] = Counter()  # owner -> their bytes
        self._ticks = itertools.count()
        # (expires_at, tick, id), a heap; an entry whose tick is no longer its session's is stale (the session was
        # touched, written again or removed since) and is dropped when met, or when the heap is rebuilt
        self._expiry: list[tuple[float, int, str]] = []
        self._pins: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter({"ttl": 0, "lru": 0})

    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session | None:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                return None
            now = self._clock()
            if session.expired(now) and not self._pins[session_id]:
                self._remove(session_id, "ttl")
                return None
            if touch:
                session = dataclasses.replace(session, last_used=now)
                self._put(session)
            return session

    def contains(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions

    def insert(self, session: Session) -> Session:
        session = dataclasses.replace(session, revision=new_revision())
        with self._lock:
            old = self._sessions.get(session.id)
            # a replaced record of the same owner passes its keys on; a restored one brings its own
            kept = applied_of(old) if old is not None and old.owner == session.owner else applied_of(session)
            session, _ = committed(session, kept)
            if not self._fits(*self._stored_with(session)):
                self._sweep_locked()  # expired sessions make room before live ones are evicted
            victims = self._victims(session)
            if victims is None:  # refuse before evicting anything
                raise SessionStoreFull(f"the session store is full ({len(self._sessions)} sessions, {self._bytes} "
                                       f"of {self.max_bytes} bytes) and no session can be evicted now")
            for key in victims:
                self._remove(key, "lru")
            self._put(session)
            return session

    def update(self, session: Session) -> Session | None:
        with self._lock:
            stored = self._sessions.get(session.id)
            if stored is None:
                return None
            if stored.revision != session.revision:
                raise SessionConflict(session.id)
            session, _ = committed(dataclasses.replace(session, revision=new_revision()), applied_of(stored))
            self._put(session)
            return session

    def delete(self, session_id: str, owner: str | None) -> bool:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.owner != owner:
                return False
            self._remove(session_id, None)
            return True

    def pin(self, session_id: str) -> None:
        with self._lock:
            self._pins[session_id] += 1

    def unpin(self, session_id: str) -> None:
        with self._lock:
            self._pins[session_id] -= 1
            if self._pins[session_id] <= 0:
                del self._pins[session_id]

    def sweep(self) -> int:
        with self._lock:
            return self._sweep_locked()

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(sessions=len(self._sessions), bytes=self._bytes, evictions=dict(self._evictions))

    def bind(self, model_hash: str, template: Session, sessions: SessionModel) -> None:
        self._model_hash, self._model = model_hash, sessions
        if self.snapshot is not None and self.snapshot.exists():
            self._restore(self.snapshot, model_hash, template, sessions)

    def close(self) -> None:
        """Write the snapshot, if there is one to write (without a path the sessions end with the process)."""
        if self.snapshot is not None and self._model_hash is not None:
            self._save(self.snapshot, self._model_hash)

    def _save(self, path: Path, model_hash: str) -> None:
        with self._lock:
            self._sweep_locked()
            sessions = list(self._sessions.values())  # least recently used first
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        index = []
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
            for i, session in enumerate(sessions):
                member = f"{i}.safetensors"
                assert self._model is not None
                z.writestr(member, export_session(session, model_hash, self._model))
                index.append({"member": member, "id": session.id, "owner": session.owner,
                              "created": session.created, "last_used": session.last_used, "ttl_s": session.ttl_s,
                              "applied": [entry.encode() for entry in applied_of(session)]})
            z.writestr("index.json", json.dumps({"format": SNAPSHOT_FORMAT, "model_hash": model_hash,
                                                 "sessions": index}))
        os.replace(tmp, path)
        log.info("wrote %d sessions to %s", len(sessions), path)

    def _restore(self, path: Path, model_hash: str, template: Session, sessions: SessionModel) -> None:
        """Read a snapshot back; a snapshot of other weights, or one that cannot be read, is left alone (and
        said so in the log): the server starts without those sessions rather than not at all."""
        now, kept, skipped = self._clock(), 0, 0
        try:
            with zipfile.ZipFile(path) as z:
                index = json.loads(z.read("index.json"))
                if index.get("format") != SNAPSHOT_FORMAT:
                    raise ValueError(f"not a session snapshot (format {index.get('format')!r})")
                if index.get("model_hash") != model_hash:
                    log.warning("the session snapshot %s is of other weights (sha256 %s…): not restored", path,
                                str(index.get("model_hash"))[:12])
                    return
                for entry in index["sessions"]:  # least recently used first, so the LRU order comes back
                    try:
                        session, _ = import_session(z.read(entry["member"]), model_hash=model_hash,
                                                    template=template, sessions=sessions)
                        owner = entry["owner"]
                        if owner is not None and not isinstance(owner, str):
                            raise TypeError("an owner is a string or null")
                        session = dataclasses.replace(
                            session, id=str(entry["id"]), owner=owner, created=float(entry["created"]),
                            last_used=float(entry["last_used"]), ttl_s=float(entry["ttl_s"]))
                        # a snapshot of an older server has none
                        applied = tuple(Applied.decode(str(line)) for line in entry.get("applied", ()))
                        session, _ = committed(session, applied)
                    except (KeyError, TypeError, ValueError, AttributeError, SessionImportError) as e:
                        skipped += 1
                        log.warning("a session of the snapshot cannot be read (%s): skipped", e)
                        continue
                    if session.expired(now):
                        continue
                    try:
                        self.insert(session)
                    except SessionStoreFull:
                        skipped += 1
                        continue
                    kept += 1
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            log.error("the session snapshot %s cannot be read (%s): starting without it", path, e)
            return
        log.info("restored %d sessions from %s (%d skipped)", kept, path, skipped)

    def _stored_with(self, session: Session) -> tuple[int, int]:
        """The sessions and bytes stored once `session` is (in place of the record of its id), nothing evicted."""
        old = self._sessions.get(session.id)
        count, size = len(self._sessions) + 1, self._bytes + session.nbytes
        return (count, size) if old is None else (count - 1, size - old.nbytes)

    def _fits(self, count: int, size: int) -> bool:
        return count <= self.max_sessions and size <= self.max_bytes

    def _victims(self, session: Session) -> list[str] | None:
        """The idle sessions to evict for `session` to fit, least recently used first, taken only from owners over
        their share: the new session's owner counting it (and not the record it replaces), the others as they are;
        None if they are not enough. The sessions a walk down the whole LRU order would take, skipping the others;
        but only the orders of the owners over their share are read, merged by tick."""
        count, size = self._stored_with(session)
        if self._fits(count, size):
            return []
        old = self._sessions.get(session.id)

        def over(n: int, b: int) -> bool:
            return n > self.owner_max_sessions or b > self.owner_max_bytes

        books: list[list[int]] = []  # of the owners over their share: their sessions and bytes, as counted
        orders: list[Iterator[tuple[str, int]]] = []  # their sessions (id, tick), least recently used first
        heads: list[tuple[int, int, str]] = []  # (tick, which owner, id): each owner's next session, a heap
        for owner, order in self._owned.items():
            n, b = len(order), self._owned_bytes[owner]
            if old is not None and old.owner == owner:
                n, b = n - 1, b - old.nbytes
            if session.owner == owner:
                n, b = n + 1, b + session.nbytes
            if over(n, b):
                orders.append(iter(order.items()))
                books.append([n, b])
                key, tick = next(orders[-1])  # an owner's order is never empty
                heads.append((tick, len(orders) - 1, key))
        heapq.heapify(heads)
        victims: list[str] = []
        while heads and not self._fits(count, size):
            _, i, key = heads[0]
            if key != session.id and not self._pins[key]:
                nbytes = self._sessions[key].nbytes
                victims.append(key)
                count, size = count - 1, size - nbytes
                books[i][0] -= 1
                books[i][1] -= nbytes
                if not over(*books[i]):  # within its share now: the rest of its sessions stay
                    heapq.heappop(heads)
                    continue
            following = next(orders[i], None)
            if following is None:
                heapq.heappop(heads)
            else:
                heapq.heapreplace(heads, (following[1], i, following[0]))
        return victims if self._fits(count, size) else None

    def _put(self, session: Session) -> None:
        old = self._sessions.pop(session.id, None)
        if old is not None:
            self._bytes -= old.nbytes
            self._disown(old)
        tick = next(self._ticks)
        self._sessions[session.id] = session  # most recently used
        self._bytes += session.nbytes
        self._owned.setdefault(session.owner, OrderedDict())[session.id] = tick
        self._owned_bytes[session.owner] += session.nbytes
        heapq.heappush(self._expiry, (session.expires_at(), tick, session.id))
        if len(self._expiry) > 2 * len(self._sessions) + 64:  # mostly stale entries (touches): rebuilt
            self._expiry = [(s.expires_at(), self._owned[s.owner][k], k) for k, s in self._sessions.items()]
            heapq.heapify(self._expiry)

    def _disown(self, session: Session) -> None:
        order = self._owned[session.owner]
        del order[session.id]
        self._owned_bytes[session.owner] -= session.nbytes
        if not order:
            del self._owned[session.owner], self._owned_bytes[session.owner]

    def _remove(self, session_id: str, reason: str | None) -> None:
        session = self._sessions.pop(session_id)
        self._bytes -= session.nbytes
        self._disown(session)
        if reason is not None:
            self._evictions[reason] += 1

    def _sweep_locked(self) -> int:
        """Remove the expired unpinned sessions, from the top of the expiry heap."""
        now, expired, pinned = self._clock(), 0, []
        while self._expiry and self._expiry[0][0] <= now:  # Session.expired: now >= expires_at
            entry = heapq.heappop(self._expiry)
            _, tick, key = entry
            session = self._sessions.get(key)
            if session is None or self._owned[session.owner][key] != tick:
                continue  # stale
            if self._pins[key]:
                pinned.append(entry)  # it expires once unpinned: kept
                continue
            self._remove(key, "ttl")
            expired += 1
        for entry in pinned:
            heapq.heappush(self._expiry, entry)
        return expired
