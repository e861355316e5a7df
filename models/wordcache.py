"""A session's word cache for keyboard suggestions (docs/algorithms.md §10): counts of the words, pairs and
triples of consecutive words that the session has observed, and its last words in order, mixed into the model's
word completions.

Sparse adaptation learns a user's repeated words (names, jargon, headers) slowly, a few gradient steps at a time;
a predictive-text engine with online learning (Presage's user n-gram and recency predictors) suggests a word it
has seen once. The cache does that here, as the neural cache (docs/algorithms.md §4) does for tokens, at the
level of words, and trusts itself as far as the session's evidence for the context goes:

    p(w) = (1 - weight conf) p_model(w | context) + weight s(w)

(`weight` the session's `cache_weight`, the most the cache can weigh) over the cached words w that extend the
typed `prefix` (by at least one character and at most `max_chars`) and the model's completions
(`models.suggest`: the probability that the typed word continues as w and then ends; a word the model's search
did not return counts 0 there). With u v the two words before the typed one (each only if only spaces follow
it; punctuation or a line break starts afresh), each order n has a context (n = 3: u v, n = 2: v, n = 1: none),
counts c_n(w) of w after it (triples, pairs; words for n = 1), C_n their sum over the words that extend the
prefix and T_n how many of those have c_n(w) > 0. Witten-Bell smoothing (Witten & Bell 1991, in the
interpolated form of Chen & Goodman 1999, with beta scaling T_n) gives each order its evidence, the chance that
the next word is one the context was followed by before, and interpolates the orders trigram first:

    m_n = C_n / (C_n + beta T_n)  (0 when C_n = 0),     q_n(w) = c_n(w) / C_n
    s(w) = m_3 q_3(w) + (1 - m_3) [m_2 q_2(w) + (1 - m_2) gamma m_1 q_1(w)]
    conf = m_3 + (1 - m_3) [m_2 + (1 - m_2) gamma m_1]  (= the sum of s)

- where Witten-Bell backs off to unseen words, the rest (1 - weight conf) goes to the model;
- gamma (0.25) discounts the unigram level: that a word is frequent in the session says little about what
  follows an unseen context, and the model knows better. So the cache weighs close to `weight` after a pair or
  triple seen several times (m -> 1), a little over half of it after one seen once (m = 1/2), and under
  gamma `weight` when only the words' own frequencies support the candidates;
- q_1 also promotes recent words (Presage's recency predictor, an exponential decay):
  q_1(w) = (1 - rho) c(w) / C_1 + rho p_rec(w), p_rec(w) proportional to the sum over w's places among the last
  `max_recent` observed words of exp(-d / tau), d the words observed since (0 for the last); rho = 0.5,
  tau = 32 words, beta = 1. Where no recent word extends the prefix, q_1 is the frequencies alone.

A prefix with a capital first letter and no other (`Li`) reads the cache with every word's first letter capitalised
(`titled`: "life" counts for "Life"), so that a word the session typed in lowercase is offered at a sentence start
after one character, as it is in lowercase.

`candidates` gives p_cache(w) = s(w) / conf and `estimate` also conf; `mix` mixes p_cache at lam = weight conf
(`mix_completions`), which is the equation above.

After a mark ("Hi," "Done." an emoji: `models.suggest.takes_space`) the model's completions are of two kinds, the
word directly after the mark and the word after a space the keyboard inserts (`Completion.space_before`), and a
cached word is offered as both, its cache probability split by the model's own odds of the space
(`WordSearch.space_share`, sigma: P(" ") against P(a word character) next):

    p(" " w) = (1 - lam) p_model(" " w) + lam sigma p_cache(w)
    p(w)     = (1 - lam) p_model(w)     + lam (1 - sigma) p_cache(w)

The cache counts words, not what separates them (a pair or triple never spans punctuation), so it has no evidence
of its own about the space; the model has, from the text just typed: "Hi," is followed by a space, "(" by the word.
So the cache says which word, the model says where it begins, and the cache's mass stays lam in all. A rule on the
mark ("spaced after punctuation, direct after an opening bracket or quote") would have to decide for each of the
marks of every script, and is wrong for the ambiguous ones (a closing or opening '"', "-", "/"), where the model
reads the context. Where the model is sure (sigma near 1 after "Hi,", near 0 after "("), this offers the word in
one kind, as a phone keyboard does; in between, in both, each with its probability. Elsewhere sigma = 0: as before.

Words are split as `models.suggest` splits them (runs of letters, marks, numbers and apostrophes); a pair (a
triple) is two (three) words with only spaces between them. A word cut by the end of an observed text is held
until the next text says whether it goes on. The cache is bounded: a word of more than MAX_WORD_BYTES UTF-8 bytes
is no word a keyboard offers (a blob, a sentence of a script written without spaces) and is not counted (a pair
or triple does not run across it); past `max_words` words (or pairs, or triples), the least frequent half of that
table is dropped; the recent words are the last `max_recent`. It is
plain data, serialised as JSON with the session (`to_dict` / `from_dict`, which also reads the older format
without triples and recent words).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from models.memory import RESTORED_MAX_COUNT, Memory, MemorySettings, register
from models.suggest import APOSTROPHES, Completion, is_word_char, split_word

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint
    from models.lexicon import Lexicon

__all__ = ["MAX_WORD_BYTES", "MIX_CANDIDATES", "WordCache", "WordsMemory", "WordsSettings", "counted_words",
           "mix_completions", "previous_word", "previous_words", "title"]

# The longest word counted, in UTF-8 bytes (German's long compounds are about 40). Unbounded, text without spaces
# would be one word of any length, kept pending, counted, and written three times into the session's export, whose
# header the import refuses past 1 MB (server/engine/_export.py); with this bound a full cache stays under 0.7 MB.
MAX_WORD_BYTES = 48

# The model's completions a mix reads (a byte model's search finds this many, then shows k): a cached word that the
# model ranks 4th keeps its own probability under the model, where with only the shown 3 it counted 0 there. Chosen
# on held-out text (docs/notes/2026-11-benchmarks-history.md, "Where the keystrokes go"): 3 -> MIX_CANDIDATES gained
# KSR on both texts, at about twice the search's rows.
MIX_CANDIDATES = 8
_SEP = "\t"  # joins the words of a pair or triple key (never part of a word)
BETA = 1.0  # Witten-Bell: how much a context's distinct followers count against its evidence
GAMMA = 0.25  # the unigram level's trust against the model (module docstring)
RHO = 0.5  # the share of recency in the unigram level
TAU = 32.0  # the recency decay, in words


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


def counted_words(text: str) -> Iterable[str]:
    """The words of a whole text as `WordCache.observe` counts them (its word split, apostrophes that open or close
    a word dropped, none over MAX_WORD_BYTES), in order; a word at the text's end counts (the text is whole)."""
    for is_word, piece in _tokens(text):
        word = _clean(piece) if is_word else ""
        if word and len(word.encode("utf-8")) <= MAX_WORD_BYTES and _has_utf8(word):
            yield word


