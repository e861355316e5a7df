"""The engine: owns the model on one worker thread and runs every piece of model work there.

Callers on the event loop submit work and await a future (scores, session operations) or read a stream of
events (generation); the loop itself never runs model code. Admission is bounded: at most `max_queue` items
wait to start, beyond that `EngineOverloaded` (HTTP 429).

Each round of the worker:
1. take what has arrived; coming from idle (nothing running) with text work, wait up to `max_wait_ms` for more
   to fill a batch (while work runs, newcomers join at the next segment: continuous batching);
2. start waiting items in arrival order: an item of a session waits while earlier work of the same session
   runs (work on one session is applied one at a time, in order); text work starts while its rows fit in
   `max_batch`; session operations without batched model work (create, reset, import) run at once;
   keyboard suggestions read a session's last committed record without waiting for its turn;
3. keyboard suggestions: rounds of all the word searches in progress, one batched step each, keystrokes that
   arrive meanwhile joining between rounds (`SuggestRounds`), until none is left or, while other work waits,
   for at most SUGGEST_SLICE_S;
4. one batched step of all running text work (`batch_step`: one segment of every text, one forward, and for
   adapting rows one backward and one update), then finish the texts that are done: write each session back
   to the store and resolve the futures;
5. one byte of every running generation: sampled per sequence, then all fed in one batched forward.

A session's state is read from the store when its work starts and written back when it ends; sessions with
work in flight are pinned (never evicted). A cancelled caller's work is dropped before it starts, or
between two segments (a session is then left as it was). `stop` finishes all queued and running work.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from kernels import adapter_implementation
from models.adaptation import DynEvalConfig, UpdateRule, adapter_ms_g
from models.base import Adapter, State
from models.checkpoint import Checkpoint, load_checkpoint
from models.precision import PRECISIONS, inference_precision, resolve_precision
from models.sampling import SamplingParams, Stepper
from models.scoring import BOS
from models.suggest import Suggestions
from server.engine._batch import Row, RuleCache, TextJob, batch_step, text_tensors
from server.engine._errors import (
    EngineOverloaded,
    EngineUnavailable,
    SessionImportError,
    SessionNotFound,
    SessionStoreFull,
    SessionsUnavailable,
)
from server.engine._generation import GenerationJob, GenerationStream
from server.engine._sessions import (
    AdaptationConfig,
    MemorySessionStore,
    Session,
    SessionStats,
    SessionStore,
    export_session,
    import_session,
)
from server.engine._stats import EngineStats
from server.engine._suggest import CursorCache, SuggestJob, SuggestRounds

__all__ = ["Engine", "EngineConfig", "ModelInfo", "SessionLimits", "TextScore", "new_session_id"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LN2 = math.log(2.0)
_SWEEP_S = 1.0  # how often the worker drops expired sessions
_RULE_CACHE = 256  # update rules kept, by (lr, decay, adapter size)
SUGGEST_MIN_PROB = 1e-3  # word completions: branches below this cumulative probability are dropped (§6)
SUGGEST_BATCH = 8  # branches one suggestion expands per model step (8 measured fastest: docs/benchmarks.md)
SUGGEST_MAX_EXPANSIONS = 2048  # the most branches one suggestion expands (bounds its latency)
SUGGEST_ROUND_ROWS = 128  # branches of all suggestions per batched step (each gets at least 4)
# Suggestion rounds run back to back (new keystrokes joining between rounds) for at most this long while text
# work or generations wait; then one text step and one generation step run, and the searches go on.
SUGGEST_SLICE_S = 0.025
# While someone is typing (a suggestion started in the last TYPING_S), a text step takes at most TYPING_TEXT_ROWS
# rows, the texts that waited longest first: a keystroke then waits for a shorter step (a 64-row step of the
# default model is ~150 ms in bf16, a 32-row one ~80 ms; docs/benchmarks.md).
TYPING_S = 1.0
TYPING_TEXT_ROWS = 32


def new_session_id() -> str:
    """192 random bits, URL-safe (32 characters)."""
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64  # rows per batched model call (a session observe takes two: adapted and static)
    max_wait_ms: float = 2.0  # coming from idle, how long to wait for more work to fill a batch
    max_queue: int = 256  # work items waiting to start; more are refused with EngineOverloaded
    retry_after_s: int = 1  # what EngineOverloaded tells the caller
    session_ttl_s: float = 3600.0  # default time to live of a session after its last use
    max_session_ttl_s: float = 7 * 86400.0  # the longest an imported session keeps
    max_sessions: int = 10_000  # the in-process store's limits (when the engine builds the store)
    session_memory_bytes: int = 1 << 30
    suggest_budget_ms: float = 0.0  # a suggestion's word search stops this long after submission (0: never)
    # the model work's precision (models/precision.py): "float32", "bfloat16" (bf16 recurrent matmuls) or "auto"
    precision: str = "float32"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.max_wait_ms < 0 or self.session_ttl_s <= 0 \
                or self.suggest_budget_ms < 0:
            raise ValueError("max_batch and max_queue must be >= 1, max_wait_ms >= 0, session_ttl_s > 0, "
                             "suggest_budget_ms >= 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")


@dataclass(frozen=True)
class SessionLimits:
    """The checkpoint's sparse dynamic-evaluation settings that sessions start from (dyneval.json "session",
    else "sparse")."""

    lr: float
    decay: float
    adapter_size: int  # default k
    max_adapter_size: int  # the adaptation sites' units (and the statistics' coverage)
    rule: str
    eps: float
    segment: int
    cache_weight: float = 0.0  # the word cache's weight in suggestions (dyneval.json "session" "cache_weight")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_hash: str  # sha256 of the weights
    created: int  # unix time the weights were written
    path: Path
    kernel: str = "reference"  # the adapter kernel's implementation (a metric label)
    precision: str = "float32"  # what "auto" resolved to on this device (a metric label)
    sessions: SessionLimits | None = None  # None: this checkpoint cannot adapt sessions
    sessions_unavailable: str = ""  # why not


@dataclass(frozen=True)
class TextScore:
    """A text's bits under the model (static) or under a session, each segment scored before any update."""

    bits: float
    bytes: int
    logprobs: list[float] | None = None  # natural log, per byte, if asked for
    static_bits: float | None = None  # adapting work: the same text under the unadapted model
    updates: int = 0  # adapter updates applied
    nonfinite_reset: bool = False  # the non-finite guard refused an update or reset the adapter

    @property
    def bits_per_byte(self) -> float:
        return self.bits / self.bytes if self.bytes else float("nan")


