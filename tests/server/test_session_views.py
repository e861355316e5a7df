"""A record's search views of its memories (`SessionModel.adapter`, kept in `Session._views`) are its own.

`dataclasses.replace` hands a record's views on to the record it makes, and a store that reads every session back
from a blob (Redis without its per-replica cache) makes every record by replacing one template. A keystroke searched
before an observe must not leave its views of the session's copy model for the searches after it: those read the
observed record's copy model, as a search with nothing cached does (the reference, on the record the observe made in
this process)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from models.checkpoint import load_checkpoint
from models.session import Session, SessionModel
from models.suggest import SUGGEST_MIN_PROB, Suggestions
from server.engine import RedisSessionStore
from server.engine._suggest import CursorCache, SuggestRounds
from tests.server.test_suggest_reuse import run, same

# a word the tiny network cannot know, three times: only the session's copy model predicts it after its prefix
TEXT = "Meet me at the zorbly gate. The zorbly gate is north. See you at the zorbly gate.\n"
CONTEXT = "See you at the zor"


def suggest(served: SessionModel, cache: CursorCache, session: Session, context: str) -> Suggestions:
    rounds = SuggestRounds(served.search_model, cache, min_prob=SUGGEST_MIN_PROB, batch=8, max_expansions=2048,
                           round_rows=128)
    return run(rounds, session, context)


def through_redis(served: SessionModel, model_hash: str, url: str) -> Callable[[Callable[[Session], None]], Session]:
    """The session read back from a Redis store without its cache (a blob imported on every read), after a keystroke
    on the fresh record and an observe of TEXT."""
    template = dataclasses.replace(served.fresh(served.config()), created=0.0, last_used=0.0)  # as the server binds
    store = RedisSessionStore(url, max_sessions=10, max_bytes=10**9, cache_bytes=0)
    store.bind(model_hash, template, served)

    def after(keystroke: Callable[[Session], None]) -> Session:
        try:
            store.insert(served.fresh(served.config(), id="s", ttl_s=600.0, now=time.time()))
            before = store.get("s", None)
            assert before is not None
            keystroke(before)
            assert store.update(served.observe(before, TEXT.encode())) is not None
            read = store.get("s", None)
            assert read is not None
            return read
        finally:
            store.close()
    return after


def by_replace(served: SessionModel) -> Callable[[Callable[[Session], None]], Session]:
    """The observed record made by `dataclasses.replace` of a fresh one that a keystroke searched (as a store's touch
    or revision makes one), with the observed record's state and memories."""
    def after(keystroke: Callable[[Session], None]) -> Session:
        fresh = served.fresh(served.config(), id="s")
        keystroke(fresh)
        observed = served.observe(fresh, TEXT.encode())
        return dataclasses.replace(fresh, state=observed.state, static_state=observed.static_state,
                                   last_token=observed.last_token, memories=observed.memories)
    return after


@pytest.mark.parametrize("path", ["redis-without-cache", "replace"])
def test_suggestions_after_an_observe_read_the_record_s_own_copy_model(
        path: str, copy_checkpoint: Path, redis_url: str) -> None:
    ckpt = load_checkpoint(copy_checkpoint)
    served = SessionModel.of(ckpt)
    assert "copy" in served.memories
    make = through_redis(served, ckpt.model_hash, redis_url) if path == "redis-without-cache" else by_replace(served)
    cache = CursorCache(model=served)  # the worker's: it lives across the keystrokes and the observe
    first: list[Suggestions] = []
    session = make(lambda record: first.append(suggest(served, cache, record, CONTEXT[:1])))

    want = suggest(served, CursorCache(model=served), served.observe(served.fresh(served.config(), id="s"),
                                                                     TEXT.encode()), CONTEXT)
    # the copy model decides the answer (else this test could not tell the views apart)
    unobserved = suggest(served, CursorCache(model=served), served.fresh(served.config(), id="s"), CONTEXT)
    assert want.completions[0].text == "zorbly", want.completions
    assert [c.text for c in unobserved.completions][:1] != ["zorbly"], unobserved.completions
    same(suggest(served, cache, session, CONTEXT), want)
