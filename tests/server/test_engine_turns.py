"""The engine's work that takes a session's turn (a session's score, a keyed observe, reset, import): on a checkpoint
that cannot adapt sessions each is refused with SessionsUnavailable before its id is looked at or the store read;
a session created with initial text comes back as stored, having observed it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from server.engine import Engine, SessionNotFound, SessionsUnavailable
from server.engine._idspace import alias_of

TEXT = b"It is a truth universally acknowledged, that a single man in possession of a good fortune. "


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Engine]:
    e = Engine(tiny_checkpoint, thread_name="engine-turns")
    e.start()
    yield e
    e.stop()


def _turns(engine: Engine, name: str, owner: str | None) -> list[Callable[[], Coroutine[Any, Any, Any]]]:
    return [lambda: engine.score(TEXT, session_id=name, owner=owner),
            lambda: engine.score(TEXT, session_id=name, owner=owner, adapt=True),
            lambda: engine.observe(TEXT, session_id=name, owner=owner, idempotency_key="key-1"),
            lambda: engine.reset_session(name, owner),
            lambda: engine.import_session(name, owner, b"not an export")]


def test_work_in_a_sessions_turn_is_refused_first_where_sessions_are_unavailable(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    name = alias_of("abc", "someone")  # no name of a session: SessionNotFound, where sessions are available
    for work in _turns(engine, name, "key-a"):
        with pytest.raises(SessionNotFound):
            asyncio.run(work())

    def unread(*args: object, **kwargs: object) -> None:
        raise AssertionError("the store was read")

    monkeypatch.setattr(engine.sessions, "_limits", None)
    monkeypatch.setattr(engine.sessions, "_why", "no adapter statistics here")
    monkeypatch.setattr(engine.store, "contains", unread)
    monkeypatch.setattr(engine.store, "get", unread)
    for owner in (None, "key-a"):
        for session_id in (name, "abc"):
            for work in _turns(engine, session_id, owner):
                with pytest.raises(SessionsUnavailable, match="no adapter statistics here"):
                    asyncio.run(work())
    assert engine.alive


def test_a_session_created_with_text_is_answered_as_stored(engine: Engine) -> None:
    session, scored = asyncio.run(engine.create_session(owner="key-a", initial_text=TEXT))
    assert scored is not None and scored.bytes == len(TEXT)
    assert session.owner == "key-a" and session.stats.bytes_observed == len(TEXT)
    stored = engine.get_session(session.id, "key-a", touch=False)
    assert (stored.id, stored.owner, stored.revision, stored.stats) == (session.id, "key-a", session.revision,
                                                                       session.stats)
    with pytest.raises(SessionNotFound):
        engine.get_session(session.id, "key-b")
