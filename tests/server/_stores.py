"""Checks shared by the tests of both session stores (test_session_store.py, test_redis_store.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from server.engine import Session, SessionConflict, SessionStats, SessionStore


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