# -- work items ------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Item:
    future: Future[Any]
    session_id: str | None = None
    owner: str | None = None
    counted: bool = True  # counts against max_queue until it starts (internal follow-ups do not)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(eq=False)
class _Call(_Item):
    """A session operation without batched model work, run on the worker in the session's turn."""

    run: Callable[[Checkpoint], Any] = lambda ckpt: None


@dataclass(eq=False)
class _Text(_Item):
    """Text work: a static score, a session score ("peek": no update) or a session observe."""

    data: bytes = b""
    mode: Literal["static", "peek", "observe"] = "static"
    logprobs: bool = False
    create: Callable[[Checkpoint], Session] | None = None  # a session to create, then observe `data`
    job: TextJob | None = None
    session: Session | None = None

    @property
    def rows_needed(self) -> int:
        return 2 if self.mode == "observe" else 1


@dataclass(eq=False)
class _Suggest(_Item):
    """Keyboard suggestions. `session_id` stays None (a suggestion does not wait for its session's turn); the
    session is `target`."""

    target: str = ""
    context: str = ""
    k: int = 3
    max_chars: int = 24
    n_chars: int = 5
    deadline: float = math.inf


_Pending = _Item | GenerationJob


class Engine:
    """Loads a checkpoint and runs all model work on its own thread, batching text work across requests and
    sessions."""

    def __init__(self, checkpoint: str | Path, *, thread_name: str = "adaptlm-engine",
                 config: EngineConfig | None = None, store: SessionStore | None = None) -> None:
        self._path = Path(checkpoint)
        self._thread_name = thread_name
        self.config = config or EngineConfig()
        self.store = store or MemorySessionStore(max_sessions=self.config.max_sessions,
                                                 max_bytes=self.config.session_memory_bytes)
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        # Guards _running, _waiting and the queue, so no work is queued behind the stop sentinel.
        self._lock = threading.Lock()
        self._running = False
        self._waiting = 0  # counted items queued or pending, not yet started
        self._thread: threading.Thread | None = None
        self._info: ModelInfo | None = None
        self._stats = EngineStats()
        # worker-thread state
        self._pending: collections.deque[_Pending] = collections.deque()
        self._texts: list[_Text] = []
        self._gens: list[GenerationJob] = []
        self._busy: set[str] = set()  # sessions whose work is running
        self._base: DynEvalConfig | None = None
        self._rules: dict[tuple[float, float, int], UpdateRule] = {}
        self._stacked = RuleCache()
        self._cursors = CursorCache()
        self._suggests: list[tuple[_Suggest, SuggestJob]] = []  # started, not yet fed
        self._rounds: SuggestRounds | None = None  # the searches in progress (made when the model is loaded)
        self._searching: dict[SuggestJob, _Suggest] = {}
        self._last_keystroke = -math.inf  # time.monotonic() of the last suggestion started

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
        """A copy of the work counters, with the session store's."""
        store = self.store.stats()
        with self._lock:
            queued = self._waiting
        return dataclasses.replace(self._stats, batch_rows=dict(self._stats.batch_rows),
                                   decode_rows=dict(self._stats.decode_rows),
                                   suggest_rows=dict(self._stats.suggest_rows), queued=queued,
                                   sessions=store.sessions, session_bytes=store.bytes,
                                   evictions=dict(store.evictions))

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._info

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
        mode: Literal["static", "peek", "observe"] = "static" if session_id is None else (
            "observe" if adapt else "peek")
        if session_id is not None:
            self.session_limits()
        item = _Text(Future(), session_id, owner, data=data, mode=mode, logprobs=logprobs)
        result: TextScore = await self._submit(item)
        return result

    def generate(self, prompt: bytes, params: SamplingParams | None, *, n: int = 1, logprobs: int | None = None,
                 prompt_logprobs: bool = False, session_id: str | None = None, owner: str | None = None,
                 adapt: bool = False) -> GenerationStream:
        """Start `n` continuations of `prompt` (from the initial state after the BOS byte, or from `session_id`'s
        state and adapter); call on the event loop, which then receives the events: `PromptScored` first if
        `prompt_logprobs`, then each sequence's `Token`s and its `Finished`. Sequence i > 0 uses seed + i.

        `params` None generates nothing (prompt log-probabilities only). `logprobs` = k adds to each sampled
        byte its log-probability and the k most likely bytes (and to each prompt byte, with `prompt_logprobs`).
        The session is not changed, unless `adapt`: once the generation ends, it observes the prompt and
        sequence 0's bytes (thesis sec. 4.3: generate with fixed weights, then adapt on what was generated).
        """
        if n < 1:
            raise ValueError("n must be at least 1")
        if adapt and session_id is None:
            raise ValueError("adapting needs a session")
        if session_id is not None:
            self.session_limits()
        stream = GenerationStream(n, time.perf_counter())
        job = GenerationJob(stream, asyncio.get_running_loop(), prompt, params, n, logprobs, prompt_logprobs,
                            session_id=session_id, owner=owner, adapt=adapt)
        self._put(job)
        return stream

    # -- sessions ----------------------------------------------------------------------------------

    async def create_session(self, *, owner: str | None, config: AdaptationConfig | None = None,
                             ttl_s: float | None = None, initial_text: bytes | None = None
                             ) -> tuple[Session, TextScore | None]:
        """A new session (the checkpoint's defaults for what `config` leaves out); with `initial_text`, it has
        observed that text when this returns."""
        limits = self.session_limits()
        config = config or AdaptationConfig(lr=limits.lr, decay=limits.decay, adapter_size=limits.adapter_size,
                                            cache_weight=limits.cache_weight)
        self._check_config(config)
        session_id = new_session_id()
        ttl = ttl_s if ttl_s is not None else self.config.session_ttl_s

        def create(ckpt: Checkpoint) -> Session:
            session = self._fresh(ckpt, session_id, owner, ttl, config)
            self._insert(session)
            return session

        if initial_text:
            item = _Text(Future(), session_id, owner, data=initial_text, mode="observe", create=create)
            scored: TextScore = await self._submit(item)
            # the store may do I/O (Redis): off the event loop
            return await asyncio.to_thread(self.get_session, session_id, owner, touch=False), scored
        session: Session = await self._submit(_Call(Future(), session_id, owner, run=create))
        return session, None

    def get_session(self, session_id: str, owner: str | None, *, touch: bool = True) -> Session:
        """The session's last committed record (work in flight is not in it yet)."""
        session = self.store.get(session_id, owner, touch=touch)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    async def suggest(self, session_id: str, owner: str | None, context: str, *, k: int = 3, max_chars: int = 24,
                      n_chars: int = 5) -> Suggestions:
        """Keyboard suggestions (`models.suggest`): the k most likely completions of the word being typed at the
        end of `context` and the n_chars most likely next characters, under the session's state and adapter
        continued by `context`. The session is not changed (only touched). The model after the session and
        the context is cached (`CursorCache`): the next keystroke feeds only the bytes it added."""
        self.session_limits()
        budget = self.config.suggest_budget_ms
        deadline = time.monotonic() + budget / 1000 if budget > 0 else math.inf
        # No session id on the item: a suggestion reads the session's last committed record at once instead of
        # waiting for the session's turn behind a long observe (a keystroke cannot wait for that). It joins the
        # word searches in progress at their next round, its model steps batched with theirs (`SuggestRounds`).
        item = _Suggest(Future(), None, owner, target=session_id, context=context, k=k, max_chars=max_chars,
                        n_chars=n_chars, deadline=deadline)
        result: Suggestions = await self._submit(item)
        return result

    def delete_session(self, session_id: str, owner: str | None) -> None:
        """Remove it now; work already running for it finishes but is not written back."""
        if not self.store.delete(session_id, owner):
            raise SessionNotFound(session_id)

    async def reset_session(self, session_id: str, owner: str | None) -> Session:
        """Back to the start (initial state, M = 0, no statistics), keeping its id, owner, config and TTL."""
        self.session_limits()

        def reset(ckpt: Checkpoint) -> Session:
            old = self.get_session(session_id, owner)
            session = dataclasses.replace(self._fresh(ckpt, session_id, owner, old.ttl_s, old.config),
                                          created=old.created)
            if not self.store.update(session):
                raise SessionNotFound(session_id)
            return session

        result: Session = await self._submit(_Call(Future(), session_id, owner, run=reset))
        return result

    async def export_session(self, session_id: str, owner: str | None) -> bytes:
        """The session as a blob (`_sessions.export_session`), tagged with these weights' hash."""
        model_hash = self.info.model_hash
        return await asyncio.to_thread(lambda: export_session(self.get_session(session_id, owner), model_hash))

    async def import_session(self, session_id: str, owner: str | None, blob: bytes) -> Session:
        """Create or replace `session_id` from an exported blob; raises SessionImportError (`conflict` when it
        was exported from other weights), or SessionNotFound if the id belongs to another owner."""
        self.session_limits()

        def load(ckpt: Checkpoint) -> Session:
            if self.store.get(session_id, owner, touch=False) is None and self.store.contains(session_id):
                raise SessionNotFound(session_id)  # another owner's: not ours to replace, nor to reveal
            template = self._fresh(ckpt, session_id, owner, self.config.session_ttl_s, None)
            session, config = import_session(blob, model_hash=ckpt.model_hash, template=template)
            session = dataclasses.replace(session, ttl_s=min(session.ttl_s, self.config.max_session_ttl_s))
            try:
                self._check_config(config)
            except ValueError as e:
                raise SessionImportError(f"the export's adaptation settings are refused here: {e}") from None
            self._insert(session)
            return session

        result: Session = await self._submit(_Call(Future(), session_id, owner, run=load))
        return result

    def _insert(self, session: Session) -> None:
        try:
            self.store.insert(session)
        except SessionStoreFull as e:
            e.retry_after_s = self.config.retry_after_s
            raise

    def session_limits(self) -> SessionLimits:
        info = self.info
        if info.sessions is None:
            raise SessionsUnavailable(info.sessions_unavailable)
        return info.sessions

    def _check_config(self, config: AdaptationConfig) -> None:
        limits = self.session_limits()
        if not 1 <= config.adapter_size <= limits.max_adapter_size:
            raise ValueError(f"adapter_size must be between 1 and {limits.max_adapter_size}, "
                             f"not {config.adapter_size}")
        if not (math.isfinite(config.lr) and config.lr >= 0):
            raise ValueError(f"lr must be finite and >= 0, not {config.lr}")
        if not (math.isfinite(config.decay) and 0 <= config.decay <= 1):
            raise ValueError(f"decay must be in [0, 1], not {config.decay}")
        if not (math.isfinite(config.cache_weight) and 0 <= config.cache_weight <= 1):
            raise ValueError(f"cache_weight must be in [0, 1], not {config.cache_weight}")

    def _fresh(self, ckpt: Checkpoint, session_id: str, owner: str | None, ttl_s: float,
               config: AdaptationConfig | None) -> Session:
        """A session at the start: the initial state after the BOS byte, M = 0."""
        if config is None:
            limits = self.session_limits()
            config = AdaptationConfig(lr=limits.lr, decay=limits.decay, adapter_size=limits.adapter_size,
                                      cache_weight=limits.cache_weight)
        ref = next(ckpt.model.parameters())
        sites = {s.name: config.adapter_size for s in ckpt.model.adaptation_sites()}
        now = time.time()
        return Session(id=session_id, owner=owner, created=now, last_used=now, ttl_s=ttl_s, config=config,
                       state=ckpt.model.init_state(1), static_state=ckpt.model.init_state(1), last_byte=BOS,
                       adapter=Adapter.zeros(sites, 1, dtype=ref.dtype, device=ref.device))

    # -- submission --------------------------------------------------------------------------------

    async def _submit(self, item: _Item) -> Any:
        self._put(item)
        try:
            return await asyncio.wrap_future(item.future)
        except asyncio.CancelledError:
            item.cancelled.set()  # queued: the worker skips it; running: it stops between two segments
            raise

    def _put(self, item: _Pending) -> None:
        with self._lock:
            if not self.alive:
                raise EngineUnavailable("the engine is not running")
            if self._waiting >= self.config.max_queue:
                raise EngineOverloaded(f"the server is busy ({self._waiting} requests waiting); retry shortly",
                                       self.config.retry_after_s)
            self._waiting += 1
            self._queue.put(item)

    def _started(self, item: _Pending) -> None:
        """`item` left the waiting line (started, failed or dropped)."""
        if not isinstance(item, _Item) or item.counted:
            with self._lock:
                self._waiting -= 1

    # -- the worker ----------------------------------------------------------------------------------

    def _run(self, loaded: Future[ModelInfo]) -> None:
        try:
            ckpt = load_checkpoint(self._path)
            weights = self._path / "model.safetensors"
            limits, why = self._session_settings(ckpt)
            device = next(ckpt.model.parameters()).device
            precision = resolve_precision(self.config.precision, device)
            info = ModelInfo(name=ckpt.name, model_hash=ckpt.model_hash, created=int(weights.stat().st_mtime),
                             path=self._path, kernel=adapter_implementation(), precision=precision, sessions=limits,
                             sessions_unavailable=why)
            self.store.bind(ckpt.model_hash, self._template(ckpt))
        except BaseException as e:
            loaded.set_exception(e)
            return
        with self._lock:
            self._running = True
        loaded.set_result(info)
        try:
            with inference_precision(precision, device):  # thread-local: all of this thread's model work
                self._loop(ckpt)
        finally:
            self._fail_pending()

    def _session_settings(self, ckpt: Checkpoint) -> tuple[SessionLimits | None, str]:
        """The checkpoint's sparse settings and what limits them, or why sessions cannot work with it."""
        # "session": serving defaults for users' own text, when the checkpoint has them; else "sparse",
        # the settings tuned on the validation book (in-domain text wants far smaller steps)
        section = ckpt.dyneval.get("session") or ckpt.dyneval.get("sparse", {})
        try:
            base = DynEvalConfig.from_dict(section if isinstance(section, dict) else {}, mode="sparse", cache=None)
        except (TypeError, ValueError) as e:
            return None, f"dyneval.json's sparse section is not valid ({e})"
        sites = ckpt.model.adaptation_sites()
        if not sites:
            return None, f"{type(ckpt.model).__name__} has no adaptation sites"
        units = min(s.dim for s in sites)
        if base.rule in ("rms", "rms_decay"):
            stats = [ckpt.stats.get(f"adapter.{s.name}") for s in sites]
            if any(t is None for t in stats):
                return None, (f"the checkpoint has no adapter statistics (MS_g) for the {base.rule!r} rule; "
                              "train it to the end (or collect them) to serve sessions")
            units = min([units, *(min(t.shape) for t in stats if t is not None)])
        self._base = base
        default = min(base.adapter_units or units, units)
        weight = section.get("cache_weight", 0.0) if isinstance(section, dict) else 0.0
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight <= 1:
            return None, f"dyneval.json's session cache_weight must be a number in [0, 1], not {weight!r}"
        return SessionLimits(lr=base.lr, decay=base.decay, adapter_size=default, max_adapter_size=units,
                             rule=base.rule, eps=base.eps, segment=base.segment, cache_weight=float(weight)), ""

    def _template(self, ckpt: Checkpoint) -> Session:
        """A fresh session of this model, for a store to read sessions back into (tensor layouts, device)."""
        ref = next(ckpt.model.parameters())
        sites = {s.name: 1 for s in ckpt.model.adaptation_sites()}
        return Session(id="", owner=None, created=0.0, last_used=0.0, ttl_s=self.config.session_ttl_s,
                       config=AdaptationConfig(lr=0.0, decay=0.0, adapter_size=1), state=ckpt.model.init_state(1),
                       static_state=ckpt.model.init_state(1), last_byte=BOS,
                       adapter=Adapter.zeros(sites, 1, dtype=ref.dtype, device=ref.device))

    def _rule(self, ckpt: Checkpoint, config: AdaptationConfig) -> UpdateRule:
        """The update rule of a session's settings: the checkpoint's rule and eps, MS_g of its (k, k) block."""
        key = (config.lr, config.decay, config.adapter_size)
        rule = self._rules.get(key)
        if rule is None:
            assert self._base is not None
            cfg = dataclasses.replace(self._base, lr=config.lr, decay=config.decay,
                                      adapter_units=config.adapter_size)
            sites = {s.name: config.adapter_size for s in ckpt.model.adaptation_sites()}
            ms_g = None
            if cfg.rule in ("rms", "rms_decay"):
                ref = next(ckpt.model.parameters())
                ms_g = {k: v.to(ref.device, ref.dtype) for k, v in adapter_ms_g(ckpt.stats, sites).items()}
            rule = UpdateRule(cfg, list(sites), ms_g)
            if len(self._rules) >= _RULE_CACHE:
                self._rules.clear()
            self._rules[key] = rule
        return rule

    def _loop(self, ckpt: Checkpoint) -> None:
        stopping = False
        last_sweep = time.monotonic()
        self._rounds = SuggestRounds(ckpt.model, self._cursors, min_prob=SUGGEST_MIN_PROB, batch=SUGGEST_BATCH,
                                     max_expansions=SUGGEST_MAX_EXPANSIONS, round_rows=SUGGEST_ROUND_ROWS)
        while True:
            idle = not self._texts and not self._gens and not self._pending and not self._searching
            if stopping and idle:
                return
            stopping = self._take(block=idle and not stopping) or stopping
            if idle and not stopping and self.config.max_wait_ms > 0 and self._pending_rows():
                stopping = self._fill(time.monotonic() + self.config.max_wait_ms / 1000) or stopping
            self._admit(ckpt)
            stopping = self._suggest_slice(ckpt) or stopping
            self._step_texts(ckpt)
            self._step_generations()
            if time.monotonic() - last_sweep > _SWEEP_S:
                self.store.sweep()
                last_sweep = time.monotonic()

    def _take(self, *, block: bool) -> bool:
        """Move arrived items to the pending line (waiting for one when `block`); True on the stop sentinel."""
        stopping = False
        timeout: float | None = _SWEEP_S if block else None
        while True:
            try:
                item = self._queue.get(block=block, timeout=timeout)
            except queue.Empty:
                return stopping
            block = False
            if item is None:
                stopping = True  # the work queued before the sentinel still runs
            else:
                self._pending.append(item)

    def _fill(self, deadline: float) -> bool:
        """Wait until `deadline` for more text work, unless the pending work already fills a batch."""
        stopping = False
        while self._pending_rows() < self.config.max_batch and (left := deadline - time.monotonic()) > 0:
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if item is None:
                return True
            self._pending.append(item)
            stopping = self._take(block=False) or stopping
        return stopping

    def _pending_rows(self) -> int:
        return sum(item.rows_needed for item in self._pending if isinstance(item, _Text))

    def _admit(self, ckpt: Checkpoint) -> None:
        """Start what may start, in arrival order (see the module docstring)."""
        rows = sum(len(t.job.rows) for t in self._texts if t.job is not None)
        blocked: set[str] = set()  # sessions with an earlier item still waiting
        texts_full = False
        waiting: collections.deque[_Pending] = collections.deque()
        for item in self._pending:
            sid = item.session_id
            if sid is not None and (sid in self._busy or sid in blocked):
                waiting.append(item)
                blocked.add(sid)
                continue
            if isinstance(item, _Text):
                if texts_full or (rows and rows + item.rows_needed > self.config.max_batch):
                    texts_full = True  # later text work waits too: first come, first served
                    waiting.append(item)
                    if sid is not None:
                        blocked.add(sid)
                    continue
                self._started(item)
                if self._start_text(ckpt, item):
                    rows += item.rows_needed
            elif isinstance(item, _Call):
                self._started(item)
                self._run_call(ckpt, item)
            elif isinstance(item, _Suggest):
                self._started(item)
                self._start_suggest(item)
            elif isinstance(item, GenerationJob):
                self._started(item)
                self._start_generation(ckpt, item)
        self._pending = waiting

    def _claim(self, session_id: str | None) -> None:
        if session_id is not None:
            self._busy.add(session_id)
            self.store.pin(session_id)

    def _release(self, session_id: str | None) -> None:
        if session_id is not None and session_id in self._busy:
            self._busy.discard(session_id)
            self.store.unpin(session_id)

    def _run_call(self, ckpt: Checkpoint, item: _Call) -> None:
        if item.cancelled.is_set() or not item.future.set_running_or_notify_cancel():
            self._stats.cancelled_work += 1
            return
        try:
            result = item.run(ckpt)
        except Exception as e:
            item.future.set_exception(e)
        else:
            item.future.set_result(result)

    def _start_suggest(self, item: _Suggest) -> None:
        self._last_keystroke = time.monotonic()
        if item.cancelled.is_set() or not item.future.set_running_or_notify_cancel():
            self._stats.cancelled_work += 1
            return
        try:
            session = self.get_session(item.target, item.owner)
        except Exception as e:
            item.future.set_exception(e)
            return
        self._suggests.append((item, SuggestJob(session, item.context, item.k, item.max_chars, item.n_chars,
                                                item.deadline)))

    def _suggest_slice(self, ckpt: Checkpoint) -> bool:
        """Run suggestion rounds until no search is left, starting the keystrokes that arrive meanwhile; while
        text or generation work waits, for at most SUGGEST_SLICE_S. -> True if the stop sentinel arrived."""
        stopping = False
        start = time.monotonic()
        while True:
            self._run_suggests(ckpt)
            spent = time.monotonic() - start
            # (with nothing else waiting, still back to the loop now and then: the store's sweep runs there)
            if not self._searching or ((self._texts or self._gens) and spent > SUGGEST_SLICE_S) or spent > 1.0:
                return stopping
            stopping = self._take(block=False) or stopping
            self._admit(ckpt)

    def _run_suggests(self, ckpt: Checkpoint) -> None:
        """Start the suggestions that arrived, then run one round of all the word searches in progress (one
        batched step): a suggestion joins the searches already running at the next round (`SuggestRounds`)."""
        rounds = self._rounds
        assert rounds is not None
        started = [(item, job) for item, job in self._suggests if not self._dropped(item)]
        self._suggests = []
        for job in [job for job in rounds.active if self._dropped(self._searching[job])]:
            rounds.active.remove(job)  # its client went away: the search stops here
            del self._searching[job]
        if not started and not rounds.active:
            return
        self._searching.update((job, item) for item, job in started)
        try:
            if started:
                self._count_suggest_rows(rounds.start([job for _, job in started]))
            rows, done = rounds.round()
        except Exception as e:
            log.exception("a batched suggestion step failed; failing its %d suggestions", len(self._searching))
            for item in self._searching.values():
                item.fail(e)
            self._searching.clear()
            rounds.clear()
            return
        self._count_suggest_rows(rows)
        for job in done:
            item = self._searching.pop(job)
            if job.result is not None:
                self._stats.suggest_cut += not job.result.exact
                item.future.set_result(job.result)
            else:
                item.fail(job.error or RuntimeError("the suggestion was not answered"))

    def _dropped(self, item: _Suggest) -> bool:
        """A started suggestion whose client went away is failed (as running text work is) and counted."""
        if not item.cancelled.is_set():
            return False
        item.fail(asyncio.CancelledError())
        self._stats.cancelled_work += 1
        return True

    def _count_suggest_rows(self, rows: int | None) -> None:
        if rows is not None:
            self._stats.suggest_rows[rows] = self._stats.suggest_rows.get(rows, 0) + 1

    def _start_text(self, ckpt: Checkpoint, item: _Text) -> bool:
        """Read the session and set up the rows; True if the item is now running."""
        if item.cancelled.is_set() or not item.future.set_running_or_notify_cancel():
            self._stats.cancelled_work += 1
            return False
        try:
            session = None
            if item.create is not None:
                session = item.create(ckpt)
            elif item.session_id is not None:
                session = self.get_session(item.session_id, item.owner)
            ref = next(ckpt.model.parameters())
            if session is None:
                rows = [Row(ckpt.model.init_state(1))]
                last = BOS
            else:
                mats = {k: m[0] for k, m in session.adapter.mats.items()}  # (k, k)
                rule = self._rule(ckpt, session.config) if item.mode == "observe" else None
                rows = [Row(session.state, mats, rule)]
                if item.mode == "observe":
                    rows.append(Row(session.static_state))
                last = session.last_byte
            inputs, targets = text_tensors(item.data, last, ref.device)
        except Exception as e:
            item.fail(e)
            return False
        item.job = TextJob(inputs, targets, rows)
        item.session = session
        self._claim(item.session_id)
        self._texts.append(item)
        return True

    def _step_texts(self, ckpt: Checkpoint) -> None:
        """One batched segment of every running text; then finish those that are done."""
        running = []
        for item in self._texts:
            if item.cancelled.is_set():
                self._stats.cancelled_work += 1
                item.fail(asyncio.CancelledError())
                self._release(item.session_id)
            else:
                running.append(item)
        self._texts = running
        if not running:
            return
        if time.monotonic() - self._last_keystroke < TYPING_S:  # shorter steps while someone types
            stepping: list[_Text] = []
            rows = 0
            for item in running:
                need = len(item.job.rows) if item.job is not None else 0
                if stepping and rows + need > TYPING_TEXT_ROWS:
                    break
                stepping.append(item)
                rows += need
            # the others go first next time
            self._texts = running = [*running[len(stepping):], *stepping]
        else:
            stepping = running
        assert self._base is not None or all(t.mode == "static" for t in running)
        config = self._base or DynEvalConfig(mode="static")
        try:
            rows = batch_step(ckpt.model, [t.job for t in stepping if t.job is not None], config, self._stacked)
        except Exception as e:
            log.exception("a batched step failed; failing its %d items", len(stepping))
            for item in stepping:
                item.fail(e)
                self._release(item.session_id)
            self._texts = [item for item in running if item not in stepping]
            return
        self._stats.batches += 1
        self._stats.batch_rows[rows] = self._stats.batch_rows.get(rows, 0) + 1
        self._texts = []
        for item in running:
            assert item.job is not None
            if not item.job.done:
                self._texts.append(item)
                continue
            try:
                item.future.set_result(self._finish_text(item))
            except Exception as e:
                item.fail(e)
            finally:
                self._release(item.session_id)

    def _finish_text(self, item: _Text) -> TextScore:
        assert item.job is not None
        main = item.job.rows[0]
        lp = torch.cat(main.logprobs)  # (T,)
        bits = -float(lp.double().sum()) / LN2
        static_bits = None
        self._stats.nonfinite_resets += main.dropped + main.resets
        if item.mode == "observe":
            assert item.session is not None and main.mats is not None
            shadow = item.job.rows[1]
            static_bits = -shadow.total_logprob() / LN2
            self._stats.updates += main.updates
            old = item.session
            stats = SessionStats(bytes_observed=old.stats.bytes_observed + len(item.data),
                                 updates=old.stats.updates + main.updates,
                                 nonfinite_resets=old.stats.nonfinite_resets + main.dropped + main.resets,
                                 bits=old.stats.bits + bits, static_bits=old.stats.static_bits + static_bits)
            words = old.words.copy()  # copied: the stored record may be read meanwhile
            words.observe(item.data.decode("utf-8", errors="ignore"))
            session = dataclasses.replace(
                old, last_used=time.time(), state=_owned(main.state), static_state=_owned(shadow.state),
                last_byte=item.data[-1], adapter=Adapter({k: m.unsqueeze(0).clone() for k, m in main.mats.items()}),
                stats=stats, words=words)
            if not self.store.update(session):
                raise SessionNotFound(session.id)  # deleted while it was being observed
        return TextScore(bits=bits, bytes=len(item.data), logprobs=lp.tolist() if item.logprobs else None,
                         static_bits=static_bits, updates=main.updates,
                         nonfinite_reset=bool(main.dropped or main.resets))

    def _start_generation(self, ckpt: Checkpoint, job: GenerationJob) -> None:
        if job.cancelled:
            self._stats.cancelled += 1
            return
        try:
            start: dict[str, Any] = {}
            if job.session_id is not None:
                session = self.get_session(job.session_id, job.owner)
                start = {"state": session.state, "last_byte": session.last_byte, "adapter": session.adapter}
            done = job.start(ckpt, self._stats, **start)
        except Exception as e:
            job.fail(e)
            return
        if done:
            self._generation_ended(job)
            return
        if job.adapt:
            self._claim(job.session_id)  # nothing else may change the session until it has adapted
        self._gens.append(job)
        self._stats.active = len(self._gens)

    def _step_generations(self) -> None:
        """One byte of every running generation: sampled per sequence, fed to the model in one batched forward."""
        running: list[GenerationJob] = []
        feeds: list[tuple[GenerationJob, Stepper, int]] = []
        for job in self._gens:
            if job.cancelled:
                self._stats.cancelled += 1
                self._release(job.session_id if job.adapt else None)
                continue
            try:
                feeds += [(job, stepper, token) for stepper, token in job.sample(self._stats)]
            except Exception as e:
                job.fail(e)
                self._generation_ended(job)
                continue
            if job.finished:
                self._generation_ended(job)
            else:
                running.append(job)
        if feeds:
            try:
                Stepper.feed_many([stepper for _, stepper, _ in feeds], [token for _, _, token in feeds])
            except Exception as e:
                failed = {id(job): job for job, _, _ in feeds}
                for job in failed.values():
                    job.fail(e)
                    self._generation_ended(job)
                running = [job for job in running if id(job) not in failed]
            rows = len(feeds)
            self._stats.decode_rows[rows] = self._stats.decode_rows.get(rows, 0) + 1
        self._gens = running
        self._stats.active = len(running)

    def _generation_ended(self, job: GenerationJob) -> None:
        """With `adapt`, the session observes the prompt and what was generated, before its next work. (Called
        when the job has finished or failed; its caller may already have left: that is no cancellation.)"""
        if not job.adapt:
            return
        self._release(job.session_id)
        data = job.prompt + bytes(job.generated)
        if job.failed or not data:
            return
        follow: Future[TextScore] = Future()
        follow.add_done_callback(_log_failure)
        self._pending.appendleft(_Text(follow, job.session_id, job.owner, counted=False, data=data, mode="observe"))

    def _fail_pending(self) -> None:
        """On the way out (a stop, or a crash of the loop): nothing may wait on a future or a stream forever."""
        with self._lock:
            self._running = False
        error = EngineUnavailable("the engine stopped")
        for job in self._gens:
            job.fail(error)
        for item in self._texts:
            item.fail(error)
        for suggestion, _ in self._suggests:
            suggestion.fail(error)
        for suggestion in self._searching.values():
            suggestion.fail(error)
        self._gens, self._texts, self._suggests = [], [], []
        self._searching.clear()
        if self._rounds is not None:
            self._rounds.clear()
        self._stats.active = 0
        while True:
            try:
                queued = self._queue.get_nowait()
            except queue.Empty:
                break
            if queued is not None:
                self._pending.append(queued)
        for pending in self._pending:
            self._started(pending)
            pending.fail(error)
        self._pending.clear()
        for session_id in list(self._busy):
            self._release(session_id)


def _owned(state: State) -> State:
    """A state that owns its memory (not a view into a batch), fit to be stored."""
    return State({k: v.clone() for k, v in state.tensors.items()})


def _log_failure(future: Future[Any]) -> None:
    error = future.exception()
    if error is not None and not isinstance(error, SessionNotFound):
        log.error("adapting a session on its generation failed", exc_info=error)
