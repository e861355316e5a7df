"""Helpers the bench scripts have in common: where the corpora are, the machine line for docs/benchmarks.md, the
suggestion case the latency columns time."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import torch

from models.base import LanguageModel
from models.scoring import BOS
from models.suggest import Suggestions, advance, suggest
from models.tokenizer import ByteTokenizer
from server.launch import free_port, serving, stop

ROOT = Path(__file__).resolve().parent.parent
# the corpora directory (docs/benchmarks.md, "The corpora"): the texts are not in the repository, so a script that
# reads one needs this variable
DATA_VARIABLE = "ADAPTLM_DATA"
FAMILY_TEXT = "gutenberg/chesterton-brown.txt"  # the --text of family_args, in the corpora directory
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "default"
FAMILIES = ("default", "char-transformer", "compressive")  # the shipped byte-level checkpoints, one per family


def family_args(ap: argparse.ArgumentParser) -> None:
    """The flags the scripts that compare the families share: --checkpoints (the shipped ones present) and --text."""
    ap.add_argument("--checkpoints", nargs="+",
                    default=[str(ROOT / "checkpoints" / f) for f in FAMILIES if (ROOT / "checkpoints" / f).is_dir()])
    ap.add_argument("--text", help=f"the text to time on (default: {FAMILY_TEXT} of ${DATA_VARIABLE})")


def family_text(args: argparse.Namespace) -> Path:
    """The --text of `family_args`: the one given, or the corpora directory's FAMILY_TEXT."""
    return Path(args.text) if args.text else data_file(FAMILY_TEXT)


def data_dir() -> Path:
    """The corpora directory, $ADAPTLM_DATA. Unset or not a directory: a message and exit status 2, as for a bad
    command line, since a script that reads a corpus cannot run without it."""
    value = os.environ.get(DATA_VARIABLE, "")
    if not value:
        print(f"{DATA_VARIABLE} is not set: this script reads corpora that are not in the repository; set it to the "
              "corpora directory (docs/benchmarks.md, \"The corpora\")", file=sys.stderr)
        raise SystemExit(2)
    path = Path(value)
    if not path.is_dir():
        print(f"{DATA_VARIABLE}={value} is not a directory (docs/benchmarks.md, \"The corpora\")", file=sys.stderr)
        raise SystemExit(2)
    return path


def data_file(rel: str | Path) -> Path:
    """A file or folder of the corpora directory, by its path in there (e.g. "gutenberg/austen-persuasion.txt")."""
    return data_dir() / rel


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


@contextmanager
def redis_on_loopback(unix_socket: bool = False) -> Iterator[str]:
    """A redis-server of our own (no persistence) on a free loopback port, or on a unix socket in a temporary
    directory, until the block ends -> its URL."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        if unix_socket:
            sock = Path(tmp) / "redis.sock"
            where, url = ["--port", "0", "--unixsocket", str(sock)], f"unix://{sock}"
        else:
            port = free_port()
            where, url = ["--port", str(port), "--bind", "127.0.0.1"], f"redis://127.0.0.1:{port}/0"
        process = subprocess.Popen([binary, *where, "--save", "", "--appendonly", "no", "--dir", tmp,
                                    "--logfile", str(Path(tmp) / "redis.log")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    with redis.Redis.from_url(url) as client:
                        client.ping()
                    break
                except (redis.ConnectionError, FileNotFoundError) as e:
                    if process.poll() is not None or time.monotonic() > deadline:
                        log = (Path(tmp) / "redis.log").read_text() if (Path(tmp) / "redis.log").exists() else ""
                        raise RuntimeError(f"redis-server did not start: {log}") from e
                    time.sleep(0.05)
            yield url
        finally:
            stop(process, 10)


@contextmanager
def server_on_loopback(checkpoint: str | Path, settings: dict[str, str] | None = None,
                       start_s: float = 300.0) -> Iterator[str]:
    """`adaptlm serve` of `checkpoint` on a free loopback port (one torch thread, warnings only; `settings`: more
    environment, ADAPTLM_* settings) until the block ends, then SIGTERM -> its URL. Its log is said if it fails to
    start."""
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp, \
            serving(checkpoint, Path(tmp) / "server.log", {"OMP_NUM_THREADS": "1", "ADAPTLM_LOG_LEVEL": "warning"}
                    | (settings or {}), start_s=start_s) as served:
        yield served.url
