"""Keyboard suggestions on the worker: a cache of cursors (the model after a session's text and a context), so
that a keystroke feeds only the bytes it added (or, after a backspace, the few since a cached context).

Suggestions run on every keystroke: feeding the whole context again each time would cost one model step per
byte typed so far. The cache keeps, per session, the cursors of its last few contexts and continues from the
longest one that the new context extends. A cursor is valid only for the session record it was made from:
an observe, reset or import changes the state (or adapter, or next byte) and the session's cursors are dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from models.base import LanguageModel
from models.suggest import Cursor, Suggestions, advance
from server.engine._sessions import Session

__all__ = ["CursorCache", "Suggestions"]


def _same_record(a: Session, b: Session) -> bool:
    """Do two records of a session hold the same state, next byte and adapter? (A store that serialises
    sessions returns new tensors on every read, so identity is not enough.)"""
    if a is b:
        return True
    if a.last_byte != b.last_byte or a.state.tensors.keys() != b.state.tensors.keys() \
            or a.adapter.mats.keys() != b.adapter.mats.keys():
        return False
    pairs = [(a.state.tensors[k], b.state.tensors[k]) for k in a.state.tensors]
    pairs += [(a.adapter.mats[k], b.adapter.mats[k]) for k in a.adapter.mats]
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)


@dataclass(eq=False)
class _Entry:
    session: Session  # the record the cursors continue
    cursors: OrderedDict[bytes, Cursor] = field(default_factory=OrderedDict)  # inputs -> cursor, oldest first


class CursorCache:
    """Worker-thread only. At most `sessions` sessions, `per_session` cursors each (least recently used go)."""

    def __init__(self, sessions: int = 256, per_session: int = 8) -> None:
        self.sessions = sessions
        self.per_session = per_session
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.fed = 0  # bytes fed to the model

    def cursor(self, model: LanguageModel, session: Session, context: bytes) -> Cursor:
        """The model after the session's text and `context` (the session's next byte, then the context)."""
        inputs = bytes([session.last_byte]) + context
        entry = self._entries.get(session.id)
        if entry is None or not _same_record(entry.session, session):
            entry = _Entry(session)
            self._entries[session.id] = entry
        self._entries.move_to_end(session.id)
        while len(self._entries) > self.sessions:
            self._entries.popitem(last=False)
        base = max((key for key in entry.cursors if inputs.startswith(key)), key=len, default=b"")
        if base == inputs:
            cursor = entry.cursors[base]
        elif base:
            self.fed += len(inputs) - len(base)
            cursor = advance(model, entry.cursors[base].state, inputs[len(base):], session.adapter)
        else:
            self.fed += len(inputs)
            cursor = advance(model, session.state, inputs, session.adapter)
        entry.cursors[inputs] = cursor
        entry.cursors.move_to_end(inputs)
        while len(entry.cursors) > self.per_session:
            entry.cursors.popitem(last=False)
        return cursor

    def drop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)
