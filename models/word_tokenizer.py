"""Word-level tokenizer: a vocabulary built from training text, most frequent first, saved with the
checkpoint (config.json "tokenizer": {"kind": "words", "split": ..., "vocab": [...]}).

Tokenisation rule (**decision**; lossless, in the spirit of GPT-2's pre-tokeniser). Text is cut, left to right, into
tokens that are each an optional single leading space followed by a body:

    token = " "? body | other whitespace
    body  = a word: a run of word characters (str.isalnum or "_", Python's `\\w`: any script, digits included),
            with inner apostrophes kept ("don't", "l'homme"),                            split="words" (raw text)
          | one punctuation or symbol character (anything else that is not whitespace: "." "," "(" "—" "🙂")
          | any run of non-whitespace characters,                     instead of the two above: split="whitespace"
                                                                      (pre-tokenised corpora: PTB, WikiText)
          | "\\n" (end of line, <eos>)
          | "<unk>" (so that decoded text, and corpora that spell unknown words so, encode back to <unk>)
    other whitespace = a run of spaces, tabs, "\\r" ... (no newline) that is not the one space before a body

Case is kept. The vocabulary holds the token strings themselves, the leading space included: " the" (after a space)
and "the" (at a line's start, after "(" ...) are different entries. Joining the token strings gives the text back,
so decode(encode(text)) == text for every text whose tokens are all in the vocabulary (every token of the training
text is, unless `max_size` / `min_count` dropped it). An unknown token becomes `<unk>`, keeping its spacing: " <unk>"
if it had the leading space, "<unk>" if not; it decodes to that literal text (" zyzzyva" -> " <unk>"), which encodes
back to the same id.

Ids: 0 "\\n" (<eos>, also `bos`: every stream starts as if after a newline, as the byte tokenizer's), 1 " \\n" (a line
ending after a space: WikiText's lines end in " \\n"; one token, so a line counts its words + 1), 2 "<unk>",
3 " <unk>"; then every other token by count in the training text, most frequent first (the adaptive input and softmax
cut the vocabulary into frequency bands by id), ties by the token string (code point order): deterministic.

Scoring: word-level results are per token, every punctuation mark and end of line included (the PTB / WikiText
convention); `size(text)` gives the tokens and the UTF-8 bytes of a text, so that a scorer reports bits per word =
bits / tokens and bits per byte = bits / bytes (docs/algorithms.md §13). Bits per byte compare with a byte model only on
text without <unk>: an unknown token is predicted as a class, not spelt.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from models._streams import StreamMixin

__all__ = ["SPLITS", "TextSize", "WordTokenizer"]

EOS, SPACE_EOS, UNK, SPACE_UNK = "\n", " \n", "<unk>", " <unk>"
_SPECIALS = (EOS, SPACE_EOS, UNK, SPACE_UNK)  # ids 0..3
_UNK_ID, _SPACE_UNK_ID = 2, 3

# other whitespace leaves its last space to a body that follows (a word, punctuation or a newline)
_TAIL = r"|\n|<unk>)|[^\S\n]+(?= [\S\n])|[^\S\n]+"
SPLITS: dict[str, re.Pattern[str]] = {
    "words": re.compile(r" ?(?:<unk>|\w+(?:['’]\w+)*|[^\w\s]" + _TAIL),
    "whitespace": re.compile(r" ?(?:\S+" + _TAIL),
}
# What may follow a text, one of each kind that decides where the tokenizer cuts it (a token looks at most a space
# and one character ahead): token healing (`heal`) holds back the tokens that any of them changes.
_PROBES = ("a", "'a", ".", "\n", " ", " a", " \n")


class TextSize(NamedTuple):
    """What a text is worth to a scorer: its tokens (the words of bits per word) and its UTF-8 bytes."""

    tokens: int
    bytes: int


class WordTokenizer(StreamMixin):
    """Text in, word ids out; `vocab[i]` is the text of token i (module docstring for the rule)."""

    kind = "words"
    unit = "word"
    reports_tokens = True  # per word too: bits per word and perplexity (docs/algorithms.md §13)
    bos = 0  # "\n": the token before a stream's first one
    eos = 0
    unk = _UNK_ID
    unknown = (_UNK_ID, _SPACE_UNK_ID)  # the unknown word's ids, which generation never samples

    def __init__(self, vocab: Sequence[str], split: str = "words") -> None:
        if split not in SPLITS:
            raise ValueError(f"word tokenizer: unknown split {split!r}; known: {', '.join(sorted(SPLITS))}")
        if tuple(vocab[: len(_SPECIALS)]) != _SPECIALS:
            raise ValueError(f"word tokenizer: the vocabulary must start with {list(_SPECIALS)!r}, "
                             f"not {list(vocab[: len(_SPECIALS)])!r}")
        pattern = SPLITS[split]
        ids: dict[str, int] = {}
        for i, token in enumerate(vocab):
            if not isinstance(token, str):
                raise ValueError(f"word tokenizer: vocabulary entry {i} is {token!r}, not a string")
            if token in ids:
                raise ValueError(f"word tokenizer: {token!r} is in the vocabulary twice (ids {ids[token]} and {i})")
            if pattern.findall(token) != [token]:
                raise ValueError(f"word tokenizer: vocabulary entry {i} {token!r} is not one token "
                                 f"under split {split!r}")
            ids[token] = i
        self.split = split
        self.vocab: tuple[str, ...] = tuple(vocab)
        self._ids = ids
        self._pattern = pattern
        self._bytes = [t.encode("utf-8") for t in self.vocab]
        self._continuing: dict[bytes, torch.Tensor] = {}  # `continuing`'s answers (each sampler's fork asks again)
        # the words (not the special tokens) in byte order, for a prefix's range by bisection (`with_prefix`)
        self._sorted = sorted(range(len(_SPECIALS), len(self.vocab)), key=self._bytes.__getitem__)
        self._sorted_bytes = [self._bytes[i] for i in self._sorted]

    # -- building and saving --------------------------------------------------------------------------------

    @classmethod
    def build(cls, texts: Iterable[str] | str, max_size: int | None = None, min_count: int = 1,
              split: str = "words") -> WordTokenizer:
        """The vocabulary of `texts` (each tokenised on its own): the 4 specials, then every token seen at least
        `min_count` times, most frequent first (ties by string), cut to `max_size` entries in all (specials
        included)."""
        if split not in SPLITS:
            raise ValueError(f"word tokenizer: unknown split {split!r}; known: {', '.join(sorted(SPLITS))}")
        if max_size is not None and max_size < len(_SPECIALS):
            raise ValueError(f"word tokenizer: max_size must be at least {len(_SPECIALS)} (the specials), "
                             f"not {max_size}")
        if min_count < 1:
            raise ValueError(f"word tokenizer: min_count must be at least 1, not {min_count}")
        if isinstance(texts, str):
            texts = [texts]
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(SPLITS[split].findall(text))
        ranked = sorted((t for t, c in counts.items() if c >= min_count and t not in _SPECIALS),
                        key=lambda t: (-counts[t], t))
        words = list(_SPECIALS) + ranked
        return cls(words if max_size is None else words[:max_size], split)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "split": self.split, "vocab": list(self.vocab)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> WordTokenizer:
        """The inverse of `to_dict`; ValueError says what is wrong with a bad one."""
        if not isinstance(data, Mapping):
            raise ValueError("word tokenizer: needs an object with its vocabulary, not the name alone")
        if data.get("kind") != cls.kind:
            raise ValueError(f"word tokenizer: kind must be {cls.kind!r}, not {data.get('kind')!r}")
        unknown = set(data) - {"kind", "split", "vocab"}
        if unknown:
            raise ValueError(f"word tokenizer: unknown fields {sorted(unknown)!r}")
        vocab = data.get("vocab")
        if not isinstance(vocab, list):
            raise ValueError(f"word tokenizer: 'vocab' must be a list of token strings, not {type(vocab).__name__}")
        split = data.get("split", "words")
        if not isinstance(split, str):
            raise ValueError(f"word tokenizer: 'split' must be a name, not {split!r}")
        return cls(vocab, split)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WordTokenizer) and other.split == self.split and other.vocab == self.vocab

    def __hash__(self) -> int:
        return hash((self.kind, self.split, self.vocab))

    def __repr__(self) -> str:
        return f"WordTokenizer(split={self.split!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    # -- text -> ids ---------------------------------------------------------------------------------------------

    def tokens(self, data: str | bytes) -> list[str]:
        """The token strings of a text (before the vocabulary is asked); "".join(...) gives the text back. Bytes
        are read as UTF-8, an invalid sequence as U+FFFD."""
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        return self._pattern.findall(data)

    def token_texts(self, data: str | bytes) -> list[str]:
        """The token strings of a text (`tokens`), for a score's per-token record."""
        return self.tokens(data)

    def pieces(self, data: bytes) -> list[bytes]:
        """`data` cut at its tokens, each as written there (a word the vocabulary lacks keeps its own text)."""
        return [t.encode("utf-8") for t in self.tokens(data)]

    def encode(self, data: str | bytes) -> list[int]:
        ids = self._ids
        return [ids.get(t, _SPACE_UNK_ID if _spaced_body(t) else _UNK_ID) for t in self.tokens(data)]

    def encode_tensor(self, data: str | bytes, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.encode(data), dtype=torch.long).to(device, non_blocking=True)  # (T,)

    def last_token(self, data: bytes) -> int:
        """The token a stream continues from after `data` (non-empty): the last token of `data` as it stands (a
        word cut short is taken as the shorter word; callers continue streams at token boundaries). Only the
        last line is tokenised again: every newline ends a token."""
        start = data.rfind(b"\n", 0, len(data) - 1) + 1  # a line ending in "\n" is tokenised with that line
        return self.encode(data[start:])[-1]

    def split_stable(self, data: bytes) -> tuple[bytes, bytes]:
        """Cut text that arrives in pieces (a session's observes) -> (stable, pending): the tokens of `stable` are
        those of any text that continues it, so they can be scored now; `pending` waits for what follows (the last
        word, which may go on, and the gap before it, whose split depends on what follows; an incomplete UTF-8
        character). The cut is after the last newline or before the last run of other whitespace, whichever is
        later: no token spans a newline, and a word, a punctuation mark or <unk> ends where whitespace begins.
        tokens(stable) + tokens(pending + rest) == tokens(stable + pending + rest) for every rest (tested)."""
        end = len(data)
        for back in range(1, min(4, len(data)) + 1):  # a multi-byte character cut short stays pending
            lead = data[-back]
            if lead & 0xC0 != 0x80:  # the last character's first byte
                need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
                end = len(data) - back if need > back else len(data)
                break
        text = data[:end].decode("utf-8", errors="replace")
        cut = len(text)
        while cut > 0 and not text[cut - 1].isspace():  # the last word (or mark) may still go on
            cut -= 1
        if cut > 0 and text[cut - 1] != "\n":  # a gap before it: its split depends on what follows
            while cut > 0 and text[cut - 1].isspace() and text[cut - 1] != "\n":
                cut -= 1
        stable = text[:cut].encode("utf-8")
        return stable, data[len(stable):]

    def split_typed(self, tail: bytes) -> tuple[bytes, bytes]:
        """Cut the pending part of typed text (`split_stable`'s second part) -> (settled, typed): `typed` is the start
        of the token that a word typed next would continue ("do" of "do", "don'" of "don'", " " of "  "), and
        `settled` what is before it: all of it after a punctuation mark under split "words" ("(" and "," are tokens
        of one character, so the word being typed after one is empty)."""
        text = tail.decode("utf-8", errors="surrogateescape")  # an incomplete character reads as a mark
        typed = self.tokens(text + "a")[-1][:-1]  # "a" goes on the word being typed, or starts the next one
        settled = text[: len(text) - len(typed)]
        return settled.encode("utf-8", errors="surrogateescape"), typed.encode("utf-8", errors="surrogateescape")

    def heal(self, data: bytes) -> tuple[bytes, bytes]:
        """Token healing: cut a prompt -> (kept, held), `held` the last tokens of `data` whose cut may still move with
        what follows ("there was a " -> " ": after a space comes " the", never " " then "the"; " thi" of "a thi";
        " don'" of "I don'", one token in " don't"; b"" when every cut stays: "cat.", "\n", a prompt ending in an
        unfinished UTF-8 character, or any bytes that are not UTF-8). A generation conditions on `kept`, whose tokens
        begin those of every continuation, and continues `held` as typed (`continuing`). Nothing is held when no
        vocabulary entry can continue it (" zyzzy": the model reads its " <unk>")."""
        try:
            # split_stable cuts the text with U+FFFD for bad bytes: its cut is no offset into such bytes
            data.decode("utf-8")
        except UnicodeDecodeError:
            return data, b""
        _, pending = self.split_stable(data)  # the stable part's cuts stay whatever follows
        text = pending.decode("utf-8")
        tokens = self.tokens(text)
        keep = len(tokens)
        for probe in _PROBES:  # the first token that some continuation changes
            after = self.tokens(text + probe)
            keep = min(keep, next((i for i, (a, b) in enumerate(zip(tokens, after, strict=False)) if a != b), keep))
        held = "".join(tokens[keep:]).encode("utf-8")
        if not held or not self.continuing(held).numel():
            return data, b""
        return data[: len(data) - len(held)], held

    def continuing(self, held: bytes) -> torch.Tensor:
        """The (n,) ids of the tokens that may come next while `held` (`heal`'s, or what a token before left of it)
        is still to be generated: the entries whose text starts with it (the words, and " \n" after a lone space;
        never <unk>), and those that the tokenizer cuts from its start whatever follows, when the rest can be
        continued in turn (" " of "  " before a word, which is " " + " the"; " don" of " don'", then "'"). A
        token that merely spells a start of it (" th" + "is" for " thi") is no cut the tokenizer makes, and is left
        out. Ascending ids (a tensor shared between calls: not to be written)."""
        hit = self._continuing.get(held)
        if hit is None:
            if len(self._continuing) >= 1024:  # held texts are the ends of prompts: bounded, the oldest half dropped
                for key in list(self._continuing)[:512]:
                    del self._continuing[key]
            hit = self._continuing[held] = self._continuing_ids(held)
        return hit

    def _continuing_ids(self, held: bytes) -> torch.Tensor:
        text = held.decode("utf-8")
        extra = {i for i in (0, 1) if self._bytes[i].startswith(held)}  # "\n", " \n"
        for probe in _PROBES:
            first = self.tokens(text + probe)[0]
            i = self._ids.get(first)
            if (i is not None and i not in self.unknown and len(first) < len(text) and text.startswith(first)
                    and self.continuing(held[len(first.encode("utf-8")):]).numel()):
                extra.add(i)
        words = self.ids_with_prefix(held)  # (n,) in byte order; none of them is in `extra` (shorter, or special)
        return torch.cat([words, torch.tensor(sorted(extra), dtype=torch.long)]).sort().values  # (n + e,)

    def offered(self, ids: torch.Tensor, typed: bytes, max_chars: int) -> torch.Tensor:
        """A (n,) mask of the entries `ids` (n,) (those `ids_with_prefix(typed)` gives) that a keyboard may offer as
        the word being typed: a word (its body, after the typed part's single leading space if it has one, is a
        word: no run of whitespace, no punctuation under split "words", and no leading space that the typed part
        lacks) that adds 1..max_chars characters to the typed part."""
        spaced, words, chars = self._entry_kinds
        n = len(typed.decode("utf-8", errors="ignore"))
        added = chars[ids] - n  # (n,)
        return words[ids] & (spaced[ids] == typed.startswith(b" ")) & (added >= 1) & (added <= max_chars)

    def words_of(self, ids: torch.Tensor, *, spaced: bool) -> torch.Tensor:
        """A (n,) mask of the entries `ids` (n,) that are words (`offered`'s, of any length) written with the single
        space before them (`spaced`: " there") or without ("there")."""
        kinds, words, _ = self._entry_kinds
        return words[ids] & (kinds[ids] == spaced)

    def unspaced(self, typed: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """A word typed without the single space before it (at a line's start, after "(" or a quote: `typed` does not
        start with a space) may be one the vocabulary holds only with that space (" actual" but no "actual"), which
        the tokenizer writes there as `<unk>`. -> the (n,) ids of the entries " w" whose w starts with `typed`, as
        `ids_with_prefix(b" " + typed)` gives them (byte order), and (n,) each one's share of the `<unk>` written there
        (float64): over the spaced words that have no entry of their own, by their frequency in the training text,
        which the ids' order gives (Zipf: 1 / rank); 0 for an entry whose word has one, or that is no word."""
        ids = self.ids_with_prefix(b" " + typed)
        return ids, self._unspaced_shares[ids]

    @functools.cached_property
    def _unspaced_shares(self) -> torch.Tensor:
        """(V,) float64: `unspaced`'s share of each entry, summing to 1 over the spaced words without an entry of their
        own (0 for every other entry)."""
        spaced, words, _ = self._entry_kinds
        shares = torch.tensor([1.0 / (i - len(_SPECIALS) + 1) if words[i] and spaced[i] and t[1:] not in self._ids
                               else 0.0 for i, t in enumerate(self.vocab)], dtype=torch.float64)
        total = float(shares.sum())
        return shares / total if total > 0 else shares

    @functools.cached_property
    def _entry_kinds(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(spaced, word, chars), each (V,): whether an entry starts with the single space before a body, whether its
        body is a word (`offered`), and its length in characters."""
        word = re.compile(r"\w" if self.split == "words" else r"\S")
        spaced = [_spaced_body(t) for t in self.vocab]
        words = [i >= len(_SPECIALS) and word.match(t[1:] if s else t) is not None
                 for i, (t, s) in enumerate(zip(self.vocab, spaced, strict=True))]
        return torch.tensor(spaced), torch.tensor(words), torch.tensor([len(t) for t in self.vocab])

    def size(self, data: str | bytes) -> TextSize:
        """Tokens and UTF-8 bytes of a text: bits per word = bits / tokens, bits per byte = bits / bytes."""
        raw = data if isinstance(data, bytes) else data.encode("utf-8")
        return TextSize(tokens=len(self.tokens(data)), bytes=len(raw))

    # -- ids -> text -----------------------------------------------------------------------------------------

    def with_prefix(self, prefix: bytes) -> list[int]:
        """The ids of the vocabulary's words (special tokens left out) whose bytes start with `prefix`, in byte
        order: two bisections of the sorted vocabulary, not a pass over it (a keyboard asks at every keystroke)."""
        lo, hi = self._span(prefix)
        return self._sorted[lo:hi]

    @staticmethod
    def is_special(token: int) -> bool:
        """End of line or <unk> (with or without a space): an entry that is no word."""
        return token < len(_SPECIALS)

    def ids_with_prefix(self, prefix: bytes) -> torch.Tensor:
        """`with_prefix` as a (n,) int64 tensor, a slice of a cached one (no list of thousands of ids built when the
        prefix is empty or one letter)."""
        lo, hi = self._span(prefix)
        return self._sorted_ids[lo:hi]

    def by_next_char(self, prefix: bytes) -> list[tuple[str, int, int]]:
        """The words `with_prefix(prefix)` lists (`prefix` whole UTF-8), grouped by the character that follows the
        prefix: (char, start, end), positions in that list; the word equal to the prefix is in no group. Each group
        is contiguous, the list being in byte order: one bisection a character, not a pass over the words."""
        n = len(prefix.decode("utf-8"))
        lo, hi = self._span(prefix)
        groups = []
        pos = lo
        while pos < hi:
            word = self.vocab[self._sorted[pos]]
            if len(word) <= n:  # the prefix itself
                pos += 1
                continue
            char = word[n]
            end = bisect.bisect_left(self._sorted_bytes, prefix + char.encode("utf-8") + b"\xff", pos, hi)
            groups.append((char, pos - lo, end - lo))
            pos = end
        return groups

    def _span(self, prefix: bytes) -> tuple[int, int]:
        """[lo, hi) in the byte-ordered words: those that start with `prefix`."""
        lo = bisect.bisect_left(self._sorted_bytes, prefix)
        hi = bisect.bisect_left(self._sorted_bytes, prefix + b"\xff")  # 0xff is in no UTF-8 text: past every match
        return lo, hi

    @functools.cached_property
    def _sorted_ids(self) -> torch.Tensor:
        return torch.tensor(self._sorted, dtype=torch.long)

    def token_id(self, token: bytes) -> int | None:
        """The id of the vocabulary entry whose bytes are `token` exactly (b" the"), or None."""
        try:
            return self._ids.get(token.decode("utf-8"))
        except UnicodeDecodeError:
            return None

    def first_char_probs(self, probs: torch.Tensor) -> dict[str, float]:
        """A next-token distribution `probs` (V,) summed by the entries' first character: the chance that the next
        character is c (" " for " the", "." for "."). `<unk>` without a space counts for no character: the unknown
        word's first letter is unknown."""
        chars, index = self._first_chars
        sums = torch.zeros(len(chars) + 1, dtype=probs.dtype).index_add_(0, index, probs.cpu())
        return {c: float(p) for c, p in zip(chars, sums[1:].tolist(), strict=True) if p > 0}

    @functools.cached_property
    def _first_chars(self) -> tuple[list[str], torch.Tensor]:
        """The entries' distinct first characters, and each entry's position among them + 1 (0: none, `<unk>`)."""
        chars = sorted({t[0] for i, t in enumerate(self.vocab) if i != _UNK_ID})
        at = {c: j + 1 for j, c in enumerate(chars)}
        return chars, torch.tensor([0 if i == _UNK_ID else at[t[0]] for i, t in enumerate(self.vocab)])

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for, its leading space included (b" the"); <unk>: b"<unk>" or b" <unk>"."""
        return self._bytes[token]

    def decode_bytes(self, ids: list[int] | torch.Tensor) -> bytes:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return b"".join(self._bytes[i] for i in ids)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.vocab[i] for i in ids)


def _spaced_body(token: str) -> bool:
    """Whether a token is the one space before a body (" word"), not a run of other whitespace."""
    return len(token) > 1 and token[0] == " " and not token[1].isspace()
