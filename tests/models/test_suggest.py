"""Keyboard suggestions: the best-first word completion against brute-force enumeration, UTF-8 handling,
next characters, and the word split."""

from __future__ import annotations

import codecs
import math
from pathlib import Path

import pytest
import torch

from models.base import Adapter, LanguageModel, Output, Site, State
from models.checkpoint import load_checkpoint
from models.scoring import BOS, score_bytes
from models.suggest import (
    Cursor,
    WordSearch,
    advance,
    complete_word,
    next_chars,
    split_word,
    step,
    suggest,
    takes_space,
)


class Bigram(LanguageModel):
    """A byte bigram table as a language model: the next byte's logits depend on the last byte only."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)  # (V, V)

    def init_state(self, batch: int) -> State:
        return State({"t": torch.zeros(batch, 1)})

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        return Output(self.table[tokens], State({"t": state.tensors["t"] + tokens.shape[1]}))  # (B, T, V)

    def adaptation_sites(self) -> list[Site]:
        return []


def _bigram() -> Bigram:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(256, 256, generator=g) * 2.5
    word = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]
    for a in range(256):  # words are short: letters, then often a space
        table[a, word] += 2.0
        table[a, ord(" ")] += 3.0
    table[ord("f"), 0xC3] = 12.0  # "f" -> "é" (C3 A9), and sometimes C3 -> "a" (invalid UTF-8)
    table[0xC3, 0xA9] = 12.0
    table[0xC3, ord("a")] = 10.0
    table[0xA9, ord(" ")] = 12.0
    table[ord("d"), 0xE2] = 11.0  # "d" -> an em dash (E2 80 94): not a word end we count
    table[0xE2, 0x80] = 14.0
    table[0x80, 0x94] = 14.0
    return Bigram(table).eval()


WORD_ENDS = [b for b in range(128) if not (chr(b).isalnum() or chr(b) == "'")]


def _distribution(model: LanguageModel, context: bytes) -> torch.Tensor:
    """The next byte's log-probs after BOS + context, computed from scratch (float64)."""
    x = torch.tensor([[BOS, *context]])
    with torch.no_grad():
        return torch.log_softmax(model(x, model.init_state(1)).logits[0, -1].double(), -1)


def _word_chars(data: bytes, final: bool) -> int | None:
    """Characters of `data` if its complete characters are word characters and it is valid UTF-8 so far."""
    try:
        text = codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=final)
    except UnicodeDecodeError:
        return None
    if any(not (c.isalnum() or c in "'\u2019" or c.isalpha()) for c in text):
        return None
    return len(text)


def brute_force(model: LanguageModel, context: bytes, prefix: str, *, max_chars: int,
                min_prob: float) -> list[tuple[str, float]]:
    """Every completion above `min_prob`, by depth-first enumeration of byte strings, each scored from scratch."""
    found: list[tuple[str, float]] = []

    def visit(data: bytes, logprob: float) -> None:
        lp = _distribution(model, context + data)
        complete = _word_chars(data, final=True)
        if data and complete is not None:
            end = logprob + float(torch.logsumexp(lp[WORD_ENDS], 0))
            if end >= math.log(min_prob):
                found.append((prefix + data.decode(), math.exp(end)))
        for b in range(256):
            child = data + bytes([b])
            chars = _word_chars(child, final=False)
            if chars is None or b in WORD_ENDS or logprob + float(lp[b]) < math.log(min_prob):
                continue
            if chars > max_chars or (chars == max_chars and _word_chars(child, final=True) is None):
                continue
            visit(child, logprob + float(lp[b]))

    visit(b"", 0.0)
    return sorted(found, key=lambda f: -f[1])


def _cursor(model: LanguageModel, context: bytes) -> Cursor:
    return advance(model, model.init_state(1), bytes([BOS]) + context)


