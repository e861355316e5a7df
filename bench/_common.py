"""Shared helpers for bench scripts: where the data is, the machine line for docs/benchmarks.md, the suggestion case
the latency columns time."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path

import torch

from models.base import LanguageModel
from models.scoring import BOS
from models.suggest import Suggestions, advance, suggest
from models.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("ADAPTLM_SHARED", ROOT.parent / "shared")) / "data"
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "default"
FAMILIES = ("default", "char-transformer", "compressive")  # the shipped byte-level checkpoints, one per family


def family_args(ap: argparse.ArgumentParser) -> None:
    """The flags the scripts that compare the families share: --checkpoints (the shipped ones present) and --text."""
    ap.add_argument("--checkpoints", nargs="+",
                    default=[str(ROOT / "checkpoints" / f) for f in FAMILIES if (ROOT / "checkpoints" / f).is_dir()])
    ap.add_argument("--text", default=str(SHARED / "gutenberg" / "chesterton-brown.txt"))


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{datetime.date.today().isoformat()}, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def first_bytes(path: Path, n: int) -> bytes:
    return path.read_bytes()[:n]


def word_context(text: bytes, start: int, end: int) -> str:
    """text[start:end] as text, cut two characters into its last word: a context whose suggestions complete a
    two-letter prefix."""
    context = text[start:end].decode("utf-8", errors="ignore")
    return context[: context.rfind(" ") + 3]


def suggest_afresh(model: LanguageModel, context: str, tokenizer: ByteTokenizer) -> Suggestions:
    """A suggestion from the initial state: the model fed the start token and the whole context (the cursor after
    it), then `suggest`, as bench.families' and bench.latency's "suggest ms" time it."""
    cursor = advance(model, model.init_state(1), bytes([BOS]) + context.encode())
    return suggest(model, cursor, context, tokenizer=tokenizer)
