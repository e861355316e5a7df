"""Byte tokenizer: any bytes in, the same bytes out; token ids are byte values 0..255."""

from __future__ import annotations

import torch

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    vocab_size = 256

    def encode(self, data: str | bytes) -> list[int]:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return list(data)

    def encode_tensor(self, data: str | bytes) -> torch.Tensor:
        if isinstance(data, str):
            data = data.encode("utf-8")
        if not data:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # (T,)

    def decode_bytes(self, ids: list[int] | torch.Tensor) -> bytes:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(ids)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of the bytes; invalid UTF-8 becomes U+FFFD instead of raising."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