def _check(model: LanguageModel, context: str, *, k: int, max_chars: int, min_prob: float) -> None:
    data = context.encode()
    expected = brute_force(model, data, split_word(context)[1], max_chars=max_chars, min_prob=min_prob)
    got = complete_word(model, _cursor(model, data), split_word(context)[1], k=k, max_chars=max_chars,
                        min_prob=min_prob)
    assert got.exact
    assert [c.text for c in got.completions] == [t for t, _ in expected[:k]]
    for c, (_, p) in zip(got.completions, expected, strict=False):
        assert c.prob == pytest.approx(p, rel=1e-4)


@pytest.mark.parametrize("context", ["", "the ", "ca", "f", "wd", "x!"])
def test_search_matches_brute_force_on_a_bigram(context: str) -> None:
    model = _bigram()
    for k in (1, 3, 10):
        _check(model, context, k=k, max_chars=4, min_prob=1e-3)


def brute_force_both(model: LanguageModel, context: bytes, *, max_chars: int,
                     min_prob: float) -> list[tuple[str, bool, float]]:
    """After a mark: the words directly after `context` and those after one space, each enumerated from scratch (the
    spaced ones from context + " ", times P(" " | context)) -> (word, after a space, prob), most probable first."""
    direct = brute_force(model, context, "", max_chars=max_chars, min_prob=min_prob)
    p_space = math.exp(float(_distribution(model, context)[ord(" ")]))
    spaced = brute_force(model, context + b" ", "", max_chars=max_chars, min_prob=min_prob / p_space) \
        if p_space >= min_prob else []
    found = [(t, False, p) for t, p in direct] + [(t, True, p * p_space) for t, p in spaced]
    return sorted(found, key=lambda f: -f[2])


def _check_both(model: LanguageModel, context: str, *, k: int, max_chars: int, min_prob: float) -> list[bool]:
    """The search after a mark against `brute_force_both` -> the space flags of the k found."""
    assert takes_space(context)
    data = context.encode()
    expected = brute_force_both(model, data, max_chars=max_chars, min_prob=min_prob)
    got = suggest(model, _cursor(model, data), context, k=k, max_chars=max_chars, min_prob=min_prob, n_chars=0)
    assert got.exact and got.prefix == ""
    assert [(c.text, c.space_before) for c in got.completions] == [(t, s) for t, s, _ in expected[:k]]
    for c, (*_, p) in zip(got.completions, expected, strict=False):
        assert c.prob == pytest.approx(p, rel=1e-4)
    return [c.space_before for c in got.completions]


@pytest.mark.parametrize("context", ["x!", "hi,", "caf\u00e9.", "a\U0001f600", "("])
def test_after_a_mark_the_search_also_offers_words_after_a_space(context: str) -> None:
    """A context that ends in punctuation or a symbol: the word may begin directly or after one space, both kinds
    in one search on one probability (the space one more byte of the branch), as brute force finds them."""
    model = _bigram()
    with torch.no_grad():  # as in text: a space after "!" "," "." and an emoji (its last byte 0x80), none after "("
        for b in b"!,.\x80":
            model.table[b, ord(" ")] = 12.0
        model.table[ord("("), ord(" ")] = 0.0
    for k in (1, 3, 10):
        flags = _check_both(model, context, k=k, max_chars=4, min_prob=1e-3)
        assert flags[0] == (context != "("), flags
    # without the space (complete_word's default), the search is the one it was: the words glued to the mark
    got = complete_word(model, _cursor(model, context.encode()), "", k=3, max_chars=4)
    assert not any(c.space_before for c in got.completions)


def test_takes_space() -> None:
    for context in ("Hi,", "Done.", "ok!", "great \U0001f600", "(", '"', "x—"):
        assert takes_space(context), context
    for context in ("", "Hi, ", "Hi,\n", "hello", "hello wor", "don'", "Hi,\u00a0", "2"):
        assert not takes_space(context), context
    with pytest.raises(ValueError):
        WordSearch(Cursor(State({}), torch.zeros(256)), "wo", space=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path) -> LanguageModel:
    return load_checkpoint(tiny_checkpoint).model


