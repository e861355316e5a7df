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
from models.suggest import Cursor, advance, complete_word, next_chars, split_word, suggest


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


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path) -> LanguageModel:
    return load_checkpoint(tiny_checkpoint).model


@pytest.mark.parametrize("context", ["It is a truth univ", "she said th", "and "])
def test_search_matches_brute_force_on_a_trained_model(tiny: LanguageModel, context: str) -> None:
    _check(tiny, context, k=5, max_chars=5, min_prob=0.01)


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