def _is_piece(text: str) -> bool:
    """Word characters only (an observed word as it was cut, its apostrophes included), with UTF-8 bytes."""
    return all(is_word_char(c) for c in text) and text.isprintable() and _has_utf8(text)


def _head(piece: str) -> str:
    """A pending word as kept: whole up to MAX_WORD_BYTES; past it, a shorter piece that counts as the whole one would
    whatever the next text adds (the apostrophes that open or close a word are not the word's, `_clean`): its opening
    apostrophes as one, runs of them within it cut to MAX_WORD_BYTES + 1 (a word holding one is too long either way),
    up to its first other character past the bound (after which the word is too long whatever follows)."""
    if len(piece.encode("utf-8")) <= MAX_WORD_BYTES:
        return piece
    core = piece.lstrip("".join(APOSTROPHES))
    kept, size, run = [piece[: len(piece) - len(core)][:1]], 0, 0
    for c in core:
        run = run + 1 if c in APOSTROPHES else 0
        if run > MAX_WORD_BYTES + 1:
            continue
        kept.append(c)
        size += len(c.encode("utf-8"))
        if size > MAX_WORD_BYTES and not run:
            break
    return "".join(kept)


def title(word: str) -> str:
    """`word` with a capital first letter (the rest as it is); a word with a capital past its first letter (iPhone,
    eBay) as it is: such a word keeps its first letter at a sentence start too."""
    if any(c.isupper() for c in word[1:]):
        return word
    return word[:1].upper() + word[1:]


