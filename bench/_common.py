"""Shared helpers for bench scripts: where the data is, the machine line for docs/benchmarks.md."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("ADAPTLM_SHARED", ROOT.parent / "shared")) / "data"
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "default"


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
