"""The flags of `adaptlm train`, shared with `python -m trainer` (what `torchrun -m trainer` runs): one definition
of the flags and of what they mean, two entry points. No torch at import: `adaptlm --help` stays quick."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig

__all__ = ["add_train_arguments", "config_from_args"]

# trainable architectures (models/registry.py), named without importing torch
_ARCHS = ("mlstm", "char-transformer", "compressive", "awd-lstm", "adaptive-transformer")
_FLAGS = ("max_steps", "max_minutes", "batch_size", "bptt", "lr", "seed", "threads")


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
    p.add_argument("--max-steps", type=int)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--batch-size", type=int, help="streams per step, over all processes of a distributed run")
    p.add_argument("--bptt", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, help="torch threads (per process)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N"
                                                    " (under torchrun: cuda:LOCAL_RANK)")


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
        if not Path(p).is_file():
            raise ValueError(f"{p}: no such file")
    if args.resume and not (Path(args.out) / "last" / "trainer_state.json").is_file():
        raise ValueError(f"{args.out}: nothing to resume")
    return cfg
