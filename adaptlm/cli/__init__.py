"""`adaptlm` command line: train, score, generate, eval, tune, serve, and `client ...` (the SDK, against a server).

User mistakes (bad flags, unreadable files, bad checkpoints, empty text) print one line to stderr and
exit with status 2; no tracebacks. Ctrl-C exits 130; a standard output closed early (`| head`) 141, quietly.
`adaptlm client` commands print the server's error in one line and exit with 2 when the request was at fault
(a 4xx answer), 1 when the server failed or could not be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from adaptlm.cli import _client, _keysim, _models, _serve
from adaptlm.cli._common import Parser, UsageError, fail

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="adaptlm", description="Adaptive language models: train, score, generate, serve, and a "
                                           "client of the server.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in (_models, _serve, _keysim, _client):  # in this order in `adaptlm --help`
        group.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        status = int(args.func(args))
        sys.stdout.flush()  # a closed standard output raises here, in the handler below, rather than at exit
        return status
    except UsageError as e:
        fail(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of standard output went away (`| head`): stop quietly, as a process that SIGPIPE ends would
        # (Python ignores SIGPIPE, so the write raised); stdout goes to /dev/null so that the flush at exit cannot
        # raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


