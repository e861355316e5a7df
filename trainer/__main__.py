"""`python -m trainer`: `adaptlm train` as one process of a distributed run.

    torchrun --nproc_per_node N -m trainer --preset default --data train.txt --valid valid.txt --out ck

takes the flags of `adaptlm train`; each of the N processes trains on batch_size / N of the streams (gloo on
the CPU, NCCL on CUDA devices: one GPU per process) and rank 0 writes the checkpoint. Without torchrun it is
`adaptlm train`. A user mistake prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, on_log: Callable[[dict[str, Any]], None] | None = None) -> int:
    from trainer.cli import add_train_arguments, config_from_args, run_command, summary

    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    from trainer.train import train

    def run() -> dict[str, Any] | None:
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
        return summary(result, group.world) if group.main else None  # rank 0 prints the line

    return run_command("trainer", run)


if __name__ == "__main__":
    raise SystemExit(main())
