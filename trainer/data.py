"""Token streams for truncated BPTT: each batch row is one contiguous stream through the corpus (its bytes, or the
token ids a word tokenizer made of it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["ByteStreams", "read_bytes", "read_corpus"]

DOC_SEPARATOR = b"\n\n"


def read_bytes(path: str | Path, limit: int = 0) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{p}: cannot read ({e.strerror})") from None
    if limit:
        data = data[:limit]
    if not data:
        raise ValueError(f"{p}: empty file")
    return data


def read_corpus(paths: Sequence[str | Path]) -> bytes:
    """Files joined by a blank line, in the order given."""
    return DOC_SEPARATOR.join(read_bytes(p) for p in paths)


class ByteStreams:
    """Split a corpus into `batch` equal contiguous rows and walk them in chunks of `bptt`.

    Chunk i of an epoch is rows[:, i*bptt : i*bptt + bptt + 1] (inputs and shifted targets); the
    caller carries the recurrent state from one chunk to the next and resets it at epoch starts.

    `shard=(rank, world)` keeps rows [rank * B / world, (rank + 1) * B / world) only: the processes of a
    distributed run together see exactly the rows one process with batch B sees.
    """

    def __init__(self, data: bytes | torch.Tensor, batch: int, bptt: int, shard: tuple[int, int] = (0, 1)) -> None:
        """`data`: the corpus's bytes, or its token ids (T,) int64."""
        row = len(data) // batch
        unit = "bytes" if isinstance(data, bytes) else "tokens"
        if row < bptt + 1:
            raise ValueError(f"corpus of {len(data)} {unit} is too small for {batch} streams of {bptt + 1} {unit}")
        rank, world = shard
        if batch % world:
            raise ValueError(f"{batch} streams cannot be shared equally by {world} processes")
        if isinstance(data, bytes):
            flat = torch.frombuffer(bytearray(data[: row * batch]), dtype=torch.uint8)
        else:
            flat = data[: row * batch]
        share = batch // world
        self.rows = flat.view(batch, row)[rank * share : (rank + 1) * share].long()  # (B / world, L)
        self.bptt = bptt
        self.chunks_per_epoch = (row - 1) // bptt

    def chunk(self, step: int) -> tuple[torch.Tensor, bool]:
        """The chunk for global step `step` and whether it starts an epoch. -> (B, bptt + 1)."""
        i = step % self.chunks_per_epoch
        return self.rows[:, i * self.bptt : i * self.bptt + self.bptt + 1], i == 0
