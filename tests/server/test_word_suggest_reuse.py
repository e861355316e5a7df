"""A word model's keystroke continues from what the last one fed (server/engine/_suggest.py `WordStateCache`,
models/word_suggest.py `word_suggestions`' `states`): over many keystrokes (letters, spaces, punctuation, a non-ASCII
word, backspaces, a completion taken, an observe between), the suggestions are those from scratch, with the session's
neural cache (the word model's copy model) and word cache on and off, and a letter within a word runs no model step.

Tolerance: a state kept from an earlier keystroke was computed in a forward of other length than the one from
scratch (its last words fed alone, not with all before them), which may change a float32 matmul's rounding in the
last bits, and a probability is a softmax entry divided by a sum of them: on the fixture's LSTM the probabilities
differ by at most 9e-7 relative (relative 1e-5, `same`'s, leaves ten times that; the shipped transformer, three layers
and a window that slides, reaches 9e-6 over a long message). Where two words' probabilities are that close, their
order (or which is the k-th) may differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from models.base import State
from models.checkpoint import load_checkpoint
from models.session import Session, SessionModel
from models.suggest import Suggestions
from models.word_suggest import word_suggestions
from models.word_tokenizer import WordTokenizer
from server.engine._suggest import WordStateCache
from tests.server.test_suggest_reuse import keystrokes, same

HISTORY = ("Dear Anna, thanks for the notes on the garden. The roses are late this year; the tulips are early. "
           "I will send the photos tomorrow morning.\n")
# a character typed; "<" a backspace; "+word " a completion taken; "|" an observe of the message so far
SCRIPT = "Thanks for the photos! Can we mee<et at the café on Fri+Friday ?| See you the<ere (at ten), ok<<k."


def copied(session: Session) -> Session:
    """The record as a store that serialises sessions hands it back: the same values in new tensors."""
    return dataclasses.replace(session, state=State({k: v.clone() for k, v in session.state.tensors.items()}),
                               memories={k: State({n: t.clone() for n, t in v.tensors.items()})
                                         if isinstance(v, State) else v for k, v in session.memories.items()})


@pytest.mark.parametrize("asked", [{"words": None}, {"cache": {}, "words": None}, {"cache": {}}],
                         ids=["network", "neural-cache", "neural-cache+word-cache"])
def test_word_keystrokes_continue_from_the_last_exactly(asked: dict[str, Any], word_checkpoint: Path) -> None:
    ck = load_checkpoint(word_checkpoint)
    served, tokenizer = SessionModel.of(ck), ck.tokenizer
    assert isinstance(tokenizer, WordTokenizer)
    config = served.config(asked)
    assert ("cache" in config.memories) == ("cache" in asked) and ("words" in config.memories) == ("words" not in asked)
    session = served.observe(served.fresh(config, id="s"), HISTORY.encode())
    forwards = [0]
    hook = served.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    states = WordStateCache()

    def suggest(record: Session, context: str, cache: WordStateCache | None) -> tuple[Suggestions, int]:
        before = forwards[0]
        found = word_suggestions(served.search_model, tokenizer, record, context, k=3, n_chars=5, max_chars=24,
                                 sessions=served, states=cache)
        return found, forwards[0] - before

    try:
        start, free_letters, kept, scratch = 0, 0, 0, 0
        for i, (context, observe) in enumerate(keystrokes(SCRIPT)):
            if observe:
                session = served.observe(session, context[start:].encode())
                start = len(context)
            message = context[start:]
            record = copied(session) if i % 2 else session  # a store's copy, or the same record
            got, ran = suggest(record, message, states)
            want, ran_scratch = suggest(record, message, None)
            same(got, want)
            assert got.model_calls == ran and want.model_calls == ran_scratch >= 1 and want.reused == 0
            assert got.reused + ran == ran_scratch  # each step either read or run
            if observe:
                assert got.reused == 0  # another record: nothing the last keystroke fed is read
            kept += ran
            scratch += ran_scratch
            letter = message[-1:].isalpha() and message[-2:-1].isalpha()
            free_letters += letter and ran == 0
        letters = sum(c[-1:].isalpha() and c[-2:-1].isalpha() for c, _ in keystrokes(SCRIPT))
        # within a word, a letter reads the distribution after the words before it (but where a backspace or an
        # observe left no state, or the letters so far are a word: its next step, after a space, is kept)
        assert free_letters >= letters // 2, (free_letters, letters)
        assert kept <= scratch // 2, (kept, scratch)
    finally:
        hook.remove()


def test_a_record_change_and_the_bounds_drop_kept_states(word_checkpoint: Path) -> None:
    """Kept states are the record's: an observe (another state) finds none; per session and sessions are bounded."""
    ck = load_checkpoint(word_checkpoint)
    served = SessionModel.of(ck)
    session = served.observe(served.fresh(served.config({"words": None}), id="s"), HISTORY.encode())
    states = WordStateCache(sessions=2, per_session=2)
    ids = [session.last_token, *ck.tokenizer.encode(b" Thanks for the")]
    logprobs = torch.zeros(ck.tokenizer.vocab_size)
    states.put(session, ids, session.state, logprobs)
    assert states.longest(copied(session), [*ids, 7])[0] == len(ids)  # the same values: the same record
    assert states.longest(session, ids[:-1])[0] == 0  # a shorter run was never fed
    states.put(session, ids[:2], session.state, logprobs)
    states.put(session, ids[:3], session.state, logprobs)  # the third run: the oldest goes
    assert states.longest(session, ids)[0] == 3
    other = served.config({"cache": {}, "words": None})  # a session made again under the id, a neural cache asked
    assert states.longest(dataclasses.replace(session, config=other), ids)[0] == 0  # the same tensors: another session
    states.put(session, ids, session.state, logprobs)
    after = served.observe(session, b" Thanks for the photos")
    assert states.longest(after, ids)[0] == 0  # another record: what the old one fed is dropped
    assert states.longest(session, ids)[0] == 0
    for name in "abc":
        states.put(dataclasses.replace(session, id=name), ids, session.state, logprobs)
    assert states.longest(dataclasses.replace(session, id="a"), ids)[0] == 0  # the least recent session went
    assert states.longest(dataclasses.replace(session, id="c"), ids)[0] == len(ids)
