"""Generation work: the events a generation sends, the stream a caller reads them from, the job the worker
thread advances one token at a time, and the executor that advances all jobs together.

The job lives on the worker thread; every event crosses to the caller's event loop with
`loop.call_soon_threadsafe` into an `asyncio.Queue`, so the loop never runs model code. The prompt is read a chunk
at a time, one worker round after another (`GenerationExecutor._prefill`), so that other work runs meanwhile. The
caller cancels by setting the job's cancel flag (leaving the stream's `async with`), which the worker checks between
two chunks of the prompt and between two tokens; it stops the job alike once its request has spent its engine-time
budget (`_work.Budget`: the stream then fails with EngineBudgetExceeded).

With `adapt`, the session is claimed while the job runs, and when it ends the session observes the prompt and
the text sent for sequence 0 (thesis sec. 4.3: exactly what the client received, so not a stop string nor what its
tokens add past it), before any later work of the session; where another server changed the
session in between (its write refused, SessionConflict), it observes them again on top of that change; refused
`FOLLOW_TRIES` times, that adaptation is dropped, logged and counted (`EngineStats.generation_adaptations_dropped`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from models.base import Adapter, LanguageModel, State
from models.checkpoint import Checkpoint
from models.sampling import FinishReason, SamplingParams, Stepper, TopLogprobs, top_logprobs
from models.tokenizer import ByteTokenizer, Tokenizer
from server.engine._errors import EngineBudgetExceeded, SessionConflict, SessionNotFound
from server.engine._scheduler import Scheduler
from server.engine._session_service import SessionService
from server.engine._stats import EngineStats
from server.engine._text import Text
from server.engine._work import Budget, Work, charge, stop_if_asked

__all__ = ["Event", "Finished", "GenerationExecutor", "GenerationJob", "GenerationStream", "PromptScored", "Token",
           "TokenLogprob"]

log = logging.getLogger(__name__)

FOLLOW_TRIES = 3  # observes of a generation with `adapt` whose write another server's change refused, at most
# Tokens of a prompt read in one model call (`Stepper.prefill`'s default, so that a prompt reads the same as in
# `models.sampling.generate`): a worker round reads about one such chunk of the prompts waiting, so a long prompt
# holds other work back, and notices that its caller went away, within one chunk's time.
PREFILL_CHUNK = 1024


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # natural log, under the raw (temperature 1, unfiltered) distribution
    top: tuple[tuple[int, float], ...]  # the k most likely tokens `(id, logprob)`, most likely first


@dataclass(frozen=True)
class PromptScored:
    """Sent first, when prompt log-probabilities were asked for: one entry per prompt token (`tokens`, the model's
    ids: bytes, or a word model's words)."""

    logprobs: tuple[TokenLogprob, ...]
    tokens: tuple[int, ...] = ()
    prefix: bytes = b""  # a word session's pending text, scored before the prompt: the first tokens may be its own


@dataclass(frozen=True)
class Token:
    """One sampled token of sequence `index` (a byte, or a word model's word)."""

    index: int
    token: int
    text: str  # text that became safe to send with this token (may be empty: a partial character, a held stop)
    offset: int  # index in the sequence's generated text of the character this token starts or continues
    logprob: TokenLogprob | None
    time: float  # time.perf_counter() when it was sampled
    # the prompt's held-back text still to generate when it was sampled (`Stepper.prefill`: token healing): the
    # token, and each of its alternatives, adds its own text past it (the start of the token's text is the prompt's)
    held: bytes = b""


@dataclass(frozen=True)
class Finished:
    """Sequence `index` is complete; after its last Token."""

    index: int
    finish_reason: FinishReason
    completion_tokens: int
    first_token_seconds: float | None  # from submission to the first sampled token
    seconds: float  # from submission to the end
    prompt_tokens: int = 0  # the prompt's tokens (the model's: bytes, or words)


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

    def __init__(self, n: int, submitted: float, cancelled: threading.Event) -> None:
        self.submitted = submitted  # time.perf_counter() at submission
        self._open = n
        self._queue: asyncio.Queue[_Message] = asyncio.Queue()
        self._cancelled = cancelled  # its job's

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


class GenerationJob(Work):
    """`n` sequences from one prompt, advanced by the worker thread: `start` sets up the prompt's reading, each
    `prefill` reads a chunk of it (the sequences then fork its state), then each `sample` samples one token of every
    unfinished sequence, which the executor then feeds to the model together with every other job's. Its caller
    reads `stream`; its future is resolved when it ends.

    `params` None: no generation, only the prompt (its log-probabilities, if asked for). With `session_id`,
    it starts from that session's state and adapter; with `adapt`, it then has the session observe the prompt
    and the text sent for sequence 0 (`generated`: without a stop string, as the answer).
    """

    kind = "generate"

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt: bytes, params: SamplingParams | None, n: int,
                 logprobs: int | None, prompt_logprobs: bool, *, session_id: str | None = None,
                 owner: str | None = None, adapt: bool = False, budget: Budget | None = None) -> None:
        super().__init__(session_id=session_id, owner=owner, budget=budget)
        self.stream = GenerationStream(n, time.perf_counter(), self._cancelled)
        self._loop = loop
        self.prompt = prompt
        self.adapt = adapt
        self.generated = bytearray()  # with `adapt`: the UTF-8 bytes of the text sent for sequence 0
        self.tokenizer: Tokenizer = ByteTokenizer()  # what a token is: the executor gives it the checkpoint's
        self.prompt_tokens = 0  # once started
        self.failed = False
        self._params = params
        self._n = n
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._steppers: dict[int, Stepper] = {}
        self._first_token: dict[int, float] = {}
        # while the prompt is read: its chunks (`Stepper.prefill_chunks`), the sequence that reads it, what of it is
        # left to read (tokens: what a chunk costs the step, `GenerationExecutor._prefill`), the text read before it
        self._prefill: Generator[None, None, TopLogprobs | None] | None = None
        self._first: Stepper | None = None
        self.prefill_left = 0
        self._prefix = b""
        self._ids = torch.zeros(0, dtype=torch.long)

    def _send(self, message: _Message) -> None:
        try:
            self._loop.call_soon_threadsafe(self.stream._deliver, message)
        except RuntimeError:  # the loop is closed: nobody will read this stream
            self.stream.cancel()

    def fail(self, error: BaseException) -> None:
        self.failed = True
        self._send(_Failed(error))
        super().fail(error)

    def start(self, model: LanguageModel, *, state: State | None = None, last_token: int | None = None,
              adapter: Adapter | None = None, prefix: bytes = b"") -> bool:
        """Set up the prompt's reading (`prefill`), continuing from `state` (whose next input is `last_token`) with
        `adapter`, or from the initial state after the tokenizer's BOS token; returns True when there is nothing to
        do. `prefix` (a word session's pending text) is read before the prompt: its tokens are in the prompt
        log-probs, not in the prompt's token count. No model call here."""
        self._ids = ids = self.tokenizer.encode_tensor(self.prompt)  # (T,) on the CPU: only counted and listed
        self.prompt_tokens = int(ids.numel())
        if self._params is None and not self._prompt_logprobs:
            self._finish_all_unstarted()
            return True
        self._first = Stepper(model, self._params or SamplingParams(), state=state, last_token=last_token,
                              adapter=adapter, tokenizer=self.tokenizer)
        self._prefix = prefix
        k = self._logprobs or 0
        self._prefill = self._first.prefill_chunks(prefix + self.prompt, logprobs=k if self._prompt_logprobs else None,
                                                   chunk=PREFILL_CHUNK)
        # the token before the prompt, then the prompt's (a word model's held-back end is read apart: approximate)
        self.prefill_left = 1 + (len(self.tokenizer.encode(prefix)) if prefix else 0) + self.prompt_tokens
        return False

    @property
    def prefilling(self) -> bool:
        """Started, and its prompt not yet all read."""
        return self._prefill is not None

    def prefill(self, stats: EngineStats) -> bool:
        """Read the next chunk of the prompt; -> True once it is all read (then the sequences are set up and the
        prompt's log-probs sent; with nothing to generate, the job is finished)."""
        assert self._prefill is not None and self._first is not None
        try:
            next(self._prefill)
        except StopIteration as end:
            scored: TopLogprobs | None = end.value
        else:
            self.prefill_left = max(0, self.prefill_left - PREFILL_CHUNK)
            return False
        self._prefill, first, self._first = None, self._first, None
        self.prefill_left = 0
        stats.prompt_tokens += self.prompt_tokens
        prefix = self._prefix
        if scored is not None:
            self._send(PromptScored(tuple(TokenLogprob(lp, tuple(top))
                                          for lp, top in zip(scored.logprobs, scored.top, strict=True)),
                                    tuple(self.tokenizer.encode(prefix + self.prompt) if prefix
                                          else self._ids.tolist()),
                                    prefix))
        if self._params is None:
            self._finish_all_unstarted()
            return True
        params = self._params
        for i in range(self._n):
            # Sequence i draws from seed + i: the choices differ, and choice 0 is what n=1 gives.
            seeded = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            self._steppers[i] = first if i == 0 else first.fork(seeded)
        return True

    def _finish_all_unstarted(self) -> None:
        seconds = time.perf_counter() - self.stream.submitted
        for i in range(self._n):
            self._send(Finished(i, "length", 0, None, seconds, self.prompt_tokens))

    @property
    def finished(self) -> bool:
        """Every sequence is finished (after `start` and the prompt's reading)."""
        return not self._steppers and self._prefill is None

    def draw(self) -> list[tuple[int, Stepper, tuple[torch.Tensor, torch.Tensor]]]:
        """Draw one token of every unfinished sequence, on the device (`Stepper.draw`): -> (sequence, its stepper,
        what it drew), for `sample` once the tokens of all jobs are read back together."""
        return [(i, stepper, stepper.draw()) for i, stepper in list(self._steppers.items())]

    def sample(self, stats: EngineStats, drawn: list[tuple[int, Stepper, tuple[torch.Tensor, torch.Tensor]]],
               tokens: list[int]) -> list[tuple[Stepper, int]]:
        """Take the tokens `draw` drew (`tokens`, read back) and send their events; no model call. -> the sequences
        that go on, with their token, for the engine to feed (`Stepper.feed_many`, all jobs in one forward)."""
        feeds = []
        for (i, stepper, one), token in zip(drawn, tokens, strict=True):
            step = stepper.take(token, one)
            now = time.perf_counter()
            self._first_token.setdefault(i, now)
            stats.generated_tokens += 1
            if i == 0 and self.adapt:
                # the text the client receives, not the sampled bytes: a stop string's tokens (and what they add
                # past it) are left out as the answer leaves them out; past the prompt's held-back text, which the
                # prompt has; invalid UTF-8 as the U+FFFD sent
                self.generated += step.text.encode("utf-8")
            logprob = None
            if self._logprobs is not None:
                target = torch.tensor([step.token]).to(step.logits.device, non_blocking=True)  # (1,)
                scored = top_logprobs(step.logits.unsqueeze(0), target, self._logprobs)
                logprob = TokenLogprob(scored.logprobs[0], tuple(scored.top[0]))
            self._send(Token(i, step.token, step.text, step.offset, logprob, now, step.held))
            if stepper.finish_reason is not None:
                del self._steppers[i]
                submitted = self.stream.submitted
                self._send(Finished(i, stepper.finish_reason, stepper.tokens, self._first_token[i] - submitted,
                                    now - submitted, self.prompt_tokens))
            else:
                feeds.append((stepper, step.token))
        return feeds


