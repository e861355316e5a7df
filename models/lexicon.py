"""A checkpoint's lexicon: the words of its training text, a dictionary prior for a byte model's word completions.

A byte model's word search (`models.suggest`) ranks a completion by P(the typed word continues so, then ends): it
has no notion of a word, and fragments get real mass ("wor" after "wo", "Frien"; more so under the copy model's
flatter mixture). On held-out text a quarter of the e-mails' suggestion slots and 14% of the SMS ones held a
completion that was neither a word of the training text nor one the session had typed
(docs/notes/2026-11-benchmarks-history.md, "Where the keystrokes go"). The prior: such a completion's score is
multiplied by LEXICON_PENALTY before ranking (chosen there on held-out slices: of the values measured, 0.1 was best on
both texts). Only the ranking changes: a completion's `prob` stays its probability under the model (mixed with the
word cache), so a client that thresholds on it reads the same number as before.

A word is known if the lexicon or the session's word cache (`WordCache.has`) holds it as written or, with a capital
first letter, in lowercase ("Life" from "life", as the word cache's `titled` reads it).

The file, `lexicon.txt` in the checkpoint directory (optional: absent, no prior), is UTF-8 text, one word per line,
case kept, the words as `WordCache.observe` counts them (`counted_words`), those seen at least a minimum number of
times in the training text, most frequent first. Built by `python -m trainer.lexicon --data FILE... --out CKPT_DIR`
(the Makefile's `default-lexicon`). A word-level model needs none: its vocabulary is its lexicon.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from models.suggest import Completion
from models.wordcache import counted_words, title

__all__ = ["LEXICON_FILE", "LEXICON_MIN_COUNT", "LEXICON_PENALTY", "Lexicon", "Typed", "count_words", "write_lexicon"]

LEXICON_FILE = "lexicon.txt"
LEXICON_PENALTY = 0.1  # the factor on an unknown completion's score (module docstring)
LEXICON_MIN_COUNT = 2  # a word seen once in millions of bytes is as often a typo or a name as a word


class Typed(Protocol):
    """The words a session typed (`WordCache.has`)."""

    def has(self, word: str) -> bool: ...


@dataclass(frozen=True)
class Lexicon:
    """The known words: as listed and with a capital first letter (`title`: a word with a capital inside, "iPhone",
    as listed), so that `known` is one set lookup."""

    words: frozenset[str]
    listed: int = 0  # the words the file listed (`words` also holds their capitalised forms)

    @classmethod
    def of(cls, words: Iterable[str]) -> Lexicon:
        listed = set(words)
        return cls(frozenset(listed | {title(w) for w in listed}), len(listed))

    @classmethod
    def read(cls, path: str | Path) -> Lexicon:
        """Read a lexicon file; ValueError if it is not UTF-8 text of words, one a line (blank lines skipped)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text (byte {e.start})") from None
        words = [line.strip() for line in text.splitlines()]
        bad = next((w for w in words if w and list(counted_words(w)) != [w]), None)
        if bad is not None:
            raise ValueError(f"{bad[:40]!r} is not a word (one word a line)")
        return cls.of(w for w in words if w)

    def known(self, word: str) -> bool:
        return word in self.words

    def rank(self, completions: Sequence[Completion], k: int, cache: Typed | None = None,
             penalty: float = LEXICON_PENALTY) -> list[Completion]:
        """The k best `completions` by prob, a word neither in this lexicon nor in `cache` counting prob x `penalty`
        (ties: the given order); each keeps its own prob."""
        def score(item: tuple[int, Completion]) -> tuple[float, int]:
            i, c = item
            known = self.known(c.text) or (cache is not None and cache.has(c.text))
            return -(c.prob if known else c.prob * penalty), i

        return [c for _, c in sorted(enumerate(completions), key=score)[:k]]


def count_words(texts: Iterable[str]) -> Counter[str]:
    """How often each word (`counted_words`) occurs in the texts."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(counted_words(text))
    return counts


def write_lexicon(path: str | Path, counts: Counter[str], min_count: int = LEXICON_MIN_COUNT) -> int:
    """Write the words counted at least `min_count` times, most frequent first (ties alphabetical) -> how many."""
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(w + "\n" for w in words), encoding="utf-8")
    tmp.replace(out)
    return len(words)
