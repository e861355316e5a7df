"""The engine: owns the model on one worker thread and runs every piece of model work there.

Callers on the event loop submit work and await a future (scoring) or read a stream of events
(generation); the loop itself never runs model code. Each round, the worker takes the queued items in
order (a score runs whole; a generation is prefilled and joins the active ones), then samples one byte
of every active generation, checking each for cancellation first. Dynamic batching will replace
`_loop`'s rounds (one batched prefill for the new items, one batched forward for the active ones)
without changing the public methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from models.checkpoint import Checkpoint, load_checkpoint
from models.sampling import SamplingParams
from models.scoring import ScoreResult, score_bytes
from server.engine._generation import EngineStats, GenerationJob, GenerationStream

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

    def fail(self, error: BaseException) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)


class Engine:
    """Loads a checkpoint and runs all model work on its own thread: scores one at a time, generations
    interleaved a byte at a time."""

    def __init__(self, checkpoint: str | Path, *, thread_name: str = "adaptlm-engine") -> None:
        self._path = Path(checkpoint)
        self._thread_name = thread_name
        self._queue: queue.SimpleQueue[_Work | GenerationJob | None] = queue.SimpleQueue()
        # Guards _running together with the queue, so no work is queued behind the stop sentinel.
        self._lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None
        self._stats = EngineStats()

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
    def stats(self) -> EngineStats:
        """A copy of the work counters."""
        return dataclasses.replace(self._stats)

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

    def generate(self, prompt: bytes, params: SamplingParams | None, *, n: int = 1, logprobs: int | None = None,
                 prompt_logprobs: bool = False) -> GenerationStream:
        """Start `n` continuations of `prompt` (from the initial state after the BOS byte); call on the event
        loop, which then receives the events: `PromptScored` first if `prompt_logprobs`, then each sequence's
        `Token`s and its `Finished`. Sequence i > 0 uses seed + i.

        `params` None generates nothing (prompt log-probabilities only). `logprobs` = k adds to each sampled
        byte its log-probability and the k most likely bytes (and to each prompt byte, with `prompt_logprobs`).
        """
        if n < 1:
            raise ValueError("n must be at least 1")
        stream = GenerationStream(n, time.perf_counter())
        job = GenerationJob(stream, asyncio.get_running_loop(), prompt, params, n, logprobs, prompt_logprobs)
        self._put(job)
        return stream

    async def _submit(self, run: Callable[[Checkpoint], T]) -> T:
        future: Future[T] = Future()
        self._put(_Work(run, future))
        # Cancelling the awaiting task cancels `future`; the worker then skips the item.
        return await asyncio.wrap_future(future)

    def _put(self, item: _Work | GenerationJob) -> None:
        with self._lock:
            if not self.alive:
                raise EngineUnavailable("the engine is not running")
            self._queue.put(item)

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
        active: list[GenerationJob] = []
        try:
            self._loop(ckpt, active)
        finally:
            self._fail_pending(active)

    def _loop(self, ckpt: Checkpoint, active: list[GenerationJob]) -> None:
        stopping = False
        while not stopping or active:
            # Take what is queued; wait for it only when there is nothing to step.
            block = not active and not stopping
            while True:
                try:
                    item = self._queue.get(block=block)
                except queue.Empty:
                    break
                block = False
                if item is None:
                    stopping = True  # the queued work before the sentinel still runs
                elif isinstance(item, _Work):
                    self._run_work(ckpt, item)
                elif self._started(ckpt, item):
                    active.append(item)
            # One byte of every active generation.
            active[:] = [job for job in active if not self._advanced(job)]
            self._stats.active = len(active)

    def _run_work(self, ckpt: Checkpoint, work: _Work) -> None:
        if not work.future.set_running_or_notify_cancel():
            return
        try:
            result = work.run(ckpt)
        except Exception as e:
            work.future.set_exception(e)
        else:
            work.future.set_result(result)

    def _started(self, ckpt: Checkpoint, job: GenerationJob) -> bool:
        """Prefill `job`; True if it has tokens to generate."""
        if job.cancelled:
            self._stats.cancelled += 1
            return False
        try:
            return not job.start(ckpt, self._stats)
        except Exception as e:
            job.fail(e)
            return False

    def _advanced(self, job: GenerationJob) -> bool:
        """One step of `job`; True when it is done (finished, cancelled or failed)."""
        if job.cancelled:
            self._stats.cancelled += 1
            return True
        try:
            return job.advance(self._stats)
        except Exception as e:
            job.fail(e)
            return True

    def _fail_pending(self, active: list[GenerationJob]) -> None:
        """On the way out (a stop, or a crash of the loop): nothing may wait on a future or a stream forever."""
        with self._lock:
            self._running = False
        for job in active:
            job.fail(EngineUnavailable("the engine stopped"))
        self._stats.active = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.fail(EngineUnavailable("the engine stopped"))
