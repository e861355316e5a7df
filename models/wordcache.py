"""A session's word cache for keyboard suggestions (ALGORITHMS.md §9 and §4): counts of the words, and of the
pairs of consecutive words, that the session has observed, mixed into the model's word completions.

Sparse adaptation learns a user's repeated words (names, jargon, headers) slowly, a few gradient steps at a time;
a predictive-text engine with online learning (Presage's user n-gram and recency predictors) suggests a word it
has seen once. The cache does that here, as the neural cache (§4) does for bytes, at the level of words:

    p(w | context, prefix) = (1 - lam) p_model(w | context) + lam p_cache(w | previous word, prefix)

- p_model is the model's probability that the typed word continues as w and then ends (`models.suggest`); a
  word the model's search did not return counts 0 there (its model probability is below the k-th completion's);
- p_cache(w | prev, prefix) = (c(prev, w) + beta p_uni(w | prefix)) / (c(prev, .) + beta), over the cached words
  that extend `prefix` (by at least one character and at most `max_chars`), where c(prev, .) sums the pair
  counts of those words and p_uni(w | prefix) = c(w) / (sum of c over those words): the previous word's
  continuations first, backed off to the words' own frequencies (an interpolated bigram, beta = 1);
- lam = `weight` when some cached word extends the prefix, else 0 (the model alone).

Words are split as `models.suggest` splits them (runs of letters, marks, numbers and apostrophes); a pair is two
words with only spaces between them (punctuation or a line break starts afresh). A word cut by the end of an
observed text is held until the next text says whether it goes on. The cache is bounded: past `max_words`
words (or pairs), the least frequent half is dropped. It is plain data (counts), serialised as JSON with the
session (`to_dict` / `from_dict`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from models.suggest import APOSTROPHES, Completion, is_word_char, split_word

__all__ = ["WordCache", "mix_completions", "previous_word"]

_PAIR = "\t"  # joins the two words of a pair key (never part of a word)


def _tokens(text: str) -> Iterable[tuple[bool, str]]:
    """(is a word, piece) for the maximal runs of word / non-word characters of `text`."""
    start = 0
    for i in range(1, len(text) + 1):
        if i == len(text) or is_word_char(text[i]) != is_word_char(text[start]):
            yield is_word_char(text[start]), text[start:i]
            start = i


def _clean(word: str) -> str:
    """A word without the apostrophes that open or close it (quotes, not part of the word)."""
    return word.strip("".join(APOSTROPHES))


def _is_piece(text: str) -> bool:
    """Word characters only (an observed word as it was cut, its apostrophes included), with UTF-8 bytes."""
    return all(is_word_char(c) for c in text) and text.isprintable() and _has_utf8(text)


def _is_word(text: object) -> bool:
    """A word as `observe` counts it."""
    return isinstance(text, str) and bool(text) and _clean(text) == text and _is_piece(text)


def _has_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def previous_word(before: str) -> str | None:
    """The word just before the word being typed, if only spaces separate them (`before` is the context up to
    the typed prefix)."""
    pieces = list(_tokens(before))
    if len(pieces) >= 2 and pieces[-2][0] and not pieces[-1][0] and set(pieces[-1][1]) <= {" "}:
        return _clean(pieces[-2][1]) or None
    return None


@dataclass
class WordCache:
    max_words: int = 2048
    words: dict[str, int] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)  # "prev\tword" -> count
    last: str | None = None  # the last complete word, if a pair may still start from it
    pending: str = ""  # a word cut by the end of the last text
    _sorted: list[str] | None = field(default=None, repr=False, compare=False)
    _nbytes: int | None = field(default=None, repr=False, compare=False)

    def observe(self, text: str) -> None:
        """Count the words of a text the user wrote (it continues the last one)."""
        if not text:
            return
        pieces = list(_tokens(self.pending + text))
        self.pending = ""
        if pieces and pieces[-1][0]:  # the text ends inside a word: wait for the rest
            self.pending = pieces.pop()[1]
        for is_word, piece in pieces:
            if not is_word:
                if set(piece) - {" "}:  # punctuation, a line break: no pair across it
                    self.last = None
                continue
            word = _clean(piece)
            if not word:
                continue
            self.words[word] = self.words.get(word, 0) + 1
            if self.last is not None:
                key = self.last + _PAIR + word
                self.pairs[key] = self.pairs.get(key, 0) + 1
            self.last = word
        self._sorted = None
        self._nbytes = None
        self._prune()

    def _prune(self) -> None:
        for table in (self.words, self.pairs):
            if len(table) > self.max_words:
                keep = sorted(table.items(), key=lambda kv: -kv[1])[: self.max_words // 2]
                table.clear()
                table.update(keep)

    def candidates(self, prefix: str, previous: str | None, max_chars: int) -> dict[str, float]:
        """p_cache(w | previous, prefix) of every cached word that extends `prefix` by 1..max_chars characters
        (module docstring); empty if there is none."""
        if self._sorted is None:
            self._sorted = sorted(self.words)
        i = bisect.bisect_left(self._sorted, prefix)
        found: list[str] = []
        while i < len(self._sorted) and self._sorted[i].startswith(prefix):
            word = self._sorted[i]
            if 0 < len(word) - len(prefix) <= max_chars:
                found.append(word)
            i += 1
        if not found:
            return {}
        total = sum(self.words[w] for w in found)
        uni = {w: self.words[w] / total for w in found}
        if previous is None:
            return uni
        pair = {w: self.pairs.get(previous + _PAIR + w, 0) for w in found}
        seen = sum(pair.values())
        return {w: (pair[w] + uni[w]) / (seen + 1) for w in found}  # beta = 1

    def mix(self, completions: list[Completion], context: str, weight: float, k: int,
            max_chars: int) -> list[Completion]:
        """The model's `completions` of the word being typed at the end of `context`, with this cache mixed in at
        `weight` (module docstring): the k best."""
        if weight <= 0:
            return completions[:k]
        before, prefix = split_word(context)
        return mix_completions(completions, self.candidates(prefix, previous_word(before), max_chars), weight, k)

    @property
    def nbytes(self) -> int:
        """A rough size in memory: a dict entry and a short string per word and per pair. Kept until the next
        observe: the session store asks on every write."""
        if self._nbytes is None:
            self._nbytes = sum(100 + len(k) for k in self.words) + sum(100 + len(k) for k in self.pairs)
        return self._nbytes

    def copy(self) -> WordCache:
        return WordCache(self.max_words, dict(self.words), dict(self.pairs), self.last, self.pending)

    def to_dict(self) -> dict[str, Any]:
        return {"words": self.words, "pairs": self.pairs, "last": self.last, "pending": self.pending}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], max_words: int = 2048) -> WordCache:
        """The inverse of `to_dict`; raises ValueError on anything else, including a word `observe` could not have
        counted (a session blob is user input: a lone surrogate restored here would fail every suggestion after)."""
        if not isinstance(data, Mapping):
            raise ValueError("a word cache is an object")
        words, pairs = data.get("words", {}), data.get("pairs", {})
        last, pending = data.get("last"), data.get("pending", "")
        ok = isinstance(words, dict) and isinstance(pairs, dict) and (last is None or _is_word(last)) \
            and isinstance(pending, str) and _is_piece(pending)
        for table in (words, pairs) if ok else ():
            ok = ok and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                            for k, v in table.items())
        ok = ok and all(_is_word(w) for w in words) and all(
            len(pair := key.split(_PAIR)) == 2 and all(_is_word(w) for w in pair) for key in pairs)
        if not ok:
            raise ValueError("not a word cache")
        cache = cls(max_words=max_words, words=dict(words), pairs=dict(pairs), last=last, pending=pending)
        cache._prune()
        return cache


def mix_completions(completions: list[Completion], cached: Mapping[str, float], weight: float,
                    k: int) -> list[Completion]:
    """The k best words under (1 - lam) p_model + lam p_cache (module docstring); `completions` are the model's
    (whole words, the typed prefix included) and `cached` p_cache of the cached words."""
    if not cached or weight <= 0:
        return completions[:k]
    mixed = {c.text: (1 - weight) * c.prob for c in completions}
    for word, p in cached.items():
        mixed[word] = mixed.get(word, 0.0) + weight * p
    best = sorted(mixed.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [Completion(word, p) for word, p in best]
