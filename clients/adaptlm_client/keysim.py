"""Keystroke-savings simulator: a typist enters a text character by character, taking a suggested word as soon
as it is the one they mean. Works with anything that suggests words (`Suggester`): a server session over HTTP
(`SessionSuggester`, the SDK only), a model in this process (`models.keysim`), or another predictor.

The typist, message by message (a message is a line; its newline is its last character):
- before each word (a maximal run of word characters, as in `models.suggest`: letters, marks, digits and the
  apostrophes ' and ’ inside a word) and after each of its characters but the last, the typist asks for the
  k best completions of the word being typed, the context being the message so far;
- when the intended word is among them, one keystroke selects it (a completion the keyboard would insert after a
  space, offered after a mark, `space_before`, is not: here the word follows the character before it directly, and
  the typist asks for no word before typing the space that precedes one). The keyboard inserts the word and a space:
  if the text's next character is a space, that space is saved too; if it is anything else (punctuation, a
  newline, the end), the inserted space is no help: the typist types the next character as usual (smart
  punctuation replaces the space at no cost, so nothing is charged for it either);
- every other character (spaces, punctuation, the characters of a word typed before it is suggested) costs one
  keystroke;
- when the message is finished, the suggester observes it: an adaptive one adapts on it, a static one reads
  it as context (the recurrent state moves on, as it would in a keyboard that keeps its model running).

This is the Presage simulator's accounting (presage_simulator, `Simulator::simulate`), with words cut at
punctuation rather than at whitespace only: there a whitespace-separated token costs its length plus one (its
trailing space) without prediction and, once it is among the suggestions after j typed characters, j
keystrokes plus one selection that also enters the space. Here, as there,

    KSR = 1 - (keys typed + selections) / keys without prediction

where keys without prediction is the number of characters of the text (one key each). Presage starts its
selection count at 1 (a constant we leave out), and a token with punctuation attached ("crazy..") is never
among its suggestions, where here the word ("crazy") is and only the punctuation is typed: on text whose
punctuation is written apart from the words (the Enron e-mails) the two accountings coincide.

Next-word accuracy: at the start of each word, before any of its characters is typed, top-1 is the fraction of
words that are the first suggestion and top-3 the fraction among the first three (that query asks for at least
three suggestions, whatever k is).
"""

from __future__ import annotations

import math
import time
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from adaptlm_client._client import Client, Session

__all__ = ["KeysimResult", "SessionSuggester", "Suggester", "messages", "simulate", "split_text", "split_words"]

APOSTROPHES = frozenset("'\u2019")
MAX_MESSAGE_CHARS = 1024  # longer lines are cut (at a space where there is one): a suggest context is <= 2048


class Suggester(Protocol):
    """What the simulator types against."""

    def suggest(self, context: str, k: int) -> Sequence[str]:
        """The k most likely whole words (typed part and completion) for the word being typed at the end of
        `context`, the message typed so far; most likely first. A word already typed in full is not one. A word that
        the keyboard would insert after a space (after a mark: "Hi," then " there") is given as inserted, with that
        space, so that it never passes for the word typed directly after the mark."""
        ...

    def observe(self, text: str) -> None:
        """`text`, a finished message (with its newline), is read; an adaptive suggester adapts on it."""
        ...


def is_word_char(ch: str) -> bool:
    """The word characters of `models.suggest` (letters, marks, numbers, apostrophes)."""
    return ch in APOSTROPHES or unicodedata.category(ch)[0] in "LMN"


def split_words(text: str) -> list[tuple[int, int]]:
    """(start, end) of every word of `text`: runs of word characters, leading apostrophes left out (an opening
    quote is typed, not predicted)."""
    spans, i, n = [], 0, len(text)
    while i < n:
        if not is_word_char(text[i]):
            i += 1
            continue
        j = i
        while j < n and is_word_char(text[j]):
            j += 1
        while i < j and text[i] in APOSTROPHES:
            i += 1
        if i < j:
            spans.append((i, j))
        i = j
    return spans


