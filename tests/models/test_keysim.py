"""In-process suggestions for the keystroke simulator (models/keysim.py): against `models.suggest` from scratch,
the cursor cache's work, and the adaptation against `models.adaptation.evaluate` on the same text (sparse and
full dynamic evaluation are the same loop: one stream from BOS, segments scored then updated)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from models.adaptation import evaluate
from models.checkpoint import load_checkpoint
from models.keysim import ModelSuggester
from models.scoring import BOS
from models.suggest import advance, suggest
from trainer.evaluation import config_for

TEXT = "It is a truth universally acknowledged, that a single man\n"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    return load_checkpoint(tiny_checkpoint)


def words_from_scratch(model, context: str, observed: str = "", adapter=None, state=None):  # type: ignore[no-untyped-def]
    state = model.init_state(1) if state is None else state
    cursor = advance(model, state, bytes([BOS]) + (observed + context).encode(), adapter)
    return [c.text for c in suggest(model, cursor, observed + context, adapter, k=3, n_chars=0).completions]


def test_static_suggestions_equal_a_fresh_computation_and_feed_only_new_bytes(ckpt) -> None:  # type: ignore[no-untyped-def]
    s = ModelSuggester(ckpt.model)
    s.observe(TEXT)
    fed = 0
    for end in range(0, 12):
        context = "The man wen"[:end]
        assert s.suggest(context, 3) == words_from_scratch(ckpt.model, context, TEXT)
        fed += 1  # the first call feeds the next byte (the text's last); each later one its new character
        assert s.fed == fed
    s.suggest("The man went", 3)  # several characters at once (a selection): only those
    assert s.fed == fed + 1
    s.suggest("A", 3)  # not a continuation: from the state again (the next byte and the context)
    assert s.fed == fed + 1 + 2


def test_sparse_adaptation_is_the_sessions_loop(ckpt) -> None:  # type: ignore[no-untyped-def]
    config = config_for("sparse", ckpt.dyneval)
    s = ModelSuggester(ckpt.model, config, stats=ckpt.stats)
    s.observe(TEXT)
    ref = evaluate(ckpt.model, TEXT.encode(), config, stats=ckpt.stats)  # BOS, then the text; the same segments
    assert s.updates == ref.bytes // config.segment + (ref.bytes % config.segment > 0)
    assert s.adapter is not None
    for site, m in s.adapter.mats.items():
        torch.testing.assert_close(m[0], ref.adapted[site])
        assert m.abs().sum() > 0
    for k, v in s.state.tensors.items():
        torch.testing.assert_close(v, ref.state.tensors[k])
    # suggestions under the adapter: the adapted state, the text's last byte next, then the context
    cursor = advance(ckpt.model, s.state, bytes([TEXT.encode()[-1]]) + b"Th", s.adapter)
    expected = [c.text for c in suggest(ckpt.model, cursor, "Th", s.adapter, k=3, n_chars=0).completions]
    assert s.suggest("Th", 3) == expected


def test_full_dynamic_evaluation_suggests_from_the_adapted_weights(ckpt) -> None:  # type: ignore[no-untyped-def]
    config = config_for("dynamic", ckpt.dyneval, lr=3e-3)  # a large step: the weights visibly move
    before = {n: p.detach().clone() for n, p in ckpt.model.named_parameters()}
    s = ModelSuggester(ckpt.model, config, stats=ckpt.stats)
    cut = 2 * config.segment  # messages cut on a segment boundary: the same segments as one text
    s.observe(TEXT[:cut])
    s.observe(TEXT[cut:])  # continues from where the first message left off
    ref = evaluate(ckpt.model, TEXT.encode(), config, stats=ckpt.stats)
    for name, p in ref.adapted.items():
        torch.testing.assert_close(s.params[name], p, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(s.params[n], before[n]) for n in s.params)
    for name, p in ckpt.model.named_parameters():  # the shared model was never written
        assert torch.equal(p.detach(), before[name])
    # suggestions equal those of a copy of the model holding the adapted weights
    adapted = copy.deepcopy(ckpt.model)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            p.copy_(s.params.get(name, p))
    for context in ("", "Th", "The ma"):
        cursor = advance(adapted, s.state, bytes([TEXT.encode()[-1]]) + context.encode())
        expected = [c.text for c in suggest(adapted, cursor, context, k=3, n_chars=0).completions]
        assert s.suggest(context, 3) == expected


def test_the_word_cache_is_mixed_in_as_a_session_mixes_it(ckpt) -> None:  # type: ignore[no-untyped-def]
    from models.wordcache import WordCache

    plain, cached = ModelSuggester(ckpt.model), ModelSuggester(ckpt.model, cache_weight=0.5)
    for s in (plain, cached):
        s.observe(TEXT)
        s.observe("universally universal unique\n")
    words = WordCache()
    words.observe(TEXT + "universally universal unique\n")
    cursor = advance(ckpt.model, plain.state, b"\nThe un")
    model = suggest(ckpt.model, cursor, "The un", k=3, n_chars=0).completions
    expected = words.mix(model, "The un", 0.5, 3, 24)
    assert cached.suggest("The un", 3) == [c.text for c in expected]
    assert "universally" in cached.suggest("The un", 3)  # seen twice: the cache puts it first
    assert plain.suggest("The un", 3) == [c.text for c in model]
    with pytest.raises(ValueError, match="cache_weight"):
        ModelSuggester(ckpt.model, cache_weight=1.5)


def test_the_lexicon_ranks_the_completions_as_a_session_ranks_them(ckpt) -> None:  # type: ignore[no-untyped-def]
    from models.lexicon import Lexicon
    from models.wordcache import MIX_CANDIDATES, WordCache

    cursor_text = TEXT + "universally universal unique\n"
    for weight in (0.0, 0.5):
        plain = ModelSuggester(ckpt.model, cache_weight=weight)
        plain.observe(cursor_text)
        width = MIX_CANDIDATES if weight > 0 else 3
        model = suggest(ckpt.model, advance(ckpt.model, plain.state, b"\nThe "), "The ", k=width, n_chars=0).completions
        lexicon = Lexicon.of(c.text for c in model[len(model) // 2:])  # the less probable half: known
        ranked = ModelSuggester(ckpt.model, cache_weight=weight, lexicon=lexicon)
        ranked.observe(cursor_text)
        words = WordCache()
        words.observe(cursor_text)
        expected = words.mix(model, "The ", weight, 3, 24, lexicon)
        assert ranked.suggest("The ", 3) == [c.text for c in expected]


def test_a_word_after_a_mark_comes_with_the_space_the_keyboard_inserts(ckpt) -> None:  # type: ignore[no-untyped-def]
    """After a mark the search also offers the next word after a space (`space_before`): the simulator's suggester
    gives it as inserted, " word", so that it never passes for the word typed directly after the mark; the word cache
    is split between the two kinds by the search's space share, as a session splits it."""
    s = ModelSuggester(ckpt.model, cache_weight=0.5)
    s.observe(TEXT)
    cursor = advance(ckpt.model, ckpt.model.init_state(1), bytes([BOS]) + (TEXT + "It was done.").encode())
    found = suggest(ckpt.model, cursor, TEXT + "It was done.", k=50, n_chars=0)
    assert any(c.space_before for c in found.completions)  # the tiny model: after 10-20 words glued to the "."
    expected = s.words.mix(found.completions, "It was done.", 0.5, 50, 24, space=found.space_share)
    assert s.suggest("It was done.", 50) == [(" " if c.space_before else "") + c.text for c in expected]
    assert any(w.startswith(" ") for w in s.suggest("It was done.", 50))
    assert not any(w.startswith(" ") for w in s.suggest("It was do", 50))