def _titled_keys(table: dict[str, int]) -> dict[str, int]:
    """A pair or triple table with its last words written `title` (the counts of keys that then agree added)."""
    out: dict[str, int] = {}
    for key, c in table.items():
        ctx, _, word = key.rpartition(_SEP)
        key = ctx + _SEP + title(word)
        out[key] = out.get(key, 0) + c
    return out


def _is_word(text: object) -> bool:
    """A word as `observe` counts it."""
    return isinstance(text, str) and bool(text) and _clean(text) == text and _is_piece(text)


def _has_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def previous_words(before: str) -> tuple[str | None, str | None]:
    """(u, v): the two words before the word being typed, v the nearer, each only if only spaces separate it from
    the next (`before` is the context up to the typed prefix); None where there is none."""
    pieces = list(_tokens(before))
    found: list[str | None] = []
    end = len(pieces)
    while len(found) < 2 and end >= 2 and pieces[end - 2][0] and not pieces[end - 1][0] \
            and set(pieces[end - 1][1]) <= {" "}:
        word = _clean(pieces[end - 2][1])
        if not word:
            break
        found.append(word)
        end -= 2
    found += [None, None]
    return found[1], found[0]


def previous_word(before: str) -> str | None:
    """The word just before the word being typed, if only spaces separate them (`previous_words`' v)."""
    return previous_words(before)[1]


