"""The session record is the model layer's (`models.session.Session`: one adapted text stream with its memories);
the engine adds its ids, and the store's record of the observes applied to it (`KeyedSession`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.memory import SessionConfig
from models.session import PENDING_MAX_BYTES, Session, SessionStats

__all__ = ["APPLIED_KEPT", "IDEMPOTENCY_KEY", "IDEMPOTENCY_KEY_PATTERN", "PENDING_MAX_BYTES", "Applied",
           "KeyedSession", "Session", "SessionConfig", "SessionStats", "SettingsView", "applied_of", "keyed",
           "new_session_id", "text_digest"]

# The idempotency keys a session remembers: the last APPLIED_KEPT observes that carried one. A client retries an
# observe within seconds, tens of observes later at most; each entry is ~200 bytes against a session's state of
# hundreds of kilobytes.
APPLIED_KEPT = 32
# What a key may be: a UUID, a ULID, a hash, a counter; no space (the Redis record separates entries with it) and
# nothing that needs escaping in a header or a log line.
IDEMPOTENCY_KEY = r"[A-Za-z0-9_.:+/=-]{1,128}"
IDEMPOTENCY_KEY_PATTERN = re.compile(IDEMPOTENCY_KEY)


def text_digest(data: bytes) -> str:
    """What an applied key remembers of its text: a retry with the same key and another text is refused."""
    return hashlib.sha256(data).hexdigest()[:32]


@dataclass(frozen=True)
class Applied:
    """One observe applied under an idempotency key: the key, its text's digest and its answer (the observe's
    score, `TextScore`'s fields without log-probabilities), so that a retry answers as the first did."""

    key: str
    digest: str
    answer: dict[str, Any] | None = None

    def encode(self) -> str:
        """One line: the key, a space, the rest as JSON (floats written as Python's repr: they read back equal)."""
        return f"{self.key} {json.dumps({'digest': self.digest, 'answer': self.answer}, separators=(',', ':'))}"

    @classmethod
    def decode(cls, line: str) -> Applied:
        key, _, rest = line.partition(" ")
        fields = json.loads(rest)
        return cls(key=key, digest=str(fields["digest"]), answer=fields.get("answer"))


@dataclass(frozen=True)
class KeyedSession(Session):
    """A record with the store's bookkeeping of idempotent observes (never exported): `applied`, the last observes
    written into it with a key, oldest first, as read from the store; `observing`, the observe this record is the
    result of, which the store's `update` adds to the stored record's `applied` in the same write as the state (so
    that a key is recorded exactly when its observe is). `dataclasses.replace`, which the model layer uses to make
    the record after an observe, keeps both."""

    applied: tuple[Applied, ...] = ()
    observing: Applied | None = None


def keyed(session: Session, *, applied: tuple[Applied, ...], observing: Applied | None = None) -> KeyedSession:
    """`session` as a `KeyedSession` with that bookkeeping."""
    fields = {f.name: getattr(session, f.name) for f in dataclasses.fields(Session) if f.init}
    return KeyedSession(**fields, applied=applied, observing=observing)


def applied_of(session: Session | None) -> tuple[Applied, ...]:
    return session.applied if isinstance(session, KeyedSession) else ()


@dataclass(frozen=True)
class SettingsView:
    """A session's memory settings as a worker holds them: what `SessionConfig.to_dict` says. The engine rebuilds
    the `SessionConfig` from it (against the checkpoint's memories) where it needs one."""

    memories: Mapping[str, Mapping[str, Any]]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dict(settings) for name, settings in self.memories.items()}



def new_session_id() -> str:
    """192 random bits, URL-safe (32 characters), never starting with "-" (a command line would read such an id
    as an option)."""
    while (session_id := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return session_id
