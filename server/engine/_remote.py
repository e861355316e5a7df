"""The engine in its own process: `EngineHost` serves an `Engine` to HTTP worker processes over ZeroMQ, and
`RemoteEngine` is what a worker's app holds instead of the engine, with the same async API.

The split is vLLM's (its API server and its engine core): the HTTP workers parse requests, check them and write
answers; the engine process owns the model, the device, the scheduler and the session store, so that admission
(429), ordering and batching stay decided in one place for all the workers. One request is one message each way
(a generation: one message an event); a worker whose caller goes away sends `cancel`, and the engine drops the work
as it does for a caller of its own. The workers are our own children, talking over a Unix socket in a directory only
this user can enter; messages are MessagePack (`_wire.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import itertools
import logging
import math
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from models.sampling import SamplingParams
from models.suggest import Suggestions
from server.engine._engine import Engine, EngineConfig, ModelInfo, SessionLimits
from server.engine._errors import EngineUnavailable, SessionsUnavailable
from server.engine._generation import GenerationStream, _Failed
from server.engine._session import Session, SessionConfig, SessionStats, SettingsView
from server.engine._stats import EngineStats
from server.engine._text import TextScore
from server.engine._wire import pack, record, unpack
from server.engine._work import Budget

__all__ = ["EngineHost", "RemoteEngine", "SessionInfo"]

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # how often a worker asks the engine whether it is alive, crashed or stalled
# A worker that has heard nothing from the engine for this long serves nothing (503 engine_unavailable): the engine
# process is gone or wedged beyond its own stall report.
SILENT_S = 10.0
# Exceptions a worker rebuilds from the engine's answer: the engine's own, the model layer's and Python's.
_ERROR_MODULES = ("server.engine.", "models.", "builtins")


@record
@dataclass(frozen=True)
class SessionInfo:
    """What a worker is shown of a session: its record without its tensors (what the answers of the session routes
    say), so that a read moves a few hundred bytes, not the session's state."""

    id: str
    created: float
    last_used: float
    ttl_s: float
    config: SessionConfig | SettingsView
    nbytes: int
    stats: SessionStats
    pending: bytes

    @classmethod
    def of(cls, session: Session) -> SessionInfo:
        return cls(id=session.id, created=session.created, last_used=session.last_used, ttl_s=session.ttl_s,
                   config=session.config, nbytes=session.nbytes, stats=session.stats, pending=session.pending)

    def expires_at(self) -> float:
        return self.last_used + self.ttl_s


@record
@dataclass(frozen=True)
class _Hello:
    """What a worker learns once, when it connects: what does not change while the engine runs."""

    info: ModelInfo
    config: EngineConfig
    limits: SessionLimits | None
    no_sessions: str  # SessionsUnavailable's message where `limits` is None
    memories: frozenset[str]


@record
@dataclass(frozen=True)
class _Status:
    alive: bool
    crashed: bool
    stalled_s: float


def _error_state(exc: BaseException) -> tuple[str, str, tuple[Any, ...], dict[str, Any]]:
    state = {k: v for k, v in vars(exc).items() if not k.startswith("__")}
    return type(exc).__module__, type(exc).__qualname__, exc.args, state


def _rebuild_error(module: str, name: str, args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """The engine's exception as the worker raises it (its type, message and attributes: a 429's retry_after_s), so
    that server/errors.py answers it as it does in one process. An unknown type (a bug) is a RuntimeError: a 500."""
    cls: Any = None
    if module == "builtins" or module.startswith(_ERROR_MODULES):
        try:
            cls = importlib.import_module(module)
            for part in name.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError):
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(f"the engine failed: {module}.{name}: {args[0] if args else ''}")
    exc: BaseException = cls.__new__(cls)
    exc.args = tuple(args)
    vars(exc).update(state)
    return exc


# -- the engine's side ------------------------------------------------------------------------------------------


