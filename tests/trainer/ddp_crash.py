"""A torchrun worker for tests/trainer/test_distributed.py: `python -m trainer` whose rank 0 dies abruptly (no
clean-up, as a killed process would) right after logging the validation of step STOP. Usage: ddp_crash.py STOP
FLAGS... The other ranks are left waiting at rank 0's barrier until torchrun, seeing rank 0 gone, stops them."""

import os
import sys
from typing import Any

from trainer.__main__ import main

STOP = int(sys.argv[1])


def on_log(record: dict[str, Any]) -> None:
    if record.get("step") == STOP and "valid_bpb" in record:
        os._exit(3)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[2:], on_log=on_log))
