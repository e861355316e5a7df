"""A keystroke takes up what the session's last suggestion computed (server/engine/_suggest.py, models/suggest.py
`WordSearch`'s `known`): over many keystrokes (letters, spaces, punctuation, a non-ASCII letter, backspaces, a
completion taken, an observe between), the suggestions are those of a search from scratch, with fewer model rows.

Tolerance: the rows a reused search reads were computed in other batches than a search from scratch would compute
them (other rows beside them, another batch size), which may change a float32 sum's rounding in the last bits (as
two typists batched together against one alone: tests/server/test_suggest.py). A completion's probability is a
product of at most 25 such rows' probabilities: relative 1e-5 leaves two orders of magnitude above that. Where
two completions' probabilities are that close, their order, or which of them is the k-th, may differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from bench._common import DEFAULT_CHECKPOINT
from models.adaptation import AdapterSettings
from models.base import State
from models.char_transformer import CharTransformer, CharTransformerConfig
from models.checkpoint import load_checkpoint
from models.compressive import CompressiveConfig, CompressiveTransformer
from models.memory import SessionConfig
from models.session import Session, SessionModel
from models.suggest import SUGGEST_MIN_PROB, Suggestions
from models.tokenizer import ByteTokenizer
from server.engine._suggest import CursorCache, SuggestJob, SuggestRounds

REL = 1e-5
HISTORY = ("Dear Anna, thanks for the notes on the garden. The roses are late this year; the tulips are early. "
           "I will send the photos tomorrow morning.\n")
# what the typist does: a character typed; "<" a backspace; "+word " a completion taken (the rest of the word and a
# space at once); "|" an observe of the message so far (the session's record changes)
SHORT = "Can we mee<et on Fri+Friday ?| See you the<ere."  # the shipped model's (a keystroke costs more)
SCRIPT = "Thanks for the photos! Can we mee<et at the café on Fri+Friday ?| See you the<ere (at ten)."


def keystrokes(script: str) -> list[tuple[str, bool]]:
    """-> (the context after each keystroke, whether the session observes the message before it)."""
    out: list[tuple[str, bool]] = []
    text, observe, i = "", False, 0
    while i < len(script):
        ch = script[i]
        if ch == "|":
            observe = True
            i += 1
            continue
        if ch == "<":
            text = text[:-1]
        elif ch == "+":
            end = script.index(" ", i) + 1
            text += script[i + 1 : end]
            i = end - 1
        else:
            text += ch
        out.append((text, observe))
        observe = False
        i += 1
    return out


def run(rounds: SuggestRounds, session: Session, context: str) -> Suggestions:
    job = SuggestJob(session, context, 3, 24, 5)
    rounds.start([job])
    while rounds.active:
        rounds.round()
    assert job.result is not None, job.error
    return job.result


def same(got: Suggestions, want: Suggestions) -> None:
    """The same suggestions, probabilities within REL; completions whose probabilities are within REL of each
    other may trade places (or the k-th place)."""
    assert got.prefix == want.prefix and got.exact == want.exact
    pairs = [([((c.text, c.space_before), c.prob) for c in got.completions],
              [((c.text, c.space_before), c.prob) for c in want.completions]),
             ([((c.char, False), c.prob) for c in got.next_chars],
              [((c.char, False), c.prob) for c in want.next_chars])]
    for a, b in pairs:
        assert len(a) == len(b)
        wanted = dict(b)
        for (name, p), (_, q) in zip(a, b, strict=True):
            assert p == pytest.approx(q, rel=REL), (a, b)  # the same probabilities in the same order
            if name in wanted:
                assert p == pytest.approx(wanted[name], rel=REL)
            else:  # another word, as probable as the one from scratch (a tie within the rounding)
                assert any(p == pytest.approx(r, rel=REL) for r in wanted.values()), (a, b)


def typed(served: SessionModel, model: Any, script: str = SCRIPT, session: Session | None = None
          ) -> tuple[tuple[int, int], tuple[int, int], int]:
    """Type `script` with reuse and from scratch, comparing each keystroke -> ((model rows, steps) with reuse, the same
    from scratch, keystrokes whose search read rows of the last)."""
    if session is None:
        session = served.observe(served.fresh(served.config(), id="s"), HISTORY.encode())

    def rounds(cache: CursorCache) -> SuggestRounds:
        return SuggestRounds(model, cache, min_prob=SUGGEST_MIN_PROB, batch=8, max_expansions=2048, round_rows=128)

    cache = CursorCache(model=served if served.memories else None)
    reusing = rounds(cache)
    rows = steps = scratch_rows = scratch_steps = reused_keys = 0
    start = 0
    for context, observe in keystrokes(script):
        if observe:
            # without memories to observe with (a bare model), another record: another next byte
            session = served.observe(session, context[start:].encode()) if served.memories else \
                dataclasses.replace(session, last_token=ord(" "))
            start = len(context)
        message = context[start:]
        got = run(reusing, session, message)
        want = run(rounds(CursorCache(model=cache.model)), session, message)
        same(got, want)
        assert want.reused == 0 and got.expansions == want.expansions  # the same branches, fewer of them fed
        if observe:
            assert got.reused == 0  # another record: nothing of the last search is read
        rows += got.expansions - got.reused
        steps += got.model_calls
        scratch_rows += want.expansions
        scratch_steps += want.model_calls
        reused_keys += got.reused > 0
    return (rows, steps), (scratch_rows, scratch_steps), reused_keys


@pytest.mark.parametrize("copy", [False, True], ids=["network", "copy-model"])
def test_keystrokes_reuse_the_last_search_exactly(copy: bool, tiny_checkpoint: Path, copy_checkpoint: Path) -> None:
    """The tiny checkpoint (a network that predicts little: short searches, few of them under the next letter)."""
    served = SessionModel.of(load_checkpoint(copy_checkpoint if copy else tiny_checkpoint))
    assert ("copy" in served.memories) == copy
    got, scratch, reused_keys = typed(served, served.search_model)
    assert reused_keys > 0 and got[0] < scratch[0] and got[1] <= scratch[1], (got, scratch, reused_keys)


def test_the_shipped_model_s_keystrokes_reuse_most_of_the_last_search() -> None:
    """The default checkpoint (its copy model and word cache on, as served): a model that predicts the next letters
    well, so that the search under the letter typed was mostly expanded the keystroke before."""
    served = SessionModel.of(load_checkpoint(DEFAULT_CHECKPOINT))
    assert "copy" in served.memories
    got, scratch, reused_keys = typed(served, served.search_model, SHORT)
    assert reused_keys >= len(keystrokes(SHORT)) // 3, reused_keys
    assert got[0] <= 0.9 * scratch[0] and got[1] < scratch[1], (got, scratch)


@pytest.mark.parametrize("arch", ["char-transformer", "compressive"])
def test_a_transformer_s_keystrokes_reuse_rows_of_its_branch_form(arch: str) -> None:
    """A transformer searches in its branch form (rows on the search's root): a keystroke's search stacks the last
    search's rows (on the last root) with its own (on its root), across the window slide and the segment end."""
    torch.manual_seed(0)
    model: Any = (CompressiveTransformer(CompressiveConfig(d_model=16, n_layer=2, n_head=2, d_ff=32, segment=12,
                                                           mem_len=12, cmem_len=4, rate=3))
                  if arch == "compressive" else
                  CharTransformer(CharTransformerConfig(d_model=16, n_layer=2, n_head=2, d_ff=32, context=24)))
    with torch.no_grad():  # a sharper next-byte distribution than at initialisation: searches a few bytes deep
        model.head.weight.mul_(8.0)
    model.freeze()
    served = SessionModel(model, ByteTokenizer(), {})
    adapter = {"adapter": AdapterSettings(lr=0.0, decay=0.0, size=4)}
    session = Session(id="s", owner=None, created=0.0, last_used=0.0, ttl_s=60.0, config=SessionConfig(adapter),
                      state=model.init_state(1), static_state=model.init_state(1), last_token=ord("\n"),
                      memories={"adapter": State({"resid": 0.1 * torch.ones(1, 4, 4)})})
    got, scratch, reused_keys = typed(served, model, "We mee<et on Fri+Friday ?| Yes, the<ere.", session)
    assert reused_keys > 0 and got[0] < scratch[0], (got, scratch, reused_keys)