@dataclass
class WordCache:
    max_words: int = 2048  # per table (words, pairs, triples)
    words: dict[str, int] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)  # "v\tw" -> count
    last: str | None = None  # the last complete word, if a pair may still start from it
    pending: str = ""  # a word cut by the end of the last text
    triples: dict[str, int] = field(default_factory=dict)  # "u\tv\tw" -> count
    before_last: str | None = None  # the word before `last`, if a triple may still start from them
    recent: list[str] = field(default_factory=list)  # the last max_recent observed words, oldest first
    max_recent: int = 256
    # derived, rebuilt after an observe when first needed
    _sorted: list[str] | None = field(default=None, repr=False, compare=False)
    _after: dict[str, dict[str, int]] | None = field(default=None, repr=False, compare=False)
    _recency: dict[str, float] | None = field(default=None, repr=False, compare=False)
    _nbytes: int | None = field(default=None, repr=False, compare=False)
    _titled: WordCache | None = field(default=None, repr=False, compare=False)

    def observe(self, text: str) -> None:
        """Count the words of a text the user wrote (it continues the last one)."""
        if not text:
            return
        pieces = list(_tokens(self.pending + text))
        self.pending = ""
        if pieces and pieces[-1][0]:  # the text ends inside a word: wait for the rest (past the bound, its start
            self.pending = _head(pieces.pop()[1])  # only: enough to know it is too long when it ends)
        for is_word, piece in pieces:
            if not is_word:
                if set(piece) - {" "}:  # punctuation, a line break: no pair across it
                    self.last = self.before_last = None
                continue
            word = _clean(piece)
            if len(word.encode("utf-8")) > MAX_WORD_BYTES:  # not a word to offer: as a mark, no pair across it
                self.last = self.before_last = None
                continue
            if not word:
                continue
            # counts saturate where a restore stops accepting them: a session is always read back as it was written
            self.words[word] = min(self.words.get(word, 0) + 1, RESTORED_MAX_COUNT)
            if self.last is not None:
                key = self.last + _SEP + word
                self.pairs[key] = min(self.pairs.get(key, 0) + 1, RESTORED_MAX_COUNT)
                if self.before_last is not None:
                    key = self.before_last + _SEP + key
                    self.triples[key] = min(self.triples.get(key, 0) + 1, RESTORED_MAX_COUNT)
            self.before_last, self.last = self.last, word
            self.recent.append(word)
        if len(self.recent) > self.max_recent:
            del self.recent[: len(self.recent) - self.max_recent]
        self._sorted = self._after = self._recency = self._nbytes = self._titled = None
        self._prune()

    def _prune(self) -> None:
        for table in (self.words, self.pairs, self.triples):
            if len(table) > self.max_words:
                keep = sorted(table.items(), key=lambda kv: -kv[1])[: self.max_words // 2]
                table.clear()
                table.update(keep)

    def _extending(self, prefix: str, max_chars: int) -> list[str]:
        """The cached words that extend `prefix` by 1..max_chars characters (a bisection of the sorted words)."""
        if self._sorted is None:
            self._sorted = sorted(self.words)
        i = bisect.bisect_left(self._sorted, prefix)
        found: list[str] = []
        while i < len(self._sorted) and self._sorted[i].startswith(prefix):
            word = self._sorted[i]
            if 0 < len(word) - len(prefix) <= max_chars:
                found.append(word)
            i += 1
        return found

    def _followers(self, context: str) -> dict[str, int]:
        """c(context, w) for the words seen after `context` ("v" or "u\\tv"), indexed once per observe so that a
        keystroke reads a context's few followers instead of looking up every candidate."""
        if self._after is None:
            self._after = {}
            for table in (self.pairs, self.triples):
                for key, count in table.items():
                    ctx, word = key.rsplit(_SEP, 1)
                    self._after.setdefault(ctx, {})[word] = count
        return self._after.get(context, {})

    def _recent_weights(self) -> dict[str, float]:
        """sum over a word's places among the recent words of exp(-d / tau), d = 0 for the last."""
        if self._recency is None:
            self._recency = {}
            n = len(self.recent)
            for i, word in enumerate(self.recent):
                self._recency[word] = self._recency.get(word, 0.0) + math.exp(-(n - 1 - i) / TAU)
        return self._recency

    def titled(self) -> WordCache:
        """This cache with every counted word written with a capital first letter ("life" counts as "Life", with
        "Life"'s own counts; the words before it, the contexts, stay as they were): what a word typed with a
        capital first letter is drawn from (`estimate`). Derived, rebuilt after an observe when first needed."""
        if self._titled is None:
            words: dict[str, int] = {}
            for w, c in self.words.items():
                words[title(w)] = words.get(title(w), 0) + c
            pairs, triples = _titled_keys(self.pairs), _titled_keys(self.triples)
            titled = WordCache(self.max_words, words, pairs, triples=triples, recent=[title(w) for w in self.recent],
                               max_recent=self.max_recent)
            titled._titled = titled  # already titled: it reads its words as they are
            self._titled = titled
            self._nbytes = None  # it counts in this cache's size while it lives
        return self._titled

    def estimate(self, prefix: str, previous: str | None, max_chars: int,
                 earlier: str | None = None) -> tuple[dict[str, float], float]:
        """(p_cache, conf) after the words `earlier` `previous` for every cached word that extends `prefix` by
        1..max_chars characters (module docstring); ({}, 0) if there is none. A prefix that starts with a capital
        and has no other (`Th`, `I`) is a word the session may have typed in lowercase, now at a sentence start or
        capitalised: its candidates are drawn from the cache with capital first letters (`titled`), so that
        "Life" is offered from "life" after its first letter as it would be in lowercase; a prefix in other
        capitals (`WI`, `iP`) reads the words as they were typed."""
        if prefix[:1].isupper() and not any(c.isupper() for c in prefix[1:]) and (titled := self.titled()) is not self:
            return titled.estimate(prefix, previous, max_chars, earlier)
        found = self._extending(prefix, max_chars)
        if not found:
            return {}, 0.0
        lo, hi = len(prefix), len(prefix) + max_chars

        def extends(word: str) -> bool:
            return lo < len(word) <= hi and word.startswith(prefix) and word in self.words

        def level(context: str | None) -> tuple[float, dict[str, int], int]:
            """(m_n, c_n of the candidates that followed `context`, C_n)"""
            seen = {} if context is None else {w: c for w, c in self._followers(context).items() if extends(w)}
            total = sum(seen.values())
            return (total / (total + BETA * len(seen)) if total else 0.0), seen, total

        m2, seen2, total2 = level(previous)
        m3, seen3, total3 = level(None if previous is None or earlier is None else earlier + _SEP + previous)
        total1 = sum(self.words[w] for w in found)
        m1 = total1 / (total1 + BETA * len(found))
        conf = m3 + (1 - m3) * (m2 + (1 - m2) * GAMMA * m1)
        uni = (1 - m3) * (1 - m2) * GAMMA * m1 / conf  # the unigram level's share of p_cache
        recent = {w: r for w, r in self._recent_weights().items() if extends(w)}  # at most max_recent words
        rho = RHO if recent else 0.0  # no recent word extends the prefix: the frequencies alone
        a, b = uni * (1 - rho) / total1, uni * rho / (sum(recent.values()) or 1.0)
        cached = {w: a * self.words[w] + b * recent.get(w, 0.0) for w in found}
        for share, seen, total in ((1 - m3) * m2 / conf, seen2, total2), (m3 / conf, seen3, total3):
            for w, c in seen.items():
                cached[w] += share * c / total
        return cached, conf

    def candidates(self, prefix: str, previous: str | None, max_chars: int,
                   earlier: str | None = None) -> dict[str, float]:
        """p_cache(w | earlier previous, prefix) of every cached word that extends `prefix` by 1..max_chars
        characters (module docstring); empty if there is none."""
        return self.estimate(prefix, previous, max_chars, earlier)[0]

    def mix(self, completions: list[Completion], context: str, weight: float, k: int,
            max_chars: int, lexicon: Lexicon | None = None, space: float = 0.0) -> list[Completion]:
        """The model's `completions` of the word being typed at the end of `context`, with this cache mixed in at
        most at `weight` (lam = weight conf, module docstring): the k best, ranked under the checkpoint's
        `lexicon` if there is one (`Lexicon.rank`: a word neither in it nor in this cache is demoted; each `prob`
        stays the mixed probability). `space`: the model's probability that the word begins after a space the
        keyboard inserts (`WordSearch.space_share`; 0 where it may not), which splits each cached word between
        the two kinds (module docstring)."""
        if weight <= 0:
            mixed = completions
        else:
            cached, conf = self.estimate_at(context, max_chars)
            mixed = mix_completions(completions, cached, weight * conf, len(completions) + 2 * len(cached), space)
        return lexicon.rank(mixed, k, self) if lexicon is not None else mixed[:k]

    def estimate_at(self, context: str, max_chars: int) -> tuple[dict[str, float], float]:
        """`estimate` for the word being typed at the end of `context`, after the words before it."""
        before, prefix = split_word(context)
        earlier, previous = previous_words(before)
        return self.estimate(prefix, previous, max_chars, earlier)

    def has(self, word: str) -> bool:
        """Was `word` counted, as typed or, with a capital first letter, with that letter in lowercase ("Life" from
        "life", as `titled` reads it; two set lookups, where building `titled` after an observe takes ms)?"""
        if word in self.words:
            return True
        # `title`'s inverse: only a word with no other capital was capitalised
        return word[:1].isupper() and not any(c.isupper() for c in word[1:]) \
            and word[:1].lower() + word[1:] in self.words

    @property
    def nbytes(self) -> int:
        """A rough size in memory: a dict entry and a short string per word, pair and triple, a list entry and a
        string per recent word (twice while the `titled` view lives). Kept until the next observe: the session
        store asks on every write."""
        if self._nbytes is None:
            self._nbytes = sum(100 + len(k) for table in (self.words, self.pairs, self.triples) for k in table) \
                + sum(60 + len(w) for w in self.recent)
            if self._titled is not None and self._titled is not self:
                self._nbytes += self._titled.nbytes
        return self._nbytes

    def copy(self) -> WordCache:
        return WordCache(self.max_words, dict(self.words), dict(self.pairs), self.last, self.pending,
                         dict(self.triples), self.before_last, list(self.recent), self.max_recent)

    def to_dict(self) -> dict[str, Any]:
        return {"words": self.words, "pairs": self.pairs, "triples": self.triples, "last": self.last,
                "before_last": self.before_last, "pending": self.pending, "recent": self.recent}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], max_words: int = 2048, max_recent: int = 256) -> WordCache:
        """The inverse of `to_dict` (a cache saved before triples and recent words existed reads as one without
        them); raises ValueError on anything else, including a word `observe` could not have counted (a session
        blob is user input: a lone surrogate restored here would fail every suggestion after)."""
        if not isinstance(data, Mapping):
            raise ValueError("a word cache is an object")
        tables = data.get("words", {}), data.get("pairs", {}), data.get("triples", {})
        last, before_last = data.get("last"), data.get("before_last")
        pending, recent = data.get("pending", ""), data.get("recent", [])
        ok = all(isinstance(table, dict) for table in tables) and (last is None or _is_word(last)) \
            and (before_last is None or (last is not None and _is_word(before_last))) \
            and isinstance(pending, str) and _is_piece(pending) \
            and isinstance(recent, list) and all(_is_word(w) for w in recent)
        for n, table in enumerate(tables, 1) if ok else ():
            ok = ok and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                            and 0 < v <= RESTORED_MAX_COUNT
                            and len(key := k.split(_SEP)) == n and all(_is_word(w) for w in key)
                            for k, v in table.items())
        if not ok:
            raise ValueError("not a word cache")
        words, pairs, triples = (dict(table) for table in tables)
        cache = cls(max_words=max_words, words=words, pairs=pairs, last=last, pending=pending, triples=triples,
                    before_last=before_last, recent=recent[max(0, len(recent) - max_recent):],
                    max_recent=max_recent)
        cache._prune()
        return cache


