"""`python -m trainer`: `adaptlm train` as one process of a distributed run.

    torchrun --nproc_per_node N -m trainer --preset default --data train.txt --valid valid.txt --out ck

takes the flags of `adaptlm train`; each of the N processes trains on batch_size / N of the streams (gloo on
the CPU, NCCL on CUDA devices: one GPU per process) and rank 0 writes the checkpoint. Without torchrun it is
`adaptlm train`. A user mistake prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, on_log: Callable[[dict[str, Any]], None] | None = None) -> int:
    from trainer.cli import add_train_arguments, config_from_args, summary

    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    from trainer.train import CannotWrite, TrainingInterrupted, train

    try:
        cfg = config_from_args(args)
        from models.device import resolve_device
        from trainer import _dist

        device = _dist.init(resolve_device(args.device))
        clean = False
        try:
            group = _dist.current()
            result = train(cfg, args.data, args.out, valid_path=args.valid, resume=args.resume,
                           progress=not args.quiet, on_log=on_log, device=device)
            clean = True
        finally:
            _dist.shutdown(clean)
    except ValueError as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    except TrainingInterrupted as e:  # the state is saved: a message, not a traceback; the shell's status
        print(f"trainer: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
    except CannotWrite as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 1
    if group.main:
        print(json.dumps(summary(result, group.world)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
