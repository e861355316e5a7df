"""The engine: owns the model on one worker thread and runs every piece of model work there.

Callers on the event loop submit work and await a future (scores, session operations) or read a stream of
events (generation); the loop itself never runs model code. This module is the facade: the public async API
and the lifecycle. The parts:

- `_loading.py`: the checkpoint, `ModelInfo`, `SessionLimits` (dyneval.json);
- `_session_service.py`: session settings (defaults and checks), fresh sessions, create/reset/import/export,
  the update rules;
- `_scheduler.py`: the queue, admission (`max_queue`, 429), per-session ordering, row packing, the rounds;
- `_work.py`: the work item and the executor interface; the executors of text work (`_text.py`), keyboard
  suggestions (`_suggest.py`) and generations (`_generation.py`); session operations (`_work.Call`).

A session's state is read from the store when its work starts and written back when it ends; sessions with
work in flight are pinned (never evicted). A session is named by its id and its owner: work that takes its turn
is submitted with the id it is stored under (`SessionService.resolve`: an alias, where another key's session holds
the id, `_idspace.py`), and what is answered carries the id the caller sent. A cancelled caller's work is dropped
before it starts, or between two segments (a session is then left as it was). `stop` finishes all queued and
running work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from models.precision import PRECISIONS, inference_precision
from models.sampling import SamplingParams
from models.step_graphs import GRAPH_MODES, install_step_runner
from models.suggest import Suggestions
from models.tokenizer import byte_level, word_level
from server.engine._errors import EngineUnavailable, ObserveApplied, SessionNotFound
from server.engine._generation import GenerationExecutor, GenerationJob, GenerationStream
from server.engine._idspace import is_alias, public_id
from server.engine._loading import ModelInfo, SessionLimits, load_model
from server.engine._memory_store import MemorySessionStore
from server.engine._scheduler import Scheduler
from server.engine._session import IDEMPOTENCY_KEY_PATTERN, Session, SessionConfig, SettingsView, new_session_id
from server.engine._session_service import SessionService
from server.engine._slots import SessionSlots, SlotStats, session_slots
from server.engine._stats import EngineStats
from server.engine._store import SessionStore
from server.engine._suggest import SEARCH_ON_DEVICE, Suggest, SuggestExecutor
from server.engine._text import Text, TextExecutor, TextScore
from server.engine._work import Budget, Call, CallExecutor, Work

__all__ = ["Engine", "EngineConfig", "ModelInfo", "SessionLimits", "TextScore", "new_session_id"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64  # rows per batched model call (a session observe takes two: adapted and static)
    max_wait_ms: float = 2.0  # coming from idle, how long to wait for more work to fill a batch
    max_queue: int = 256  # work items waiting to start; more are refused with EngineOverloaded
    retry_after_s: int = 1  # what EngineOverloaded tells the caller
    session_ttl_s: float = 3600.0  # default time to live of a session after its last use
    max_session_ttl_s: float = 7 * 86400.0  # the longest a session may ask for (an imported one is cut to it)
    max_sessions: int = 10_000  # the in-process store's limits (when the engine builds the store)
    session_memory_bytes: int = 1 << 30
    suggest_budget_ms: float = 0.0  # a suggestion's word search stops this long after submission (0: never)
    # the engine time (its share of the model calls) one request's text work and generations may take (`Budget`;
    # 0: no limit)
    max_request_engine_s: float = 0.0
    # the model work's precision (models/precision.py): "float32", "bfloat16" (bf16 recurrent matmuls) or "auto"
    precision: str = "float32"
    device: str = "cpu"  # where the model runs (models/device.py): auto, cpu, cuda or cuda:N
    # the mLSTM's inference step in bucketed static shapes (models/step_graphs.py): auto (CUDA graphs on a CUDA
    # device, the model's own path on a CPU), on (also on a CPU, eagerly) or off
    cuda_graphs: str = "auto"
    # observed sessions' tensors kept on the device between requests (server/engine/_slots.py): how many sessions
    # (0: off; None: SLOTS_CUDA on a CUDA device, SLOTS_CPU on a CPU)
    session_slots: int | None = None
    suggest_on_device: str = "auto"  # the word searches on the model's device (server/engine/_suggest.py)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.max_wait_ms < 0 or self.session_ttl_s <= 0 \
                or self.suggest_budget_ms < 0 or not self.max_request_engine_s >= 0:
            raise ValueError("max_batch and max_queue must be >= 1, max_wait_ms >= 0, session_ttl_s > 0, "
                             "suggest_budget_ms >= 0, max_request_engine_s >= 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.session_slots is not None and self.session_slots < 0:
            raise ValueError("session_slots must be >= 0")
        if self.suggest_on_device not in SEARCH_ON_DEVICE:
            raise ValueError(f"suggest_on_device must be one of {', '.join(SEARCH_ON_DEVICE)}")
        if self.cuda_graphs not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, not {self.cuda_graphs!r}")


class Engine:
    """Loads a checkpoint and runs all model work on its own thread, batching work across requests and
    sessions."""

    def __init__(self, checkpoint: str | Path, *, thread_name: str = "adaptlm-engine",
                 config: EngineConfig | None = None, store: SessionStore | None = None) -> None:
        self._path = Path(checkpoint)
        self._thread_name = thread_name
        self.config = c = config or EngineConfig()
        self.store = store or MemorySessionStore(max_sessions=c.max_sessions, max_bytes=c.session_memory_bytes)
        self.sessions = SessionService(self.store, ttl_s=c.session_ttl_s, max_ttl_s=c.max_session_ttl_s,
                                       retry_after_s=c.retry_after_s)
        self._stats = EngineStats()
        self._scheduler = Scheduler(self.store, self._stats, max_batch=c.max_batch, max_wait_ms=c.max_wait_ms,
                                    max_queue=c.max_queue, retry_after_s=c.retry_after_s)
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None
        self._slots: SessionSlots | None = None  # (the worker's, made at load)

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
        if self._info.sessions is None:
            log.warning("sessions are unavailable: %s", self._info.sessions_unavailable)

    def stop(self, timeout: float | None = None) -> None:
        """Finish the work already queued or running, then end the worker thread. Idempotent."""
        self._scheduler.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The model is loaded and the worker thread is taking work."""
        return self._scheduler.alive

    @property
    def crashed(self) -> bool:
        """The worker thread died (an error escaped it) after the model was loaded: the process cannot serve
        again and should be restarted (`/healthz` fails)."""
        return self._scheduler.crashed

    @property
    def stats(self) -> EngineStats:
        """A copy of the work counters, with the session store's."""
        store = self.store.stats()
        return dataclasses.replace(self._stats, batch_rows=dict(self._stats.batch_rows),
                                   decode_rows=dict(self._stats.decode_rows),
                                   suggest_rows=dict(self._stats.suggest_rows), queued=self._scheduler.waiting,
                                   sessions=store.sessions, session_bytes=store.bytes,
                                   evictions=dict(store.evictions),
                                   slots=dataclasses.asdict(self._slots.stats()) if self._slots is not None else {})

    def slot_stats(self) -> SlotStats | None:
        """The session slots' counters (server/engine/_slots.py); None when the engine keeps none."""
        return self._slots.stats() if self._slots is not None else None

    def stalled_s(self) -> float:
        """Seconds the worker thread has made no progress while work waits or runs (0: progressing, or idle)."""
        return self._scheduler.stalled_s()

    def budget(self) -> Budget:
        """A new request's engine-time budget (`max_request_engine_s`): pass one to all the work of a request."""
        return Budget.of_setting(self.config.max_request_engine_s)

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._info

    def session_limits(self) -> SessionLimits:
        """The checkpoint's session settings; raises SessionsUnavailable if it cannot adapt sessions."""
        return self.sessions.limits()

    @property
    def memory_names(self) -> frozenset[str]:
        """The memories this checkpoint's sessions can have (`SessionModel.memories`)."""
        return frozenset(self.sessions.model.memories)

    async def session_settings(self, memories: Mapping[str, Mapping[str, Any] | None] | None,
                               ttl_s: float | None) -> tuple[SessionConfig, float]:
        """A new session's settings: the checkpoint's defaults with `memories` applied (name -> settings, None:
        off), and its TTL (the server's default for None); raises InvalidSessionSettings (its `param` the setting's
        path under `memories`, or `ttl_s`)."""
        return self.sessions.config(memories), self.sessions.ttl(ttl_s)

    # -- work --------------------------------------------------------------------------------------

    async def score(self, data: bytes, logprobs: bool = False, *, session_id: str | None = None,
                    owner: str | None = None, adapt: bool = False) -> TextScore:
        """Bits of `data`: from the initial state (no session), or continuing `session_id`'s stream with its
        adapter; `adapt` (a session's observe) scores each segment before adapting on it, keeps the adaptation
        and also returns the static bits."""
        if not data:
            raise ValueError("empty text: nothing to score")
        if adapt and session_id is None:
            raise ValueError("adapting needs a session")
        if session_id is not None:
            session_id = await self._stored(session_id, owner)
        mode: Literal["static", "peek", "observe"] = "static" if session_id is None else (
            "observe" if adapt else "peek")
        result: TextScore = await self._submit(Text(data, mode, session_id=session_id, owner=owner,
                                                    logprobs=logprobs, budget=self.budget()))
        return result

    async def observe(self, data: bytes, *, session_id: str, owner: str | None,
                      idempotency_key: str | None = None) -> tuple[TextScore, bool]:
        """`score(data, session_id=..., adapt=True)`: the session observes `data`. With an `idempotency_key`, the
        observe is applied once whatever the retries: the key is stored with the session's new state, in the same
        write, and a later observe with that key applies nothing and answers as the first did. -> (the score,
        whether it is that earlier answer). Raises IdempotencyKeyReused for a key applied with another text."""
        if idempotency_key is None:
            return await self.score(data, session_id=session_id, owner=owner, adapt=True), False
        if not IDEMPOTENCY_KEY_PATTERN.fullmatch(idempotency_key):  # the stores' records separate keys by spaces
            raise ValueError(f"an idempotency key is {IDEMPOTENCY_KEY_PATTERN.pattern}")
        if not data:
            raise ValueError("empty text: nothing to score")
        session_id = await self._stored(session_id, owner)
        # the record it starts from is read in the session's turn on the worker, where the key is checked
        start = functools.partial(self.sessions.observing, session_id, owner, idempotency_key, data)
        try:
            result: TextScore = await self._submit(Text(data, "observe", session_id=session_id, owner=owner,
                                                        create=start))
        except ObserveApplied as e:
            assert e.entry.answer is not None  # a store records a key with its answer (_store.committed)
            return TextScore(**e.entry.answer), True
        return result, False

    def generate(self, prompt: bytes, params: SamplingParams | None, *, n: int = 1, logprobs: int | None = None,
                 prompt_logprobs: bool = False, session_id: str | None = None, owner: str | None = None,
                 adapt: bool = False, budget: Budget | None = None) -> GenerationStream:
        """Start `n` continuations of `prompt` (from the initial state after the BOS token, or from `session_id`'s
        state and adapter); call on the event loop, which then receives the events: `PromptScored` first if
        `prompt_logprobs`, then each sequence's `Token`s and its `Finished`. Sequence i > 0 uses seed + i.

        `params` None generates nothing (prompt log-probabilities only). `logprobs` = k adds to each sampled
        token its log-probability and the k most likely tokens (and to each prompt token, with `prompt_logprobs`).
        The session is not changed, unless `adapt`: once the generation ends, it observes the prompt and
        sequence 0's bytes (thesis sec. 4.3: generate with fixed weights, then adapt on what was generated).
        `budget`: the request's (`budget()`, shared by its generations), a new one if None; once it is spent the
        stream fails with EngineBudgetExceeded.
        """
        if n < 1:
            raise ValueError("n must be at least 1")
        if adapt and session_id is None:
            raise ValueError("adapting needs a session")
        if session_id is not None:
            self.sessions.limits()
            # on the event loop: no store read here; the callers have just looked the session up (`get_session`),
            # which found its stored id
            session_id = self.sessions.route(_named(session_id), owner)
        job = GenerationJob(asyncio.get_running_loop(), prompt, params, n, logprobs, prompt_logprobs,
                            session_id=session_id, owner=owner, adapt=adapt, budget=budget or self.budget())
        self._scheduler.put(job)
        return job.stream

    async def suggest(self, session_id: str, owner: str | None, context: str, *, k: int = 3, max_chars: int = 24,
                      n_chars: int = 5) -> Suggestions:
        """Keyboard suggestions (`models.suggest`): the k most likely completions of the word being typed at the
        end of `context` and the n_chars most likely next characters, under the session's state and adapter
        continued by `context`. The session is not changed (only touched). The model after the session and
        the context is cached (`_suggest.CursorCache`): the next keystroke feeds only the bytes it added."""
        self.sessions.limits()
        budget = self.config.suggest_budget_ms
        deadline = time.monotonic() + budget / 1000 if budget > 0 else math.inf
        # no turn to take: its read (`SessionService.get`) finds the alias, if any
        result: Suggestions = await self._submit(Suggest(_named(session_id), context, owner=owner, k=k,
                                                         max_chars=max_chars, n_chars=n_chars, deadline=deadline))
        return result

    # -- sessions ----------------------------------------------------------------------------------

    async def create_session(self, *, owner: str | None, config: SessionConfig | SettingsView | None = None,
                             ttl_s: float | None = None, initial_text: bytes | None = None
                             ) -> tuple[Session, TextScore | None]:
        """A new session (`sessions.config()`: the checkpoint's defaults, for no `config`; a worker's `SettingsView`
        is checked again as given); with `initial_text`,
        it has observed that text when this returns. Raises InvalidSessionSettings."""
        self.sessions.limits()
        # a given config is checked as a request's would be: every memory named (off where it has none)
        config = self.sessions.config(
            None if config is None else {**dict.fromkeys(self.sessions.model.memories), **config.to_dict()})
        ttl = self.sessions.ttl(ttl_s)
        session_id = new_session_id()
        create = functools.partial(self.sessions.create, session_id, owner, ttl, config)
        if initial_text:
            scored: TextScore = await self._submit(Text(initial_text, "observe", session_id=session_id, owner=owner,
                                                        create=create, budget=self.budget()))
            return await self.read_session(session_id, owner, touch=False), scored
        session: Session = await self._submit(Call(create, session_id=session_id, owner=owner))
        return session, None

    def get_session(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session:
        """The session's last committed record (work in flight is not in it yet)."""
        return _shown(self.sessions.get(_named(session_id), owner, touch=touch))

    def delete_session(self, session_id: str, owner: str | None) -> None:
        """Remove it now; work already running for it finishes but is not written back."""
        self.sessions.delete(_named(session_id), owner)

    async def read_session(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session:
        """`get_session`, off the event loop (the store may do I/O)."""
        return await asyncio.to_thread(self.get_session, session_id, owner, touch=touch)

    async def remove_session(self, session_id: str, owner: str | None) -> None:
        """`delete_session`, off the event loop."""
        await asyncio.to_thread(self.delete_session, session_id, owner)

    async def reset_session(self, session_id: str, owner: str | None) -> Session:
        """Back to the start (initial state, M = 0, no statistics), keeping its id, owner, config and TTL."""
        return await self._in_turn(self.sessions.reset, session_id, owner)

    async def export_session(self, session_id: str, owner: str | None) -> bytes:
        """The session as a blob (`_export.export_session`), tagged with these weights' hash."""
        return await asyncio.to_thread(self.sessions.export, _named(session_id), owner)

    async def import_session(self, session_id: str, owner: str | None, blob: bytes) -> Session:
        """Create or replace `session_id` from an exported blob; raises SessionImportError (`conflict` when it
        was exported from other weights). An id another owner's session holds is imported as onto a free one: to
        `owner`'s alias (`SessionService.load_export`)."""
        return await self._in_turn(self.sessions.load_export, session_id, owner, blob)

    # -- submission and the worker -----------------------------------------------------------------

    async def _stored(self, session_id: str, owner: str | None) -> str:
        """The id work that takes the session's turn is submitted with (SessionsUnavailable first, on a checkpoint
        without sessions): `SessionService.resolve`, off the event loop (the store may do I/O); nothing to read
        without an owner."""
        self.sessions.limits()
        session_id = _named(session_id)
        if owner is None:
            return session_id
        return await asyncio.to_thread(self.sessions.resolve, session_id, owner)

    async def _in_turn(self, operation: Callable[..., Session], session_id: str, owner: str | None,
                       *args: Any) -> Session:
        """`operation(stored id, owner, *args)` on the worker in the session's turn (a `SessionService` write);
        the record it returns as its owner is shown it."""
        session_id = await self._stored(session_id, owner)
        result: Session = await self._submit(Call(functools.partial(operation, session_id, owner, *args),
                                                  session_id=session_id, owner=owner))
        return _shown(result)

    async def _submit(self, work: Work) -> Any:
        self._scheduler.put(work)
        try:
            return await asyncio.wrap_future(work.future)
        except asyncio.CancelledError:
            work.cancel()  # queued: the worker skips it; running: it stops between two segments
            raise

    def _run(self, loaded: Future[ModelInfo]) -> None:
        try:
            model = load_model(self._path, self.config.precision, self.config.device)
            install_step_runner(model.ckpt.model, self.config.cuda_graphs)
            self.sessions.load(model.ckpt, model.info.sessions, model.info.sessions_unavailable, model.base)
        except BaseException as e:
            loaded.set_exception(e)
            return
        if model.info.sessions is not None:
            self._slots = session_slots(self.config.session_slots, model.device)
        self._scheduler.open()
        loaded.set_result(model.info)
        tokenizer = model.ckpt.tokenizer
        # the keyboard search reads one byte a token; a word model's suggestions are its next-word distribution
        byte_tokenizer = byte_level(tokenizer)
        try:
            with inference_precision(model.info.precision, model.device):  # thread-local: this thread's work
                self._scheduler.run({
                    "generate": GenerationExecutor(model.ckpt, self.sessions, self._scheduler, self._stats),
                    "text": TextExecutor(model.ckpt, self.sessions, self._scheduler, self._stats, self._slots),
                    "suggest": SuggestExecutor(self.sessions.session_model(), self.sessions, self._stats,
                                               tokenizer=byte_tokenizer,
                                               words=word_level(tokenizer),
                                               # a word model's vocabulary is its lexicon: its path ranks as it did
                                               lexicon=model.ckpt.lexicon if byte_tokenizer is not None else None,
                                               on_device=self.config.suggest_on_device),
                    "call": CallExecutor(),
                })
        except BaseException:  # reported here, once, in the log's format (then /healthz fails: `crashed`)
            log.critical("the engine thread died; this process serves no more model work", exc_info=True)
        finally:
            self._scheduler.fail_all(EngineUnavailable("the engine stopped"))


def _shown(session: Session) -> Session:
    """The record as its owner is shown it: with the id it sent, not its alias."""
    return dataclasses.replace(session, id=public_id(session.id)) if is_alias(session.id) else session


def _named(session_id: str) -> str:
    """A session id as a client sends it: an alias is no name of a session."""
    if is_alias(session_id):
        raise SessionNotFound(session_id)
    return session_id
