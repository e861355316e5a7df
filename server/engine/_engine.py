"""The engine: owns the model on one worker thread and runs every piece of model work there.

Callers on the event loop submit work and await a future; the loop itself never runs model code.
The worker takes one item at a time from a FIFO queue; dynamic batching will replace `_run`'s loop
(take the ready items, run one batched forward) without changing the public methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from models.checkpoint import Checkpoint, load_checkpoint
from models.scoring import ScoreResult, score_bytes

__all__ = ["Engine", "EngineUnavailable", "ModelInfo"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine is not running (not started, stopped, or its worker thread died)."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_hash: str  # sha256 of the weights
    created: int  # unix time the weights were written
    path: Path


@dataclass
class _Work:
    run: Callable[[Checkpoint], Any]
    future: Future[Any]


class Engine:
    """Loads a checkpoint and runs model work on its own thread, one item at a time."""

    def __init__(self, checkpoint: str | Path, *, thread_name: str = "adaptlm-engine") -> None:
        self._path = Path(checkpoint)
        self._thread_name = thread_name
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        # Guards _running together with the queue, so no work is queued behind the stop sentinel.
        self._lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None

    # -- lifecycle (blocking; call from a thread, not the event loop) ------------------------------

    def start(self) -> None:
        """Start the worker thread and load the checkpoint on it; raises CheckpointError on a bad one."""
        if self._thread is not None:
            raise RuntimeError("an engine starts once")
        loaded: Future[ModelInfo] = Future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name=self._thread_name, daemon=True)
        self._thread.start()
        self._info = loaded.result()
        log.info("loaded %s from %s (weights sha256 %s)", self._info.name, self._info.path,
                 self._info.model_hash[:12])

    def stop(self, timeout: float | None = None) -> None:
        """Finish the work already queued, then end the worker thread. Idempotent."""
        with self._lock:
            if self._running:
                self._running = False
                self._queue.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The model is loaded and the worker thread is taking work."""
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._info

    # -- work --------------------------------------------------------------------------------------

    async def score(self, data: bytes, logprobs: bool = False) -> ScoreResult:
        """Bits (and optionally per-byte natural-log probabilities) of `data`, scored from the initial state."""

        def run(ckpt: Checkpoint) -> ScoreResult:
            result = score_bytes(ckpt.model, data, logprobs=logprobs)
            return dataclasses.replace(result, state=None)  # the state stays on the worker

        return await self._submit(run)

    async def _submit(self, run: Callable[[Checkpoint], T]) -> T:
        future: Future[T] = Future()
        with self._lock:
            if not self.alive:
                raise EngineUnavailable("the engine is not running")
            self._queue.put(_Work(run, future))
        # Cancelling the awaiting task cancels `future`; the worker then skips the item.
        return await asyncio.wrap_future(future)

    def _run(self, loaded: Future[ModelInfo]) -> None:
        try:
            ckpt = load_checkpoint(self._path)
            weights = self._path / "model.safetensors"
            info = ModelInfo(name=ckpt.name, model_hash=ckpt.model_hash, created=int(weights.stat().st_mtime),
                             path=self._path)
        except BaseException as e:
            loaded.set_exception(e)
            return
        with self._lock:
            self._running = True
        loaded.set_result(info)
        try:
            while (work := self._queue.get()) is not None:
                if not work.future.set_running_or_notify_cancel():
                    continue
                try:
                    result = work.run(ckpt)
                except Exception as e:
                    work.future.set_exception(e)
                else:
                    work.future.set_result(result)
        finally:
            self._fail_pending()

    def _fail_pending(self) -> None:
        """On the way out (a stop, or a crash of the loop): nothing may wait on a future forever."""
        with self._lock:
            self._running = False
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return
            if work is not None and work.future.set_running_or_notify_cancel():
                work.future.set_exception(EngineUnavailable("the engine stopped"))