class GenerationExecutor:
    """The running generations: each step reads the next chunks of the prompts being read (`_prefill`), then samples
    one token of every sequence and feeds them all to the model in one batched forward."""

    rows = 0

    def __init__(self, ckpt: Checkpoint, sessions: SessionService, scheduler: Scheduler, stats: EngineStats) -> None:
        self._ckpt, self._sessions, self._scheduler, self._stats = ckpt, sessions, scheduler, stats
        self._reading: list[GenerationJob] = []  # their prompts being read, in turn
        self._jobs: list[GenerationJob] = []  # generating

    @property
    def busy(self) -> bool:
        return bool(self._jobs or self._reading)

    def start(self, job: GenerationJob) -> None:
        """Read its session and set up its prompt's reading (done by the steps); a job with nothing to do ends here."""
        try:
            start: dict[str, Any] = {}
            job.tokenizer = self._ckpt.tokenizer
            if job.session_id is not None:
                session = self._sessions.get(job.session_id, job.owner)
                # a word session's pending text (its last word, perhaps unfinished) comes before the prompt
                start = {"state": self._sessions.view_state(session), "last_token": session.last_token,
                         "adapter": self._sessions.model.adapter(session), "prefix": session.pending}
            # the network mixed with the sessions' memories (models/memory.py); every generation runs the one model,
            # so that all of them step in one batch
            done = job.start(self._sessions.session_model(), **start)
        except Exception as e:
            job.fail(e)
            return
        if done:
            self.finish(job)
            return
        if job.adapt:
            self._scheduler.claim(job.session_id)  # nothing else may change the session until it has adapted
        self._reading.append(job)
        self._stats.active = len(self._jobs) + len(self._reading)

    def step(self) -> None:
        """The next chunks of the prompts being read (`_prefill`); then one token of every running generation,
        sampled per sequence, fed to the model in one batched forward. A job whose caller went away, or whose request
        has spent its engine time, stops here (between two chunks of its prompt, or two tokens)."""
        self._prefill()
        running: list[GenerationJob] = []
        feeds: list[tuple[GenerationJob, Stepper, int]] = []
        began = time.perf_counter()
        drawn = []
        for job in self._jobs:
            if stop_if_asked(job, self._stats):
                self.finish(job)
                continue
            try:
                drawn.append((job, job.draw()))
            except Exception as e:
                job.fail(e)
                self.finish(job)
        # every sequence's token read back from the device at once: the decode step's one wait for it (the tokens
        # must reach the host, to be decoded and streamed)
        tokens: list[int] = torch.stack([d[0] for _, mine in drawn for _, _, d in mine]).tolist() \
            if any(mine for _, mine in drawn) else []
        at = 0
        for job, mine in drawn:
            own, at = tokens[at : at + len(mine)], at + len(mine)
            try:
                feeds += [(job, stepper, token) for stepper, token in job.sample(self._stats, mine, own)]
            except Exception as e:
                job.fail(e)
                self.finish(job)
                continue
            if job.finished:
                self.finish(job)
            else:
                running.append(job)
        if feeds:
            try:
                Stepper.feed_many([stepper for _, stepper, _ in feeds], [token for _, _, token in feeds])
            except Exception as e:
                failed = {id(job): job for job, _, _ in feeds}
                for job in failed.values():
                    job.fail(e)
                    self.finish(job)
                running = [job for job in running if id(job) not in failed]
            rows = len(feeds)
            self._stats.decode_rows[rows] = self._stats.decode_rows.get(rows, 0) + 1
            charge([(job, 1) for job, _, _ in feeds], time.perf_counter() - began)  # a row per sequence
        self._jobs = running
        self._stats.active = len(running) + len(self._reading)

    def _prefill(self) -> None:
        """Read the prompts that fit in one chunk (PREFILL_CHUNK tokens; all of them, as they would start together)
        and one chunk of the first longer prompt in line, which then goes to the back: a long prompt takes a chunk
        a round, so that other work runs between two of its chunks, and long prompts take turns."""
        long_read = False
        skipped: list[GenerationJob] = []  # no turn in this round: first in the next
        turned: list[GenerationJob] = []
        for job in self._reading:
            short = job.prefill_left <= PREFILL_CHUNK
            if not short and long_read:
                skipped.append(job)
                continue
            if stop_if_asked(job, self._stats):
                self.finish(job)
                continue
            long_read = long_read or not short
            began = time.perf_counter()
            try:
                read = job.prefill(self._stats)
            except Exception as e:
                job.fail(e)
                self.finish(job)
                continue
            finally:
                charge([(job, 1)], time.perf_counter() - began)
            if not read:
                turned.append(job)
            elif job.finished:  # only the prompt was asked for
                self.finish(job)
            else:
                self._jobs.append(job)
        self._reading = skipped + turned

    def finish(self, job: GenerationJob) -> None:
        """The job has finished or failed (its caller may already have left: that is no cancellation). With
        `adapt`, the session observes the prompt and what was generated, before its next work."""
        if not job.future.done():
            job.future.set_result(None)
        if not job.adapt:
            return
        self._scheduler.release(job.session_id)
        data = job.prompt + bytes(job.generated)
        if job.failed or not data:
            return
        self._observe_generated(job, data, FOLLOW_TRIES)

    def _observe_generated(self, job: GenerationJob, data: bytes, tries: int) -> None:
        """(Worker.) The session observes `data` first in line; where another server changed the session between
        the observe's read and its write (SessionConflict: nothing was applied), it observes again on top of that
        change, `tries` times in all. The generation's answer has gone: nobody would send it again."""
        # within the request's budget: its adaptation is part of what it takes (dropped, with a warning, past it)
        follow = Text(data, "observe", session_id=job.session_id, owner=job.owner, counted=False, budget=job.budget)

        def done(future: Future[Any]) -> None:  # (worker: the observe's result is set there)
            error = future.exception()
            if isinstance(error, SessionConflict) and tries > 1:
                self._observe_generated(job, data, tries - 1)
                return
            if isinstance(error, SessionConflict):
                self._stats.generation_adaptations_dropped += 1
            _log_failure(error)

        follow.future.add_done_callback(done)
        self._scheduler.follow(follow)

    def fail(self, error: BaseException) -> None:
        for job in [*self._reading, *self._jobs]:
            job.fail(error)
        self._reading, self._jobs = [], []
        self._stats.active = 0


def _log_failure(error: BaseException | None) -> None:
    if isinstance(error, SessionConflict):
        log.warning("adapting a session on its generation was not applied: other requests (on other servers) "
                    "changed the session meanwhile, %d times", FOLLOW_TRIES)
    elif isinstance(error, EngineBudgetExceeded):
        log.warning("adapting a session on its generation was not applied: the request had spent its engine time "
                    "(max_request_engine_s)")
    elif error is not None and not isinstance(error, SessionNotFound):
        log.error("adapting a session on its generation failed", exc_info=error)
