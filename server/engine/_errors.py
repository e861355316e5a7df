"""What the engine raises to its callers; server/errors.py translates each into the API's one error shape."""

from __future__ import annotations

from typing import Any

from server.engine._idspace import public_id

__all__ = [
    "EngineBudgetExceeded", "EngineOverloaded", "EngineUnavailable", "IdempotencyKeyReused", "InvalidSessionSettings",
    "ObserveApplied", "SessionConflict", "SessionImportError", "SessionNotFound", "SessionStoreFull",
    "SessionStoreUnavailable", "SessionsUnavailable",
]


class EngineUnavailable(RuntimeError):
    """The engine is not running (not started, stopped, or its worker thread died)."""


class EngineOverloaded(RuntimeError):
    """The work queue is full; the caller should retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineBudgetExceeded(RuntimeError):
    """The request took more engine time than one request may (`limit_s`): its work was stopped, and its session,
    if it was adapting one, stays as it was. The same request would take as long again."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"this request took more than {limit_s:g} s of the engine's time, the most one request may "
                         "take on this server (max_request_engine_s); send less work a request (a shorter text or "
                         "prompt, fewer prompts or choices, fewer max_tokens)")
        self.limit_s = limit_s


class SessionNotFound(LookupError):
    """No such session for this owner (never created, deleted, expired, evicted, or another key's)."""

    def __init__(self, session_id: str) -> None:
        session_id = public_id(session_id)  # a session stored under an alias (_idspace.py): as its owner knows it
        super().__init__(f"no session {session_id!r} (it may have expired or been evicted)")
        self.session_id = session_id


class SessionConflict(RuntimeError):
    """The session was changed by other work (another replica's, sharing the Redis store) after this work read it:
    this work's result was not written (`SessionStore.update`), so nothing of it was applied and it may be sent
    again, to continue from the session as the other work left it."""

    def __init__(self, session_id: str, retry_after_s: int = 1) -> None:
        session_id = public_id(session_id)
        super().__init__(f"session {session_id!r} was changed by another request meanwhile; nothing of this request "
                         "was applied: send it again")
        self.session_id = session_id
        self.retry_after_s = retry_after_s


class SessionStoreFull(RuntimeError):
    """The session store is at its limits and nothing can be evicted (every session has work in flight)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionStoreUnavailable(RuntimeError):
    """The session store cannot be reached (e.g. the Redis server is down); the caller may retry."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionImportError(ValueError):
    """An exported session that cannot be imported: `conflict` when it belongs to other weights, otherwise
    because it is not a valid export for this model."""

    def __init__(self, message: str, *, conflict: bool = False, param: str | None = None) -> None:
        super().__init__(message)
        self.conflict = conflict
        self.param = param


class InvalidSessionSettings(ValueError):
    """Adaptation settings or a TTL outside what this checkpoint and server allow; `param` names the setting
    (`lr`, `decay`, `adapter_size`, `cache_weight`, `ttl_s`), `code` says how it failed (`less_than_equal`, ...)."""

    def __init__(self, message: str, *, param: str, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class SessionsUnavailable(RuntimeError):
    """The checkpoint cannot adapt sessions (e.g. it has no adapter statistics for its update rule)."""


class ObserveApplied(Exception):
    """An observe's idempotency key was applied to the session already (its answer may have been lost: a 503 after
    the write landed): the work stops before reading any text, and the engine answers with `entry.answer`."""

    def __init__(self, entry: Any) -> None:
        super().__init__(f"the observe with idempotency key {entry.key!r} was applied already")
        self.entry = entry


class IdempotencyKeyReused(ValueError):
    """An idempotency key already applied to the session with another text: a client bug (a key names one
    request); nothing is applied."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the idempotency key {key!r} was used for another text on this session; a key names one "
                         "observe: send a new key with a new text")
        self.key = key
