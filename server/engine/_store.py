"""The session store interface: where sessions live between two pieces of work.

Only the engine's worker thread writes sessions (create, adapt, reset, import); HTTP handlers read them
(stats, export) and delete them. `MemorySessionStore` (`_memory_store.py`) keeps them in this process,
`RedisSessionStore` (`_redis.py`) in Redis as export blobs (`_export.py`).

Work on a session reads its record, computes, and writes the result back with `update`. One server's scheduler
runs one session's work at a time, but servers sharing a Redis store do not order their work: so every stored record
carries a revision (`Session.revision`), new at each insert and update, and `update` writes only over the revision
its work read (optimistic concurrency): of two pieces of work that read the same record, the second to write is
refused (SessionConflict) instead of silently undoing the first.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from models.session import SessionModel
from server.engine._errors import SessionConflict
from server.engine._session import APPLIED_KEPT, Applied, KeyedSession, Session, keyed

__all__ = ["SessionStore", "StoreStats", "committed", "new_revision"]


def new_revision() -> str:
    """A stored record's revision: 128 random bits. Random, not a counter: a counter starts again when a session
    is deleted and created again, or replaced by an import (an insert), so work that read the old record could
    find "its" revision on the new one and write over it; a random token never comes back. Made here, not in
    Redis, so that the store's scripts stay deterministic."""
    return secrets.token_hex(16)


def committed(session: Session, stored: tuple[Applied, ...]) -> tuple[KeyedSession | Session, Applied | None]:
    """What a store writes for `session` over a record whose applied keys are `stored`: the record with those keys,
    plus the key of the observe it is the result of (`KeyedSession.observing`), the last APPLIED_KEPT kept; and that
    new entry (None: none). The keys are the stored record's, not the ones `session` was read with: a reset or an
    import keeps them."""
    entry = session.observing if isinstance(session, KeyedSession) else None
    if entry is not None and entry.answer is None:
        raise ValueError("an observe's key is recorded with its answer")
    if entry is not None and any(a.key == entry.key for a in stored):
        raise SessionConflict(session.id)  # applied since this work read the session (a retry of it on another server)
    applied = (*stored, entry)[-APPLIED_KEPT:] if entry is not None else stored
    if not applied and not isinstance(session, KeyedSession):
        return session, None
    return keyed(session, applied=applied), entry


@dataclass(frozen=True)
class StoreStats:
    sessions: int
    bytes: int
    evictions: Mapping[str, int]  # by reason: "ttl" (expired), "lru" (made room for another session)


class SessionStore(ABC):
    """Where sessions live. Thread-safe. `owner` is checked on reads and deletes: a session of another owner
    is reported as absent. Sessions that the engine has work for are pinned and never evicted."""

    @abstractmethod
    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session | None:
        """The session, or None if there is none (expired, evicted, deleted, never created, another owner's).
        `touch` marks it used (extends its TTL, makes it most recently used). A record with applied idempotency
        keys is a `KeyedSession` (`applied_of`)."""

    @abstractmethod
    def contains(self, session_id: str) -> bool:
        """Whether a session of that id exists, whoever owns it (expired ones included until swept)."""

    @abstractmethod
    def insert(self, session: Session) -> Session:
        """Create or replace `session`, whatever is stored (its revision is not checked; a replaced record of the same
        owner passes its applied idempotency keys on, `committed`); evicts expired, then
        least recently used unpinned sessions to stay in the limits; raises SessionStoreFull (evicting and storing
        nothing) if that cannot make room. -> the stored record (`session` with its new revision)."""

    @abstractmethod
    def update(self, session: Session) -> Session | None:
        """Replace the stored session of the same id, if it is still the revision `session` was read from
        (`session.revision`, which work keeps through `dataclasses.replace`). -> the stored record (with its new
        revision); None (storing nothing) if the session is gone (deleted); raises SessionConflict (storing
        nothing) if it was changed since that read. An observe under an idempotency key (`KeyedSession.observing`)
        is recorded in the same write, atomically (`committed`); the stored keys outlive writes without one."""

    @abstractmethod
    def delete(self, session_id: str, owner: str | None) -> bool:
        """Remove the session; False if there was none for `owner`."""

    @abstractmethod
    def pin(self, session_id: str) -> None:
        """Protect the session from eviction until as many `unpin` calls (work for it is in flight)."""

    @abstractmethod
    def unpin(self, session_id: str) -> None: ...

    @abstractmethod
    def sweep(self) -> int:
        """Remove expired unpinned sessions now; -> how many."""

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def bind(self, model_hash: str, template: Session, sessions: SessionModel) -> None:
        """Called by the engine once its checkpoint is loaded, before any other call: the weights' hash, a
        fresh session of the model (what a record read back starts from) and the sessions' model (its memories and
        tokenizer: what a record holds). A store that serialises sessions needs them to read them back; it may also
        check here that it is reachable (SessionStoreUnavailable)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; called once the engine has stopped (its last writes are done)."""
