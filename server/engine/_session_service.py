"""The session service: the one place that knows what a session may be on this checkpoint and server.

It resolves a session's settings from the checkpoint's defaults (each memory's, models/memory.py) and checks them
and the TTL against the limits; it makes fresh sessions and creates, resets, imports and exports them against the
store. The operations that write sessions run on the worker thread, in the session's turn; the settings and reads
may run anywhere. What a session does with text is the model layer's (`models.session.SessionModel`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from models.adaptation import DynEvalConfig
from models.checkpoint import Checkpoint
from models.memory import MemorySettingsError, SessionConfig, weight_learner
from models.session import Observed, SessionModel
from server.engine._errors import (
    EngineUnavailable,
    IdempotencyKeyReused,
    InvalidSessionSettings,
    ObserveApplied,
    SessionNotFound,
    SessionStoreFull,
    SessionsUnavailable,
)
from server.engine._export import export_session, import_session
from server.engine._idspace import alias_of, is_alias
from server.engine._loading import SessionLimits
from server.engine._session import Applied, KeyedSession, Session, applied_of, keyed, text_digest
from server.engine._store import SessionStore

__all__ = ["SessionService"]

_ROUTES_KEPT = 4096  # the aliases `resolve` and `get` found last (for `route`, which reads no store)


class SessionService:
    def __init__(self, store: SessionStore, *, ttl_s: float, max_ttl_s: float, retry_after_s: int) -> None:
        self.store = store
        self._ttl_s, self._max_ttl_s, self._retry_after_s = ttl_s, max_ttl_s, retry_after_s
        self._ckpt: Checkpoint | None = None
        self._limits: SessionLimits | None = None
        self._why = ""
        self.base: DynEvalConfig | None = None  # the checkpoint's sparse settings, which the rules derive from
        self._model: SessionModel | None = None
        self._routes: OrderedDict[tuple[str, str], str] = OrderedDict()  # (public id, owner) -> alias
        self._routes_lock = threading.Lock()

    def load(self, ckpt: Checkpoint, limits: SessionLimits | None, why: str, base: DynEvalConfig | None) -> None:
        """The checkpoint is loaded: bind the store to it (the store may restore its sessions now)."""
        self._ckpt, self._limits, self._why, self.base = ckpt, limits, why, base
        self._model = _AnsweringModel.of(ckpt, None if limits is not None else {})
        learner = weight_learner(self._model.memories)
        if limits is not None and learner is not None:
            self._limits = dataclasses.replace(limits, learner=learner)
        for memory in self._model.memories.values():
            memory.warm_up(ckpt.device)  # kernels compile here, not in the first request
        self.store.bind(ckpt.model_hash, self.template(), self._model)

    # -- settings --------------------------------------------------------------------------------------

    @property
    def model(self) -> SessionModel:
        """The checkpoint's sessions' model (models.session.SessionModel)."""
        if self._model is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._model

    def session_model(self) -> Any:
        """The model that sampling and the keyboard search run (one object, so that all generations batch): the
        network, mixed with each row's session's memories."""
        return self.model.search_model

    def view_state(self, session: Session) -> Any:
        """The state sampling and the keyboard search continue `session` from (`SessionModel.view_state`)."""
        return self.model.view_state(session)

    def limits(self) -> SessionLimits:
        """The checkpoint's session settings; raises SessionsUnavailable if it cannot adapt sessions."""
        if self._ckpt is None:
            raise EngineUnavailable("the engine has not loaded a model")
        if self._limits is None:
            raise SessionsUnavailable(self._why)
        return self._limits

    def config(self, memories: Mapping[str, Mapping[str, Any] | None] | None = None) -> SessionConfig:
        """The checkpoint's defaults with `memories` applied (name -> settings, None: off), checked
        (InvalidSessionSettings, its `param` the setting's path under `memories`)."""
        self.limits()
        try:
            return self.model.config(memories)
        except MemorySettingsError as e:
            raise InvalidSessionSettings(str(e), param=f"{e.memory}.{e.param}" if e.param else e.memory,
                                         code=e.code) from None

    def ttl(self, ttl_s: float | None) -> float:
        """The server's default TTL for None; a TTL above the server's longest raises InvalidSessionSettings."""
        if ttl_s is None:
            return self._ttl_s
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise InvalidSessionSettings("Input should be a finite number greater than 0", param="ttl_s",
                                         code="greater_than")
        if ttl_s > self._max_ttl_s:
            raise _over(self._max_ttl_s, "ttl_s")
        return ttl_s

    # -- ids (_idspace.py) ------------------------------------------------------------------------------

    def resolve(self, session_id: str, owner: str | None) -> str:
        """The stored id of `owner`'s session `session_id`, for work that takes the session's turn (what it is
        submitted with, so that its turn, pins and record are the stored one's): the alias if `owner` has one there
        (another owner's session held the id when `owner` imported onto it), else the id itself. One store read
        (whether the alias exists), none without an owner (no API keys: one id space)."""
        if owner is None:
            return session_id
        alias = alias_of(session_id, owner)
        # at most one of the two is `owner`'s (`load_export` writes the alias only while another owner holds the
        # id, and the id only while `owner` has no alias there), so looking for the alias is enough
        found = self.store.contains(alias)
        self._remember(session_id, owner, alias if found else None)
        return alias if found else session_id

    def route(self, session_id: str, owner: str | None) -> str:
        """`resolve` without reading the store, for a caller on the event loop that has just looked the session up
        (`get`): the alias that look-up found, else the id (`get` would still find an alias it was not told of)."""
        if owner is None:
            return session_id
        with self._routes_lock:
            return self._routes.get((session_id, owner), session_id)

    def _remember(self, session_id: str, owner: str, alias: str | None) -> None:
        with self._routes_lock:
            if alias is None:
                self._routes.pop((session_id, owner), None)
                return
            self._routes[session_id, owner] = alias
            self._routes.move_to_end((session_id, owner))
            while len(self._routes) > _ROUTES_KEPT:
                self._routes.popitem(last=False)

    # -- records ---------------------------------------------------------------------------------------

    def _checkpoint(self) -> Checkpoint:
        if self._ckpt is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._ckpt

    def fresh(self, session_id: str, owner: str | None, ttl_s: float, config: SessionConfig) -> Session:
        """A session at the start (`SessionModel.fresh`)."""
        return self.model.fresh(config, id=session_id, owner=owner, ttl_s=ttl_s)

    def template(self) -> Session:
        """A fresh session of this model, for a store to read sessions back into (its id, owner, clock times)."""
        return dataclasses.replace(self.fresh("", None, self._ttl_s, SessionConfig()), created=0.0, last_used=0.0)

    def get(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session:
        """The session's last committed record (work in flight is not in it yet), by its id or its stored id
        (`resolve`): an id that is not `owner`'s finds `owner`'s alias there (a second read, on a miss only)."""
        session = self.store.get(session_id, owner, touch=touch)
        if owner is not None and not is_alias(session_id):
            if session is None:
                session = self.store.get(alias_of(session_id, owner), owner, touch=touch)
            self._remember(session_id, owner, session.id if session is not None and is_alias(session.id) else None)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def observing(self, session_id: str, owner: str | None, key: str, data: bytes) -> KeyedSession:
        """(Worker, in the session's turn.) The record an observe of `data` under idempotency `key` starts from,
        carrying the key for the store's write; raises ObserveApplied (with the first answer) if the key was
        applied already, IdempotencyKeyReused if it was applied to another text."""
        session = self.get(session_id, owner)
        digest = text_digest(data)
        for entry in applied_of(session):
            if entry.key == key:
                if entry.digest != digest:
                    raise IdempotencyKeyReused(key)
                raise ObserveApplied(entry)
        return keyed(session, applied=applied_of(session), observing=Applied(key, digest))

    def delete(self, session_id: str, owner: str | None) -> None:
        """Delete `owner`'s session of that id (its alias, if another owner's holds the id: a second store call)."""
        if not self.store.delete(session_id, owner) and (
                owner is None or is_alias(session_id) or not self.store.delete(alias_of(session_id, owner), owner)):
            raise SessionNotFound(session_id)

    def export(self, session_id: str, owner: str | None) -> bytes:
        model_hash = self._checkpoint().model_hash
        return export_session(self.get(session_id, owner), model_hash, self.model)

    def create(self, session_id: str, owner: str | None, ttl_s: float, config: SessionConfig) -> Session:
        """(Worker.) Store a fresh session. -> the stored record (its revision is what work on it updates)."""
        return self._insert(self.fresh(session_id, owner, ttl_s, config))

    def reset(self, session_id: str, owner: str | None) -> Session:
        """(Worker.) Back to the start, keeping its id, owner, creation time, config and TTL; SessionConflict if
        another server changed it between the read and the write (a reset then would undo that change unseen)."""
        old = self.get(session_id, owner)
        session = dataclasses.replace(self.fresh(session_id, owner, old.ttl_s, old.config), created=old.created,
                                      revision=old.revision)
        stored = self.store.update(session)
        if stored is None:
            raise SessionNotFound(session_id)
        return stored

    def load_export(self, session_id: str, owner: str | None, blob: bytes) -> Session:
        """(Worker.) Create or replace the session of stored id `session_id` (`resolve`) from an export; its TTL is
        cut to the server's longest. An id that another owner's session holds is not ours to replace, nor to
        reveal: the session goes to `owner`'s alias (_idspace.py), as it would to a free id."""
        if self.store.get(session_id, owner, touch=False) is None and self.store.contains(session_id):
            if owner is None or is_alias(session_id):  # (an alias of another owner: two owners' tags alike)
                raise SessionNotFound(session_id)
            session_id = alias_of(session_id, owner)  # (`resolve` found no alias: this import makes it)
        template = self.fresh(session_id, owner, self._ttl_s, SessionConfig())
        session, _ = import_session(blob, model_hash=self._checkpoint().model_hash, template=template,
                                    sessions=self.model)
        session = dataclasses.replace(session, ttl_s=min(session.ttl_s, self._max_ttl_s))
        return self._insert(session)

    def _insert(self, session: Session) -> Session:
        try:
            return self.store.insert(session)
        except SessionStoreFull as e:
            e.retry_after_s = self._retry_after_s
            raise


class _AnsweringModel(SessionModel):
    """The sessions' model, whose record after an observe under an idempotency key carries that observe's answer
    (`KeyedSession.observing`), for the store to keep with the key: a retry of it then answers as it did. The
    answer is the one the text executor gives (server/engine/_text.py, `TextScore`), made from the same values."""

    def observed(self, old: Session, text: Observed, bits: float, static_bits: float, now: float | None = None,
                 ) -> Session:
        new = super().observed(old, text, bits, static_bits, now)
        if not isinstance(new, KeyedSession) or new.observing is None:
            return new
        main = text.job.rows[0]
        answer = {"bits": bits, "bytes": len(text.scored), "static_bits": static_bits,
                  "updates": main.updates, "nonfinite_reset": bool(main.dropped or main.resets),
                  "tokens": sum(int(lp.numel()) for lp in main.logprobs), "pending_bytes": len(text.pending)}
        return dataclasses.replace(new, observing=dataclasses.replace(new.observing, answer=answer))


def _over(limit: float, param: str) -> InvalidSessionSettings:
    return InvalidSessionSettings(f"Input should be less than or equal to {limit} (this server's limit)",
                                  param=param, code="less_than_equal")