@pytest.mark.parametrize("context", ["It is a truth univ", "she said th", "and "])
def test_search_matches_brute_force_on_a_trained_model(tiny: LanguageModel, context: str) -> None:
    _check(tiny, context, k=5, max_chars=5, min_prob=0.01)


@pytest.mark.parametrize("context", ["Hi,", "It was done.", "she said \U0001f600", "and he said: ("])
def test_the_words_after_a_mark_on_a_trained_model(tiny: LanguageModel, context: str) -> None:
    """On the trained model (too small to be sure of the space after a comma: which kind wins is the bigram test's):
    after a mark both kinds, each with the probability brute force computes."""
    _check_both(tiny, context, k=10, max_chars=3, min_prob=3e-4)


def test_a_word_being_typed_is_searched_as_it_was(tiny: LanguageModel) -> None:
    context = "It is a truth, univ"
    got = suggest(tiny, _cursor(tiny, context.encode()), context, k=5, n_chars=0)
    plain = complete_word(tiny, _cursor(tiny, context.encode()), "univ", k=5)
    assert got.completions == plain.completions and got.completions and got.space_share == 0.0
    assert not any(c.space_before for c in got.completions)


def test_the_spaced_completion_s_probability_is_the_model_s(tiny: LanguageModel) -> None:
    """A spaced completion after "It was done." is P(" " word end | context) scored directly, as
    `test_advance_continues_a_cursor` checks the direct kind; the share of the space among the ways a word begins is
    the next byte's."""
    context = b"It was done."
    cursor = _cursor(tiny, context)
    found = suggest(tiny, cursor, context.decode(), k=50, n_chars=0, min_prob=1e-4)  # the tiny model likes "done.o"
    best = next(c for c in found.completions if c.space_before)
    text = context + b" " + best.text.encode()
    scored = score_bytes(tiny, text, logprobs=True)
    assert scored.logprobs is not None and scored.state is not None
    end = advance(tiny, scored.state, text[-1:]).logprobs.double()
    p = math.exp(sum(scored.logprobs[len(context):]) + float(torch.logsumexp(end[WORD_ENDS], 0)))
    assert best.prob == pytest.approx(p, rel=1e-4) and " " not in best.text
    # what may start a word: an ASCII letter, digit or apostrophe, or a UTF-8 lead byte
    lp = _distribution(tiny, context).exp()
    starts = [b for b in range(128) if chr(b).isalnum() or chr(b) == "'"] + list(range(0xC2, 0xF5))
    assert found.space_share == pytest.approx(float(lp[ord(" ")] / (lp[ord(" ")] + lp[starts].sum())), rel=1e-6)
    # the search left the cursor after the space: the likeliest next keystroke feeds nothing
    search = WordSearch(cursor, "", k=3, space=True)
    while (request := search.request()) is not None:
        search.feed(*step(tiny, *request, None))
    assert b" " in search.next_cursors
    after = advance(tiny, cursor.state, b" ")
    assert torch.allclose(search.next_cursors[b" "].logprobs, after.logprobs, atol=1e-5)


def test_an_empty_context_and_a_space_are_unchanged(tiny: LanguageModel) -> None:
    for context in ("", "Hi, ", "Hi,\n"):
        data = context.encode()
        got = suggest(tiny, _cursor(tiny, data), context, k=5, n_chars=0)
        plain = complete_word(tiny, _cursor(tiny, data), "", k=5)
        assert got.completions == plain.completions and got.space_share == 0.0
        assert not any(c.space_before for c in got.completions)


