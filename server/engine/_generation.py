"""Generation work: the events a generation sends, the stream a caller reads them from, and the job the
worker thread advances one token at a time.

The job lives on the worker thread; every event crosses to the caller's event loop with
`loop.call_soon_threadsafe` into an `asyncio.Queue`, so the loop never runs model code. The caller cancels
by setting a flag that the worker checks between tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass
from types import TracebackType

import torch

from models.base import Adapter, State
from models.checkpoint import Checkpoint
from models.sampling import FinishReason, SamplingParams, Stepper, top_logprobs
from models.scoring import BOS
from server.engine._stats import EngineStats

__all__ = ["Event", "Finished", "GenerationJob", "GenerationStream", "PromptScored", "Token", "TokenLogprob"]


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # natural log, under the raw (temperature 1, unfiltered) distribution
    top: tuple[tuple[int, float], ...]  # the k most likely bytes `(id, logprob)`, most likely first


@dataclass(frozen=True)
class PromptScored:
    """Sent first, when prompt log-probabilities were asked for: one entry per prompt byte."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Token:
    """One sampled byte of sequence `index`."""

    index: int
    token: int
    text: str  # text that became safe to send with this byte (may be empty: a partial character, a held stop)
    offset: int  # index in the sequence's generated text of the character this byte starts or continues
    logprob: TokenLogprob | None
    time: float  # time.perf_counter() when it was sampled


@dataclass(frozen=True)
class Finished:
    """Sequence `index` is complete; after its last Token."""

    index: int
    finish_reason: FinishReason
    completion_tokens: int
    first_token_seconds: float | None  # from submission to the first sampled byte
    seconds: float  # from submission to the end


@dataclass(frozen=True)
class _Failed:
    error: BaseException


Event = PromptScored | Token | Finished
_Message = Event | _Failed


class GenerationStream:
    """The events of one generation, in order, read on the event loop that submitted it.

    `async with` it: leaving the block (normally, by an exception, or by cancellation of the reading task)
    cancels whatever is not finished. Iteration ends after every sequence's `Finished`; a failure of the
    generation is raised from the iteration.
    """

    def __init__(self, n: int, submitted: float) -> None:
        self.submitted = submitted  # time.perf_counter() at submission
        self._open = n
        self._queue: asyncio.Queue[_Message] = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _deliver(self, message: _Message) -> None:  # on the event loop
        self._queue.put_nowait(message)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> Event:
        if self._open <= 0:
            raise StopAsyncIteration
        message = await self._queue.get()
        if isinstance(message, _Failed):
            self._open = 0
            raise message.error
        if isinstance(message, Finished):
            self._open -= 1
        return message

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.cancel()


class GenerationJob:
    """`n` sequences from one prompt, advanced by the worker thread: `start` prefills the prompt once (the
    sequences fork its state), then each `sample` samples one byte of every unfinished sequence, which the
    engine then feeds to the model together with every other job's.

    `params` None: no generation, only the prompt (its log-probabilities, if asked for). With `session_id`,
    the engine starts it from that session's state and adapter; with `adapt`, it then has the session
    observe the prompt and sequence 0's bytes (`generated`).
    """

    def __init__(self, stream: GenerationStream, loop: asyncio.AbstractEventLoop, prompt: bytes,
                 params: SamplingParams | None, n: int, logprobs: int | None, prompt_logprobs: bool, *,
                 session_id: str | None = None, owner: str | None = None, adapt: bool = False) -> None:
        self._stream = stream
        self._loop = loop
        self.prompt = prompt
        self.session_id = session_id
        self.owner = owner
        self.adapt = adapt
        self.generated = bytearray()  # with `adapt`: sequence 0's sampled bytes
        self.failed = False
        self._params = params
        self._n = n
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._steppers: dict[int, Stepper] = {}
        self._first_token: dict[int, float] = {}

    @property
    def cancelled(self) -> bool:
        return self._stream.cancelled

    def _send(self, message: _Message) -> None:
        try:
            self._loop.call_soon_threadsafe(self._stream._deliver, message)
        except RuntimeError:  # the loop is closed: nobody will read this stream
            self._stream.cancel()

    def fail(self, error: BaseException) -> None:
        self.failed = True
        self._send(_Failed(error))

    def start(self, ckpt: Checkpoint, stats: EngineStats, *, state: State | None = None, last_byte: int = BOS,
              adapter: Adapter | None = None) -> bool:
        """Prefill, continuing from `state` (whose next input is `last_byte`) with `adapter`, or from the
        initial state after the BOS byte; returns True when there is nothing left to do."""
        if self._params is None and not self._prompt_logprobs:
            self._finish_all_unstarted()
            return True
        first = Stepper(ckpt.model, self._params or SamplingParams(), state=state, last_byte=last_byte,
                        adapter=adapter)
        k = self._logprobs or 0
        scored = first.prefill(self.prompt, logprobs=k if self._prompt_logprobs else None)
        stats.prompt_tokens += len(self.prompt)
        if scored is not None:
            self._send(PromptScored(tuple(TokenLogprob(lp, tuple(top))
                                          for lp, top in zip(scored.logprobs, scored.top, strict=True))))
        if self._params is None:
            self._finish_all_unstarted()
            return True
        params = self._params
        for i in range(self._n):
            # Sequence i draws from seed + i: the choices differ, and choice 0 is what n=1 gives.
            seeded = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            self._steppers[i] = first if i == 0 else first.fork(seeded)
        return False

    def _finish_all_unstarted(self) -> None:
        seconds = time.perf_counter() - self._stream.submitted
        for i in range(self._n):
            self._send(Finished(i, "length", 0, None, seconds))

    @property
    def finished(self) -> bool:
        """Every sequence is finished (after `start`)."""
        return not self._steppers

    def sample(self, stats: EngineStats) -> list[tuple[Stepper, int]]:
        """Sample one byte of every unfinished sequence (no model call) and send its events; -> the sequences
        that go on, with their byte, for the engine to feed (`Stepper.feed_many`, all jobs in one forward)."""
        feeds = []
        for i, stepper in list(self._steppers.items()):
            step = stepper.sample()
            now = time.perf_counter()
            self._first_token.setdefault(i, now)
            stats.generated_tokens += 1
            if i == 0 and self.adapt:
                self.generated.append(step.token)
            logprob = None
            if self._logprobs is not None:
                target = torch.tensor([step.token], device=step.logits.device)  # (1,)
                scored = top_logprobs(step.logits.unsqueeze(0), target, self._logprobs)
                logprob = TokenLogprob(scored.logprobs[0], tuple(scored.top[0]))
            self._send(Token(i, step.token, step.text, step.offset, logprob, now))
            if stepper.finish_reason is not None:
                del self._steppers[i]
                submitted = self._stream.submitted
                self._send(Finished(i, stepper.finish_reason, stepper.tokens, self._first_token[i] - submitted,
                                    now - submitted))
            else:
                feeds.append((stepper, step.token))
        return feeds