class EngineHost:
    """Serves `engine` at `address` (`ipc://...`) on a thread of its own with its own event loop; each worker is a
    DEALER socket, this a ROUTER. `start` binds and returns; `stop` cancels what is in flight and closes."""

    def __init__(self, engine: Engine, address: str, take_rate: Callable[[str], float | None] | None = None) -> None:
        self.engine, self.address = engine, address
        self._take_rate = take_rate  # the API keys' rate limit (server.ratelimit), kept here for all the workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._tasks: dict[tuple[bytes, bytes], asyncio.Task[None]] = {}
        self._budgets: dict[tuple[bytes, str], list[Any]] = {}  # (worker, token) -> [Budget, streams using it]

    def start(self) -> None:
        bound: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(bound,), name="adaptlm-engine-host", daemon=True)
        self._thread.start()
        bound.result()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, bound: Future[None]) -> None:
        try:
            asyncio.run(self._serve(bound))
        except BaseException as e:  # noqa: BLE001 (reported to start(), or logged once)
            if not bound.done():
                bound.set_exception(e)
            else:
                log.critical("the engine host stopped", exc_info=True)

    async def _serve(self, bound: Future[None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        bound.set_result(None)
        receiving = asyncio.ensure_future(self._receive(socket))
        await self._stopped.wait()
        receiving.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(receiving, *self._tasks.values(), return_exceptions=True)
        socket.close()
        context.term()

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            frames = await socket.recv_multipart()
            try:
                worker, rid, kind, payload = frames
                if kind == b"cancel":
                    task = self._tasks.get((worker, rid))
                    if task is not None:
                        task.cancel()
                    continue
                method, args, kwargs = unpack(payload)
                method, args, kwargs = str(method), tuple(args), dict(kwargs)
            except Exception:  # noqa: BLE001 (not from a worker of ours: dropped, and the host serves on)
                log.error("dropped a message to the engine that does not read as a call")
                continue
            task = asyncio.ensure_future(self._answer(socket, worker, rid, method, args, kwargs))
            self._tasks[(worker, rid)] = task
            task.add_done_callback(functools.partial(self._forget, (worker, rid)))

    def _forget(self, key: tuple[bytes, bytes], _: asyncio.Task[None]) -> None:
        self._tasks.pop(key, None)

    async def _answer(self, socket: zmq.asyncio.Socket, worker: bytes, rid: bytes, method: str,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        async def send(status: bytes, value: Any) -> None:
            try:
                data = pack(value)
            except (TypeError, ValueError) as e:  # a value of no record type (a bug): the caller's 500
                data = pack(_error_state(RuntimeError(f"the engine's answer does not cross the wire: {e}")))
                status = b"err"
            await socket.send_multipart([worker, rid, status, data])

        try:
            if method == "generate":
                await self._generate(worker, send, args, kwargs)
                return
            handler = getattr(self, f"_call_{method}", None)
            if handler is None:
                raise RuntimeError(f"no engine call {method!r}")
            await send(b"ok", await handler(*args, **kwargs))
        except asyncio.CancelledError:
            pass  # the worker's caller went away: the engine has dropped the work; nobody waits for an answer
        except Exception as e:  # noqa: BLE001 (every failure is the caller's answer, as in one process)
            await send(b"err", _error_state(e))

    async def _generate(self, worker: bytes, send: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        token = kwargs.pop("budget")
        key = (worker, token)
        entry = self._budgets.setdefault(key, [self.engine.budget(), 0])
        entry[1] += 1
        try:
            stream = self.engine.generate(*args, budget=entry[0], **kwargs)
            async with stream:
                try:
                    async for event in stream:
                        await send(b"event", event)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 (the stream's failure, delivered as its last event)
                    await send(b"err", _error_state(e))
                    return
            await send(b"end", None)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._budgets[key]

    # the calls a worker may make: the engine's async API, answered with what a worker needs

    async def _call_hello(self) -> _Hello:
        engine = self.engine
        try:
            limits: SessionLimits | None = engine.session_limits()
            no_sessions = ""
        except SessionsUnavailable as e:
            limits, no_sessions = None, str(e)
        memories = frozenset(engine.memory_names) if limits is not None else frozenset()
        return _Hello(engine.info, engine.config, limits, no_sessions, memories)

    async def _call_status(self) -> _Status:
        return _Status(self.engine.alive, self.engine.crashed, self.engine.stalled_s())

    async def _call_take_rate(self, key: str) -> float | None:
        return self._take_rate(key) if self._take_rate is not None else None

    async def _call_stats(self) -> EngineStats:
        return await asyncio.to_thread(lambda: self.engine.stats)  # the store's may be a Redis round trip

    async def _call_score(self, *args: Any, **kwargs: Any) -> TextScore:
        return await self.engine.score(*args, **kwargs)

    async def _call_observe(self, *args: Any, **kwargs: Any) -> tuple[TextScore, bool]:
        return await self.engine.observe(*args, **kwargs)

    async def _call_suggest(self, *args: Any, **kwargs: Any) -> Suggestions:
        return await self.engine.suggest(*args, **kwargs)

    async def _call_session_settings(self, *args: Any, **kwargs: Any) -> tuple[SessionConfig, float]:
        return await self.engine.session_settings(*args, **kwargs)

    async def _call_create_session(self, *args: Any, **kwargs: Any) -> tuple[SessionInfo, TextScore | None]:
        session, scored = await self.engine.create_session(*args, **kwargs)
        return SessionInfo.of(session), scored

    async def _call_read_session(self, *args: Any, **kwargs: Any) -> SessionInfo:
        return SessionInfo.of(await self.engine.read_session(*args, **kwargs))

    async def _call_remove_session(self, *args: Any, **kwargs: Any) -> None:
        await self.engine.remove_session(*args, **kwargs)

    async def _call_reset_session(self, *args: Any, **kwargs: Any) -> SessionInfo:
        return SessionInfo.of(await self.engine.reset_session(*args, **kwargs))

    async def _call_export_session(self, *args: Any, **kwargs: Any) -> bytes:
        return await self.engine.export_session(*args, **kwargs)

    async def _call_import_session(self, *args: Any, **kwargs: Any) -> SessionInfo:
        return SessionInfo.of(await self.engine.import_session(*args, **kwargs))


# -- a worker's side --------------------------------------------------------------------------------------------


class RemoteStream(GenerationStream):
    """A generation running in the engine process, read here as `GenerationStream` reads one in this process;
    leaving it (or cancelling its reader) cancels it there."""

    def __init__(self, n: int, engine: RemoteEngine, rid: bytes) -> None:
        super().__init__(n, time.perf_counter(), threading.Event())
        self._engine, self._rid = engine, rid

    def cancel(self) -> None:
        if not self.cancelled:
            super().cancel()
            self._engine._cancel(self._rid)


class RemoteEngine:
    """The engine as an HTTP worker sees it: `Engine`'s async API, each call a message to the engine process
    (`EngineHost`). Call `connect` on the event loop that will use it (the app's lifespan), `close` at its end."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._socket: zmq.asyncio.Socket | None = None
        self._context: zmq.asyncio.Context | None = None
        self._hello: _Hello | None = None
        self._status = _Status(alive=False, crashed=False, stalled_s=0.0)
        self._stats = EngineStats()
        self._heard = -math.inf  # time.monotonic() of the engine's last answer
        self._ids = itertools.count()
        self._calls: dict[bytes, asyncio.Future[Any]] = {}
        self._streams: dict[bytes, RemoteStream] = {}
        self._budgets: weakref.WeakKeyDictionary[Budget, str] = weakref.WeakKeyDictionary()
        self._tasks: list[asyncio.Task[None]] = []
        self._parent = os.getppid()

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def connect(self, timeout_s: float = 60.0) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        self._tasks.append(asyncio.ensure_future(self._receive()))
        async with asyncio.timeout(timeout_s):
            self._hello = await self._call("hello")
            self._status = await self._call("status")
        self._tasks.append(asyncio.ensure_future(self._watch()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._status = dataclasses.replace(self._status, alive=False)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable("the engine connection closed"))
        if self._socket is not None:
            self._socket.close()
        if self._context is not None:
            self._context.term()

    # -- what does not change while the engine runs, and its state ----------------------------------------------

    @property
    def hello(self) -> _Hello:
        if self._hello is None:
            raise EngineUnavailable("the engine has not loaded a model")
        return self._hello

    @property
    def info(self) -> ModelInfo:
        return self.hello.info

    @property
    def config(self) -> EngineConfig:
        return self.hello.config

    @property
    def memory_names(self) -> frozenset[str]:
        return self.hello.memories

    def session_limits(self) -> SessionLimits:
        limits = self.hello.limits
        if limits is None:
            raise SessionsUnavailable(self.hello.no_sessions)
        return limits

    @property
    def alive(self) -> bool:
        return self._status.alive and time.monotonic() - self._heard < SILENT_S

    @property
    def crashed(self) -> bool:
        return self._status.crashed

    def stalled_s(self) -> float:
        return self._status.stalled_s

    def budget(self) -> Budget:
        return Budget.of_setting(self.config.max_request_engine_s)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters as `refresh_stats` last read them (`/metrics` refreshes them first)."""
        return self._stats

    async def take_rate(self, key: str) -> float | None:
        """A token of `key`'s rate limit, from the buckets the engine's process keeps for every worker: None, or the
        seconds until one is back."""
        wait: float | None = await self._call("take_rate", key)
        return wait

    async def refresh_stats(self, timeout_s: float = 5.0) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                self._stats = await self._call("stats")
        except (TimeoutError, EngineUnavailable):  # the scrape still answers, with the counters last read
            log.warning("the engine's statistics could not be read; /metrics shows those last read")

    # -- work ---------------------------------------------------------------------------------------------

    async def score(self, data: bytes, logprobs: bool = False, *, session_id: str | None = None,
                    owner: str | None = None, adapt: bool = False) -> TextScore:
        result: TextScore = await self._call("score", data, logprobs, session_id=session_id, owner=owner,
                                             adapt=adapt)
        return result

    async def observe(self, data: bytes, *, session_id: str, owner: str | None,
                      idempotency_key: str | None = None) -> tuple[TextScore, bool]:
        result: tuple[TextScore, bool] = await self._call("observe", data, session_id=session_id, owner=owner,
                                                          idempotency_key=idempotency_key)
        return result

    def generate(self, prompt: bytes, params: SamplingParams | None, *, n: int = 1, logprobs: int | None = None,
                 prompt_logprobs: bool = False, session_id: str | None = None, owner: str | None = None,
                 adapt: bool = False, budget: Budget | None = None) -> RemoteStream:
        if n < 1:
            raise ValueError("n must be at least 1")
        if adapt and session_id is None:
            raise ValueError("adapting needs a session")
        budget = budget or self.budget()
        token = self._budgets.setdefault(budget, f"b{next(self._ids)}")
        rid = self._next_id()
        stream = RemoteStream(n, self, rid)
        self._streams[rid] = stream
        self._send(rid, "generate", (prompt, params), dict(n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                                          session_id=session_id, owner=owner, adapt=adapt,
                                                          budget=token))
        return stream

    async def suggest(self, session_id: str, owner: str | None, context: str, *, k: int = 3, max_chars: int = 24,
                      n_chars: int = 5) -> Suggestions:
        result: Suggestions = await self._call("suggest", session_id, owner, context, k=k, max_chars=max_chars,
                                               n_chars=n_chars)
        return result

    # -- sessions -----------------------------------------------------------------------------------------

    async def session_settings(self, memories: Mapping[str, Mapping[str, Any] | None] | None,
                               ttl_s: float | None) -> tuple[SettingsView, float]:
        result: tuple[SettingsView, float] = await self._call("session_settings", memories, ttl_s)
        return result

    async def create_session(self, *, owner: str | None, config: SessionConfig | SettingsView | None = None,
                             ttl_s: float | None = None, initial_text: bytes | None = None
                             ) -> tuple[SessionInfo, TextScore | None]:
        result: tuple[SessionInfo, TextScore | None] = await self._call(
            "create_session", owner=owner, config=config, ttl_s=ttl_s, initial_text=initial_text)
        return result

    async def read_session(self, session_id: str, owner: str | None, *, touch: bool = True) -> SessionInfo:
        result: SessionInfo = await self._call("read_session", session_id, owner, touch=touch)
        return result

    async def remove_session(self, session_id: str, owner: str | None) -> None:
        await self._call("remove_session", session_id, owner)

    async def reset_session(self, session_id: str, owner: str | None) -> SessionInfo:
        result: SessionInfo = await self._call("reset_session", session_id, owner)
        return result

    async def export_session(self, session_id: str, owner: str | None) -> bytes:
        result: bytes = await self._call("export_session", session_id, owner)
        return result

    async def import_session(self, session_id: str, owner: str | None, blob: bytes) -> SessionInfo:
        result: SessionInfo = await self._call("import_session", session_id, owner, blob)
        return result

    # -- the wire -----------------------------------------------------------------------------------------

    def _next_id(self) -> bytes:
        return next(self._ids).to_bytes(8, "little")

    def _send(self, rid: bytes, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._socket is None:
            raise EngineUnavailable("the engine is not connected")
        payload = pack((method, args, kwargs))
        # a DEALER queues what it cannot send at once (up to its high-water mark): this does not block
        self._socket.send_multipart([rid, b"call", payload], copy=len(payload) < 65536)

    def _cancel(self, rid: bytes) -> None:
        self._calls.pop(rid, None)
        self._streams.pop(rid, None)
        if self._socket is not None and not self._socket.closed:
            self._socket.send_multipart([rid, b"cancel", b""])

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        rid = self._next_id()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[rid] = future
        self._send(rid, method, args, kwargs)
        try:
            return await future
        except asyncio.CancelledError:
            if future.cancelled() or not future.done():  # (awaiting it, the cancelled caller cancelled it too)
                self._cancel(rid)  # the engine drops the work, as it does for its own callers
            raise
        finally:
            self._calls.pop(rid, None)

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            rid, status, payload = await self._socket.recv_multipart()
            self._heard = time.monotonic()
            value = unpack(payload)
            future = self._calls.get(rid)
            if future is not None:
                if future.done():
                    continue
                if status == b"ok":
                    future.set_result(value)
                else:
                    future.set_exception(_rebuild_error(*value))
                continue
            stream = self._streams.get(rid)
            if stream is None:
                continue  # cancelled here already
            if status == b"event":
                stream._deliver(value)
            elif status == b"err":
                self._streams.pop(rid, None)
                stream._deliver(_Failed(_rebuild_error(*value)))
            else:
                self._streams.pop(rid, None)

    async def _watch(self) -> None:
        """The engine's state every HEARTBEAT_S (`/healthz` and `/readyz` read it); a worker whose engine process
        is gone (it was the parent) stops serving and exits, draining what it can."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if os.getppid() != self._parent:
                log.error("the engine process is gone; this worker stops")
                self._status = _Status(alive=False, crashed=True, stalled_s=0.0)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            try:
                async with asyncio.timeout(SILENT_S):
                    self._status = await self._call("status")
            except TimeoutError:
                log.warning("the engine has not answered for %g s", SILENT_S)
