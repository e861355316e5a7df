"""Tokenizers, saved with a checkpoint (config.json "tokenizer"): bytes (token ids are byte values 0..255), and words
(models/word_tokenizer.py: a vocabulary built from training text, saved in config.json).

Everything that turns text into model inputs asks the tokenizer: the ids of a text, the token that starts a
stream (`bos`), the bytes each token stands for (`token_bytes`, which the suggestion search and the keyboard
simulator use to tell word characters from word ends). Each kind builds itself from what `to_dict` wrote
(`from_dict`); `tokenizer_from_dict` picks the kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from models._streams import StreamMixin
from models.word_tokenizer import WordTokenizer

__all__ = ["ByteTokenizer", "Tokenizer", "WordTokenizer", "tokenizer_from_dict"]

# Every text is scored after this context byte, so its first byte is predicted too (a newline is the most
# common document start in the training text).
_NEWLINE = 0x0A


class ByteTokenizer(StreamMixin):
    """Any bytes in, the same bytes out; token ids are byte values."""

    kind = "bytes"
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
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device).long()  # (T,)

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

    def decode_bytes(self, ids: list[int] | torch.Tensor) -> bytes:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(ids)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of the bytes; invalid UTF-8 becomes U+FFFD instead of raising."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


Tokenizer = ByteTokenizer | WordTokenizer  # the kinds; each implements the interface above

_KINDS: dict[str, type[ByteTokenizer] | type[WordTokenizer]] = {"bytes": ByteTokenizer, "words": WordTokenizer}


def tokenizer_from_dict(data: Mapping[str, Any] | str | None) -> Tokenizer:
    """A checkpoint's tokenizer: {"kind": ..., its settings}, or its kind's name alone (None: bytes)."""
    if data is not None and not isinstance(data, str | Mapping):
        raise ValueError(f"tokenizer must be an object or a name, not {data!r}")
    kind = data if isinstance(data, str) else (data or {}).get("kind", "bytes")
    if kind not in _KINDS:
        raise ValueError(f"unknown tokenizer {kind!r}; known: {', '.join(sorted(_KINDS))}")
    return _KINDS[kind].from_dict(data if data is not None else kind)