def mix_completions(completions: list[Completion], cached: Mapping[str, float], weight: float,
                    k: int, space: float = 0.0) -> list[Completion]:
    """The k best words under (1 - lam) p_model + lam p_cache with lam = `weight` (`WordCache.mix` passes
    weight conf, module docstring); `completions` are the model's (whole words, the typed prefix included; a word
    after a space and the same word directly are two) and `cached` p_cache of the cached words, offered directly
    with the share 1 - `space` of it and after a space with the share `space` (module docstring)."""
    if not cached or weight <= 0:
        return completions[:k]
    mixed = {(c.text, c.space_before): (1 - weight) * c.prob for c in completions}
    for word, p in cached.items():
        for key, share in ((word, False), 1.0 - space), ((word, True), space):
            if share > 0:
                mixed[key] = mixed.get(key, 0.0) + weight * p * share
    best = sorted(mixed.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [Completion(word, p, spaced) for (word, spaced), p in best]


class WordsSettings(MemorySettings):
    weight: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False,
                          description="Weight of the word cache in keyboard suggestions (0: not mixed).")


@register
class WordsMemory(Memory):
    """The word cache as a session memory: it counts the words the session observed and mixes them into keyboard
    suggestions at `weight` (0: counted, not mixed). Its state is a `WordCache`, exported as its `to_dict`."""

    name = "words"
    kind = "words"
    settings_type = WordsSettings

    def __init__(self, weight: float = 0.0) -> None:
        self.weight = weight

    @classmethod
    def build(cls, ckpt: Checkpoint) -> WordsMemory:
        return cls(ckpt.dyneval.cache_weight)

    def defaults(self) -> WordsSettings:
        return WordsSettings(weight=self.weight)

    def init(self, settings: MemorySettings, device: torch.device) -> WordCache:
        return WordCache()

    def export(self, state: Any) -> tuple[dict[str, torch.Tensor], Any]:
        return {}, state.to_dict()

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> WordCache:
        if tensors:
            raise ValueError("the word cache has no tensors")
        return WordCache.from_dict(meta or {})

    def observe_text(self, state: Any, text: str) -> WordCache:
        if not isinstance(state, WordCache):
            raise TypeError(f"a words memory's state is a WordCache, not {type(state).__name__}")
        words = state.copy()  # a new object: the stored record may be read meanwhile
        words.observe(text)
        return words

    def search_width(self, settings: MemorySettings, k: int) -> int:
        assert isinstance(settings, WordsSettings)
        return max(k, MIX_CANDIDATES) if settings.weight > 0 else k

    def rank(self, state: Any, settings: MemorySettings, completions: list[Any], context: str, k: int,
             max_chars: int, lexicon: Any, space: float) -> list[Any]:
        assert isinstance(settings, WordsSettings)
        return list(state.mix(completions, context, settings.weight, k, max_chars, lexicon, space))