def messages(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> list[str]:
    """The messages the typist sends: the lines of `text`, each with its newline; a line longer than `max_chars`
    is cut after its last space before the limit (or at the limit)."""
    out = []
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            cut = line.rfind(" ", 0, max_chars) + 1 or max_chars
            out.append(line[:cut])
            line = line[cut:]
        if line:
            out.append(line)
    return out


def _line_start(data: bytes, i: int) -> int:
    """The first line start at or after byte i."""
    if i <= 0:
        return 0
    if data[i - 1:i] == b"\n":
        return i
    j = data.find(b"\n", i)
    return len(data) if j < 0 else j + 1


def split_text(data: bytes, *, last_bytes: int | None = None, warmup_bytes: int | None = None,
               limit_bytes: int | None = None) -> tuple[str, str]:
    """-> (warm-up text, measured text) of a UTF-8 file. The measured part is the last `last_bytes` bytes (all
    of it if None), from the first line that starts in them, cut to its first `limit_bytes` bytes (whole lines,
    at least one); the warm-up is what comes before it, or only its last `warmup_bytes` bytes (whole lines)."""
    cut = _line_start(data, len(data) - last_bytes) if last_bytes is not None else 0
    before, measured = data[:cut], data[cut:]
    if limit_bytes is not None and len(measured) > limit_bytes:
        end = measured.rfind(b"\n", 0, limit_bytes) + 1 or _line_start(measured, limit_bytes)
        measured = measured[:end]
    if warmup_bytes is not None:
        before = before[_line_start(before, len(before) - warmup_bytes):] if warmup_bytes > 0 else b""
    return before.decode("utf-8"), measured.decode("utf-8")


@dataclass
class KeysimResult:
    chars: int = 0  # keys without prediction
    typed: int = 0  # keys typed by hand
    selections: int = 0  # suggestions taken (one key each)
    words: int = 0
    top1: int = 0  # words that were the first suggestion before any of their characters was typed
    top3: int = 0  # ... among the first three
    messages: int = 0
    observed_chars: int = 0  # characters the suggester observed (warm-up and measured messages)
    latencies_s: list[float] = field(default_factory=list, repr=False)  # every timed suggest call

    @property
    def ksr(self) -> float:
        return 1 - (self.typed + self.selections) / self.chars if self.chars else math.nan

    def summary(self) -> dict[str, Any]:
        """The JSON record of `adaptlm keyboard-sim`."""
        lat = sorted(self.latencies_s)
        out = {k: v for k, v in asdict(self).items() if k != "latencies_s"}
        out.update({
            "ksr": self.ksr,
            "top1_accuracy": self.top1 / self.words if self.words else math.nan,
            "top3_accuracy": self.top3 / self.words if self.words else math.nan,
            "suggest_calls": len(lat),
            "suggest_ms_p50": 1000 * _percentile(lat, 50),
            "suggest_ms_p99": 1000 * _percentile(lat, 99),
            "suggest_ms_mean": 1000 * sum(lat) / len(lat) if lat else math.nan,
        })
        return out


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of a sorted list."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def type_message(suggester: Suggester, message: str, k: int, result: KeysimResult,
                 clock: Callable[[], float] = time.perf_counter) -> None:
    """Type one message against `suggester` (module docstring), adding to `result`; the suggester does not
    observe it here."""
    result.chars += len(message)
    i = 0
    for start, end in split_words(message):
        result.typed += start - i  # the characters before the word
        word = message[start:end]
        result.words += 1
        i = end
        for p in range(len(word)):  # p characters of the word typed
            t0 = clock()
            words = list(suggester.suggest(message[:start + p], max(k, 3) if p == 0 else k))
            result.latencies_s.append(clock() - t0)
            if p == 0:
                result.top1 += bool(words) and words[0] == word
                result.top3 += word in words[:3]
            if word in words[:k]:
                result.selections += 1
                if end < len(message) and message[end] == " ":
                    i = end + 1  # the keyboard's space was the right one
                break
            result.typed += 1  # not offered: type its next character (a word never offered costs len(word))
    result.typed += len(message) - i
    result.messages += 1


def simulate(suggester: Suggester, texts: Iterable[str], *, k: int = 3, warmup: Iterable[str] = (),
             on_message: Callable[[KeysimResult], None] | None = None) -> KeysimResult:
    """Type every message of `texts` against `suggester`, which observes each one when it is finished, having
    first observed every message of `warmup` (text before the measured part, not typed). Whether observing
    adapts is the suggester's business: a static one only reads the text as context."""
    result = KeysimResult()
    for message in warmup:
        suggester.observe(message)
        result.observed_chars += len(message)
    for message in texts:
        type_message(suggester, message, k, result)
        suggester.observe(message)
        result.observed_chars += len(message)
        if on_message is not None:
            on_message(result)
    return result


class SessionSuggester:
    """A server session (the SDK): suggestions under the session; `observe` sends the message to the session
    (`POST /v1/sessions/{id}/observe`), which adapts on it; with `lr=0` it learns no weights (the server leaves the
    output rows' memory off, or keeps the adapter at zero) and the session is the static model reading the text as
    context, with its copy model; `cache_weight`
    is the weight of the session's word cache in its suggestions (0: the model alone); `neural_cache` mixes the
    neural cache into its predictions (None: the server's default). Use it as a context manager (the session is
    deleted at the end)."""

    def __init__(self, client: Client, *, lr: float | None = None, decay: float | None = None,
                 adapter_size: int | None = None, cache_weight: float | None = None,
                 max_chars: int | None = None, neural_cache: bool | None = None) -> None:
        self.session: Session = client.create_session(lr=lr, decay=decay, adapter_size=adapter_size,
                                                      cache_weight=cache_weight, neural_cache=neural_cache)
        self.max_chars = max_chars

    def suggest(self, context: str, k: int) -> list[str]:
        answer = self.session.suggest(context, k=k, max_chars=self.max_chars, n_chars=0)
        return [" " + w.text if w.space_before else w.text for w in answer.completions]

    def observe(self, text: str) -> None:
        self.session.observe(text)

    def close(self) -> None:
        self.session.delete()

    def __enter__(self) -> SessionSuggester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
