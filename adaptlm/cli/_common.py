"""What every command group shares: the one-line usage error, the parser that reports through it, reading the
checkpoint, the device and the input text, and writing an output whole."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn


class UsageError(Exception):
    """A user mistake: reported in one line, exit status 2."""


def fail(message: str) -> NoReturn:
    print(f"adaptlm: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def pick_device(name: str | None) -> Any:
    from models.device import resolve_device

    try:
        return resolve_device(name or "auto")
    except ValueError as e:
        raise UsageError(str(e)) from None


def load(checkpoint: str | None, device: str | None = None) -> Any:
    from models.checkpoint import CheckpointError, load_checkpoint
    from server.settings import DEFAULT_CHECKPOINT

    try:
        return load_checkpoint(checkpoint or DEFAULT_CHECKPOINT, device=pick_device(device))
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def read_text_arg(path: str) -> bytes:
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    if not data:
        raise UsageError(f"{path}: empty text: nothing to score")
    return data


def check_output(path: str) -> None:
    """Refuse an output path that cannot be written, before the work that fills it (which may take minutes)."""
    out = Path(path)
    if path.endswith("/") or out.is_dir():
        raise UsageError(f"{path}: is a directory, not a file to write")
    if not out.parent.is_dir():
        raise UsageError(f"{path}: cannot write (no directory {str(out.parent)!r})")


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a temporary file beside `path`, then rename it over `path`: the output is written whole or
    not at all, so that a failure or Ctrl-C half-way leaves what was there (a checkpoint's dyneval.json stays
    readable) and no partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)


def per_word(bits_per_word: float | None, perplexity: float | None) -> str:
    """A word model's figures, as its record has them (`models.scoring.WordFigures`), for a text line after its bits
    per byte (score, eval, client score); "" for bytes, or nothing scored."""
    if bits_per_word is None or perplexity is None:
        return ""
    return f", {bits_per_word:.4f} bits per word, perplexity {perplexity:.2f}"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)