def test_utf8_completions_are_whole_characters() -> None:
    model = _bigram()
    got = complete_word(model, _cursor(model, b"caf"), "caf", k=10, max_chars=3)
    texts = [c.text for c in got.completions]
    assert "café" in texts and all(t.startswith("caf") for t in texts)
    lp = _distribution(model, b"caf")
    after = _distribution(model, "café".encode())
    p = math.exp(float(lp[0xC3] + _distribution(model, b"caf\xc3")[0xA9] + torch.logsumexp(after[WORD_ENDS], 0)))
    assert got.completions[texts.index("café")].prob == pytest.approx(p, rel=1e-5)
    # C3 followed by "a" is likely too, but invalid; the em dash after "d" stops a branch without a completion
    assert all("\ufffd" not in t and "\u2014" not in t for t in texts)
    dashes = complete_word(model, _cursor(model, b"wd"), "wd", k=10, max_chars=4)
    assert all("\u2014" not in c.text for c in dashes.completions)


def test_batching_does_not_change_the_result(tiny: LanguageModel) -> None:
    cursor = _cursor(tiny, b"It was the best of ti")
    runs = [complete_word(tiny, cursor, "ti", k=5, batch=b) for b in (1, 4, 64)]
    assert [c.text for c in runs[0].completions] == [c.text for c in runs[1].completions] == \
        [c.text for c in runs[2].completions]
    assert runs[2].model_calls <= runs[0].model_calls
    probs = [c.prob for c in runs[0].completions]
    assert probs == sorted(probs, reverse=True) and all(0 < p <= 1 for p in probs)


def test_a_budget_cut_is_reported(tiny: LanguageModel) -> None:
    got = complete_word(tiny, _cursor(tiny, b"and "), "", k=10, max_expansions=2, batch=1)
    assert not got.exact and got.expansions <= 3


def test_advance_continues_a_cursor(tiny: LanguageModel) -> None:
    whole = _cursor(tiny, b"hello world")
    part = _cursor(tiny, b"hello ")
    more = advance(tiny, part.state, b"world")
    assert torch.allclose(whole.logprobs, more.logprobs, atol=1e-5)
    # a completion's probability is the product of its bytes' probabilities (scoring's), times the word end
    best = complete_word(tiny, part, "", k=1).completions[0]
    scored = score_bytes(tiny, b"hello " + best.text.encode(), logprobs=True)
    assert scored.logprobs is not None
    word = sum(scored.logprobs[6:])
    assert scored.state is not None
    end = advance(tiny, scored.state, best.text.encode()[-1:]).logprobs.double()
    assert best.prob == pytest.approx(math.exp(word + float(torch.logsumexp(end[WORD_ENDS], 0))), rel=1e-4)


def test_next_chars_decode_multibyte_characters() -> None:
    model = _bigram()
    cursor = _cursor(model, b"caf")
    chars = next_chars(model, cursor, 5)
    assert len(chars) == 5 and [c.prob for c in chars] == sorted((c.prob for c in chars), reverse=True)
    lp = _distribution(model, b"caf")
    by_char = {c.char: c.prob for c in chars}
    assert by_char["é"] == pytest.approx(math.exp(float(lp[0xC3] + _distribution(model, b"caf\xc3")[0xA9])),
                                         rel=1e-5)
    top_ascii = max(range(128), key=lambda b: float(lp[b]))
    assert by_char[chr(top_ascii)] == pytest.approx(math.exp(float(lp[top_ascii])), rel=1e-5)
    assert next_chars(model, cursor, 0) == []


def test_suggest_puts_it_together(tiny: LanguageModel) -> None:
    context = "It is a truth universally ackn"
    result = suggest(tiny, _cursor(tiny, context.encode()), context, k=3, n_chars=4)
    assert result.prefix == "ackn" and len(result.next_chars) == 4
    assert all(c.text.startswith("ackn") and len(c.text) > 4 for c in result.completions)


@pytest.mark.parametrize(("context", "split"), [
    ("", ("", "")), ("hello", ("", "hello")), ("hello wor", ("hello ", "wor")), ("end.", ("end.", "")),
    ("say 'don't", ("say '", "don't")), ("naïve café", ("naïve ", "café")), ("x — y", ("x — ", "y")),
    ("tab\tnew", ("tab\t", "new")), ("go ", ("go ", "")),
])
def test_split_word(context: str, split: tuple[str, str]) -> None:
    assert split_word(context) == split
