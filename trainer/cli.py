"""The flags of `adaptlm train`, shared with `python -m trainer` (what `torchrun -m trainer` runs): one definition
of the flags and of what they mean, two entry points. No torch at import: `adaptlm --help` stays quick."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.train import TrainResult

__all__ = ["add_train_arguments", "config_from_args", "run_command", "summary"]

# trainable architectures (models/registry.py), named without importing torch
_ARCHS = ("mlstm", "char-transformer", "compressive", "awd-lstm", "adaptive-transformer")
_FLAGS = ("max_steps", "max_minutes", "batch_size", "bptt", "lr", "seed", "threads", "init_from")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The training flags, on `p`."""
    p.add_argument("--arch", choices=list(_ARCHS), default=None)
    p.add_argument("--preset", choices=["tiny", "default", "small", "gpu"], default=None,
                   help="tiny, default (mlstm); tiny, small, gpu (char-transformer, compressive); tiny (awd-lstm); "
                        "tiny, small (adaptive-transformer): trainer/config.py")
    p.add_argument("--config", help="JSON or TOML file of training settings")
    p.add_argument("--data", nargs="+", required=True, help="training text files")
    p.add_argument("--valid", help="validation text file")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--resume", action="store_true", help="continue from OUT/last")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint OUT already holds (without it, an OUT that holds one is refused)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--batch-size", type=int, help="streams per step, over all processes of a distributed run")
    p.add_argument("--bptt", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, help="torch threads (per process)")
    p.add_argument("--init-from", metavar="CHECKPOINT",
                   help="start from this checkpoint's weights (same architecture, model settings and tokenizer) on "
                        "a fresh optimizer and schedule")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N"
                                                    " (under torchrun: cuda:LOCAL_RANK)")


def run_command(prog: str, run: Callable[[], dict[str, Any] | None]) -> int:
    """A training run as a command: `run()` trains and returns its summary line (None: a process that prints none),
    printed as JSON, status 0. Otherwise one line on stderr and the status: 2 for a user mistake (ValueError), 128 +
    the signal for a run stopped by SIGINT or SIGTERM (its state saved first), 1 for a file that cannot be written
    or a loss that became non-finite."""
    from trainer.train import CannotWrite, TrainingDiverged, TrainingInterrupted

    try:
        line = run()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:  # the state is saved: a message, not a traceback; the shell's status
        print(f"{prog}: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
    except (CannotWrite, TrainingDiverged) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    if line is not None:
        print(json.dumps(line))
    return 0


def summary(result: TrainResult, processes: int | None = None) -> dict[str, Any]:
    """The line a finished run prints (JSON: `best_valid_bpb` null when nothing was validated)."""
    best = result.best_valid_bpb
    return {"out": str(result.out), "best_valid_bpb": best if math.isfinite(best) else None, "steps": result.steps,
            "seconds": round(result.seconds, 1), **({"processes": processes} if processes is not None else {})}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The training configuration the flags ask for, with the files they name checked; ValueError when not."""
    from trainer.config import load_config_file, make_config

    layers: list[dict[str, Any]] = []
    if args.config:
        layers.append(load_config_file(args.config))
    flags: dict[str, Any] = {"arch": args.arch} if args.arch else {}
    for name in _FLAGS:
        value = getattr(args, name)
        if value is not None:
            flags[name] = value
    layers.append(flags)
    try:
        cfg = make_config(args.preset, *layers)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if cfg.arch not in _ARCHS:
        raise ValueError(f"architecture {cfg.arch!r} cannot be trained yet (available: {', '.join(_ARCHS)})")
    for p in [*args.data, *([args.valid] if args.valid else [])]:
        if Path(p).is_dir():
            raise ValueError(f"{p}: a directory, not a text file")
        if not Path(p).is_file():
            raise ValueError(f"{p}: no such file")
    _check_out(Path(args.out), resume=args.resume, overwrite=args.overwrite)
    return cfg


def _check_out(out: Path, *, resume: bool, overwrite: bool) -> None:
    """`--out` can be written, and holds nothing a run would silently destroy: a checkpoint there is continued
    (`--resume`) or replaced (`--overwrite`), never overwritten by a typo."""
    from trainer.train import has_resumable_state

    if resume and overwrite:
        raise ValueError("--resume continues the run in OUT, --overwrite replaces it: not both")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    existing = out if out.exists() else next((p for p in out.absolute().parents if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{out}: cannot write there ({existing or out} is not a writable directory)")
    if resume:
        if not has_resumable_state(out / "last"):
            raise ValueError(f"{out}: nothing to resume")
        return
    held = [name for name in ("config.json", "model.safetensors", "last") if (out / name).exists()]
    if held and not overwrite:
        raise ValueError(f"{out}: already holds a checkpoint ({', '.join(held)}); continue its run with --resume, "
                         "replace it with --overwrite, or choose another --out")
