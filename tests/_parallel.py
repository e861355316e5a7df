"""Running the tests in parallel (pytest-xdist: `-n 3` in pyproject.toml's addopts): what the worker processes of one
run share. Each worker's base temporary directory is a folder of the run's own (`<run>/popen-gw0`, ...), so `<run>`
is where they meet: what is built once for all of them, and the locks that let a test run alone."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in a worker; None in a run without workers


def run_folder(basetemp: Path) -> Path | None:
    """The folder the workers of this run share, from a worker's base temporary directory (None without workers)."""
    return basetemp.parent if WORKER is not None else None


@contextmanager
def _locked(path: Path, mode: int) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(path)` (a path that does not exist yet) once in the run: the first worker that asks builds it, the others
    wait for it and share it. Only for what tests read and never change (a checkpoint they copy before writing)."""
    shared = run_folder(factory.getbasetemp())
    if shared is None:
        out = factory.mktemp(name) / name
        build(out)
        return out
    folder = shared / "built"
    folder.mkdir(exist_ok=True)
    out, done = folder / name, folder / f"{name}.done"
    with _locked(folder / f"{name}.lock", fcntl.LOCK_EX):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # left by a worker that failed half-way
            build(out)
            done.touch()
    return out


class Turns:
    """Tests run side by side on the workers, except the calls of those marked `alone` (they measure latency or
    throughput, which a test on the other core would distort): such a call waits until the tests running on the
    other workers have ended, and those start no other until it ends. Its setup and teardown (a server started or
    stopped, a session made) run beside the others: nothing there is timed, and they are seconds the other workers
    would otherwise spend waiting. A readers-writer lock over two files of the run's folder: a test holds the room
    shared from its setup to its teardown, and an `alone` call exclusively; each passes the turnstile to get in, and
    an `alone` call keeps the turnstile while it waits for the room, so that the other workers' next tests cannot
    overtake it."""

    def __init__(self, folder: Path) -> None:
        self.turnstile, self.room = folder / "alone.turnstile", folder / "alone.room"
        self._held: IO[str] | None = None  # the room's file while this worker's test holds it

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A test's turn, setup to teardown: the room shared."""
        with self.room.open("a") as room:
            with _locked(self.turnstile, fcntl.LOCK_EX):
                fcntl.flock(room, fcntl.LOCK_SH)
            self._held = room
            try:
                yield
            finally:
                self._held = None
                fcntl.flock(room, fcntl.LOCK_UN)

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Within `turn()`: the room alone for the block (an `alone` test's call), then shared again."""
        room = self._held
        assert room is not None, "alone() outside a test's turn"
        # the shared hold is let go before the turnstile is taken: two workers that each kept theirs while waiting
        # for the room alone would wait for each other
        fcntl.flock(room, fcntl.LOCK_UN)
        with _locked(self.turnstile, fcntl.LOCK_EX):
            fcntl.flock(room, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_SH)  # (not atomic: another `alone` call may come first; this then waits)
