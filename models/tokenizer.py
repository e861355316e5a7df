"""Tokenizers, saved with a checkpoint (config.json "tokenizer"): bytes (token ids are byte values 0..255), and words
(models/word_tokenizer.py: a vocabulary built from training text, saved in config.json).

Everything that turns text into model inputs asks the tokenizer (`Tokenizer`, the protocol every kind implements):
the ids of a text, the token that starts a stream (`bos`), the stable part of a text arriving in pieces, the bytes
each token stands for (`token_bytes`, which the suggestion search and the keyboard simulator use to tell word
characters from word ends), and what a score reports per token. Code outside models/ asks the protocol, never which
kind it holds. Each kind builds itself from what `to_dict` wrote (`from_dict`); `tokenizer_from_dict` picks the kind
from the registry `KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from models._streams import StreamMixin
from models.word_tokenizer import WordTokenizer

__all__ = ["KINDS", "ByteTokenizer", "Tokenizer", "WordTokenizer", "byte_level", "tokenizer_from_dict", "word_level"]

# Every text is scored after this context byte, so its first byte is predicted too (a newline is the most
# common document start in the training text).
_NEWLINE = 0x0A


class ByteTokenizer(StreamMixin):
    """Any bytes in, the same bytes out; token ids are byte values."""

    kind = "bytes"
    unit = "byte"
    reports_tokens = False  # a token is a byte: bits per token are bits per byte
    vocab_size = 256
    bos = _NEWLINE  # the token before a stream's first one
    unknown: tuple[int, ...] = ()  # no unknown token: every byte is its own

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer) and other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def to_dict(self) -> dict[str, Any] | str:
        return self.kind  # a kind with settings (a word vocabulary) writes an object

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> ByteTokenizer:
        """The inverse of `to_dict` (no settings: the name, or any object of this kind)."""
        return cls()

    def encode(self, data: str | bytes) -> list[int]:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return list(data)

    def encode_tensor(self, data: str | bytes, device: torch.device | str = "cpu") -> torch.Tensor:
        if isinstance(data, str):
            data = data.encode("utf-8")
        if not data:
            return torch.zeros(0, dtype=torch.long, device=device)
        # (a copy to a GPU that does not wait for its queue: the bytes are staged before it returns)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device, non_blocking=True).long()  # (T,)

    def last_token(self, data: bytes) -> int:
        """The token a stream continues from after `data` (non-empty)."""
        return data[-1]

    def split_stable(self, data: bytes) -> tuple[bytes, bytes]:
        """(stable, pending) of text arriving in pieces (`WordTokenizer.split_stable`): a byte is its own token, so
        every byte is stable and nothing waits."""
        return data, b""

    def heal(self, data: bytes) -> tuple[bytes, bytes]:
        """(kept, held) of a prompt for token healing (`WordTokenizer.heal`): no byte token spans others, so no cut
        moves and nothing is held."""
        return data, b""

    def continuing(self, held: bytes) -> torch.Tensor:
        """The (n,) tokens that may come next while `held` is still to be generated: its first byte."""
        return torch.tensor(list(held[:1]), dtype=torch.long)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for."""
        return bytes([token])

    def pieces(self, data: bytes) -> list[bytes]:
        """`data` cut at its tokens: its bytes."""
        return [bytes([b]) for b in data]

    def token_texts(self, data: str | bytes) -> None:
        """None: a byte model's tokens are the text's bytes, reported as such (`WordTokenizer.token_texts`)."""
        return None

    def decode_bytes(self, ids: list[int] | torch.Tensor) -> bytes:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(ids)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of the bytes; invalid UTF-8 becomes U+FFFD instead of raising."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class Tokenizer(Protocol):
    """What every kind of tokenizer is to its callers (ByteTokenizer, WordTokenizer): token ids of text and back, the
    stream a text is scored as, and what a score reports per token."""

    @property
    def kind(self) -> str:
        """Its name in config.json and on the wire ("bytes", "words")."""

    @property
    def unit(self) -> str:
        """What one token is, for messages ("byte", "word")."""

    @property
    def reports_tokens(self) -> bool:
        """Whether a score reports per token too (tokens, bits per word, perplexity, token texts; docs/algorithms.md
        §13): a token is not one byte, so bits per token say something bits per byte do not."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos(self) -> int:
        """The token before a stream's first one."""

    @property
    def unknown(self) -> tuple[int, ...]:
        """The unknown token's ids, which generation never samples."""

    def to_dict(self) -> dict[str, Any] | str: ...

    def encode(self, data: str | bytes) -> list[int]: ...

    def encode_tensor(self, data: str | bytes, device: torch.device | str = "cpu") -> torch.Tensor: ...

    def decode(self, ids: list[int] | torch.Tensor) -> str: ...

    def decode_bytes(self, ids: list[int] | torch.Tensor) -> bytes: ...

    def stream(self, data: str | bytes, last_token: int | None = None,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """-> inputs, targets (T,) of `data` continuing after `last_token` (None: `bos`)."""

    def last_token(self, data: bytes) -> int:
        """The token a stream continues from after `data` (non-empty)."""

    def split_stable(self, data: bytes) -> tuple[bytes, bytes]:
        """(stable, pending) of text arriving in pieces: the tokens of `stable` are those of any text continuing it."""

    def heal(self, data: bytes) -> tuple[bytes, bytes]:
        """(kept, held) of a prompt: `held`'s token cuts may still move with what follows (token healing)."""

    def continuing(self, held: bytes) -> torch.Tensor:
        """The (n,) tokens that may come next while `held` is still to be generated."""

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for."""

    def pieces(self, data: bytes) -> list[bytes]:
        """`data` cut at its tokens ("".join gives it back; an unknown word keeps its own text)."""

    def token_texts(self, data: str | bytes) -> list[str] | None:
        """The text of each token of `data` as written there, for a score's per-token record; None where the tokens
        are the text's bytes."""


# the kinds by name: each builds itself from what its `to_dict` wrote
KINDS: dict[str, Callable[[Mapping[str, Any] | str], Tokenizer]] = {"bytes": ByteTokenizer.from_dict,
                                                                  "words": WordTokenizer.from_dict}


def byte_level(tokenizer: Tokenizer) -> ByteTokenizer | None:
    """The tokenizer if each of its tokens is one byte, which the byte suggestion search (models/suggest.py) reads;
    else None."""
    return tokenizer if isinstance(tokenizer, ByteTokenizer) else None


def word_level(tokenizer: Tokenizer) -> WordTokenizer | None:
    """The tokenizer if it reads words from a vocabulary, which the word suggestion search reads; else None."""
    return tokenizer if isinstance(tokenizer, WordTokenizer) else None


def tokenizer_from_dict(data: Mapping[str, Any] | str | None) -> Tokenizer:
    """A checkpoint's tokenizer: {"kind": ..., its settings}, or its kind's name alone (None: bytes)."""
    if data is not None and not isinstance(data, str | Mapping):
        raise ValueError(f"tokenizer must be an object or a name, not {data!r}")
    kind = data if isinstance(data, str) else (data or {}).get("kind", "bytes")
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer {kind!r}; known: {', '.join(sorted(KINDS))}")
    return KINDS[kind](data if data is not None else kind)
