"""The `adaptlm` command line run in the test process: `adaptlm.cli.main(argv)` with its own standard streams, as a
subprocess would run it, without the seconds each `python -m adaptlm` pays to import torch.

The result is shaped like `subprocess.CompletedProcess` (returncode, stdout and stderr as text, stdout_bytes for
a command that writes binary). A command runs on one torch thread. What it may change in the process is put back
after it: torch's thread count and random state, Python's random state, the SIGINT and SIGTERM handlers, the root
logger, the environment, the working directory. Tests whose subject is the process itself (the entry point,
signals, a closed pipe, an exit status under a signal) still run `python -m adaptlm` as a subprocess.
"""

from __future__ import annotations

import io
import logging
import os
import random
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO


@dataclass
class CliResult:
    args: list[str]
    returncode: int
    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "surrogateescape")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "surrogateescape")


class _ThisThread(logging.Filter):
    """Only the records of one thread: a server thread of the same test process logs into its own capture."""

    def __init__(self, ident: int) -> None:
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread == self.ident


@contextmanager
def _process_state(env: Mapping[str, str | None]) -> Iterator[None]:
    """Put back, after the block, what a command may change in the process (see the module's docstring)."""
    import torch

    environ = dict(os.environ)
    cwd = os.getcwd()
    threads = torch.get_num_threads()
    rng = torch.random.get_rng_state()
    py_rng = random.getstate()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    handler_state = [(h, h.formatter, list(h.filters)) for h in root_handlers]  # `serve` reformats them
    # One torch thread, as the `adaptlm` subprocesses of a test run had (OMP_NUM_THREADS=1): the models under test
    # are tiny, and a second thread that waits for a busy core turns each small op into a wait for a time slice.
    torch.set_num_threads(1)
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        random.setstate(py_rng)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        root.setLevel(root_level)
        root.handlers[:] = root_handlers
        for h, formatter, filters in handler_state:
            h.setFormatter(formatter)
            h.filters[:] = filters


def run_cli(*args: str, stdin: bytes | None = None, env: Mapping[str, str | None] | None = None,
            stdout: IO[bytes] | None = None) -> CliResult:
    """`adaptlm ARGS` in this process: `stdin` is its standard input (default: empty), `env` sets (a value) or
    removes (None) environment variables for the command, `stdout` is a binary file to write standard output to
    instead of capturing it (a terminal). An exception the command lets out is its traceback on stderr and status 1;
    warnings and the log records of the command's thread (WARNING and up) go to its stderr, as in a process of its
    own."""
    from adaptlm.cli import main

    out_buffer: IO[bytes] = io.BytesIO() if stdout is None else stdout
    err_buffer = io.BytesIO()
    new_in = io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8", errors="surrogateescape")
    new_out = io.TextIOWrapper(out_buffer, encoding="utf-8", errors="surrogateescape", write_through=True)
    new_err = io.TextIOWrapper(err_buffer, encoding="utf-8", errors="backslashreplace", write_through=True)
    log_handler = logging.StreamHandler(new_err)
    log_handler.setLevel(logging.WARNING)
    log_handler.addFilter(_ThisThread(threading.get_ident()))
    saved = sys.stdin, sys.stdout, sys.stderr
    with _process_state(env or {}), warnings.catch_warnings():
        warnings.resetwarnings()  # Python's default filters: each warning printed once, to stderr
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.simplefilter("default")
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = _show_on_stderr
        logging.getLogger().addHandler(log_handler)
        sys.stdin, sys.stdout, sys.stderr = new_in, new_out, new_err
        try:
            status = main(list(args))
        except SystemExit as e:
            status = _exit_status(e.code)
        except BaseException:  # as an uncaught exception ends a process: the traceback, status 1
            traceback.print_exc()
            status = 1
        finally:
            sys.stdin, sys.stdout, sys.stderr = saved
            logging.getLogger().removeHandler(log_handler)
            new_err.flush()
            if stdout is None:
                new_out.flush()
            else:
                new_out.detach()  # the caller's file stays open
    captured = out_buffer.getvalue() if isinstance(out_buffer, io.BytesIO) else b""
    return CliResult(["adaptlm", *args], int(status), captured, err_buffer.getvalue())


def _show_on_stderr(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: IO[str] | None = None, line: str | None = None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _exit_status(code: object) -> int:
    """SystemExit's code as the process's exit status: None 0, a number itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
