"""The FastAPI app: `create_app(settings)`; its lifespan loads the model into the engine (`start_engine`) and stops
it. `serve` (`adaptlm serve`) starts the engine first and hands it to the app, so that a bad checkpoint is one line
and exit status 2, read once."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kernels import _dispatch as kernel_dispatch
from kernels import attention
from models.checkpoint import CheckpointError
from server._admission import STATE_KEY, Admission, AdmissionMiddleware, Door
from server._asgi import HTTPMiddleware
from server._slow_clients import head_deadline_protocol
from server.engine import (
    AnyEngine,
    Engine,
    EngineConfig,
    MemorySessionStore,
    RedisSessionStore,
    RemoteEngine,
    SessionStore,
)
from server.errors import (
    PayloadTooLargeError,
    RequestTimeoutError,
    UnexpectedErrorMiddleware,
    error_response,
    install_error_handler,
)
from server.metrics import Metrics, MetricsMiddleware
from server.ratelimit import RateLimiter
from server.request_id import RequestIdMiddleware, uvicorn_log_config
from server.routes import ROUTERS
from server.settings import Settings, ignored_variables

__all__ = ["create_app", "model_threads", "rate_limiter", "serve", "start_engine", "uvicorn_options"]

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return version("adaptlm")
    except PackageNotFoundError:
        return "0.0.0"


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What a uvicorn serving this app is given besides the app, host, port and logging. The app has no WebSocket
    route: `ws="none"` serves a request asking for an upgrade as the HTTP/1.1 request it also is (through the door
    and the middlewares), instead of handing its connection to a WebSocket protocol that only refuses it."""
    return {"timeout_keep_alive": settings.keep_alive_s, "http": head_deadline_protocol(settings.client_timeout_s),
            "ws": "none"}


class _Server(uvicorn.Server):
    """uvicorn re-raises the SIGTERM or SIGINT it caught once it has shut down, so even a clean drain ends with
    status 143 (or 130), which supervisors read as a failure. A clean drain here exits 0; a failed one (the
    lifespan's shutdown raised, or a second Ctrl-C forced the exit) still ends by the signal."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        lifespan = getattr(self, "lifespan", None)
        failed = self.force_exit or getattr(lifespan, "shutdown_failed", False) \
            or getattr(lifespan, "error_occurred", False)
        if not failed:
            self._captured_signals.clear()


def serve(settings: Settings) -> int:
    """Serve `create_app(settings)` on settings.host:port until SIGTERM or SIGINT -> the exit status: 0 after a
    clean drain (the work in flight finished, the sessions kept), 3 if the start-up failed. The engine loads the
    checkpoint before uvicorn starts: a bad one raises CheckpointError here (the CLI's one line and status 2), and
    the checkpoint is read once: the load is its own check (a large checkpoint is slow to read)."""
    problem = _unreachable_store(settings)
    if problem is not None:  # one line, rather than the start-up's traceback after the model has loaded
        print(f"adaptlm: error: {problem}", file=sys.stderr)  # noqa: T201 (the CLI's one line, before any logging)
        return 3
    if settings.workers > 0:
        from server._workers import serve_workers

        return serve_workers(settings)
    try:
        engine = start_engine(settings)
    except Exception as e:
        if isinstance(e, CheckpointError):  # the caller's to report (the CLI: one line, status 2)
            raise
        log.exception("the start-up failed")  # as a failed lifespan start-up: its traceback, uvicorn's status
        return 3
    config = uvicorn.Config(create_app(settings, engine=engine), host=settings.host, port=settings.port,
                            log_level=settings.log_level, log_config=uvicorn_log_config(settings.log_format),
                            **uvicorn_options(settings))
    server = _Server(config)
    try:
        server.run()
    finally:  # the lifespan stops the engine; where it never ran (the port was taken), stop it here
        engine.stop()
    return 0 if server.started else 3  # uvicorn's own status for a failed start-up


def model_threads(settings: Settings) -> int:
    """torch's intra-op threads for the model: the setting; else what OMP_NUM_THREADS gave torch; else 1
    (`Settings.threads`)."""
    if settings.threads is not None:
        return settings.threads
    return torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else 1


def start_engine(settings: Settings) -> Engine:
    """The process-wide kernel settings, the session store and the engine with the checkpoint loaded (blocking:
    not on the event loop) -> the engine; its `store` closes with it (`create_app`'s lifespan). Raises
    CheckpointError on a bad checkpoint."""
    config = EngineConfig(max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms,
                          max_queue=settings.max_queue, retry_after_s=settings.retry_after_s,
                          session_ttl_s=settings.session_ttl_s, max_session_ttl_s=settings.max_session_ttl_s,
                          suggest_budget_ms=settings.suggest_budget_ms,
                          max_request_engine_s=settings.max_request_engine_s, precision=settings.precision,
                          device=settings.device, cuda_graphs=settings.cuda_graphs,
                          session_slots=settings.session_slots, suggest_on_device=settings.suggest_on_device)
    store = _session_store(settings)
    torch.set_num_threads(model_threads(settings))
    attention.TUNING = attention.Tuning.parse(settings.attention_tuning)  # process-wide, as the kernels are
    kernel_dispatch.use(settings.kernels)
    for message in ignored_variables():
        log.warning("%s", message)
    engine = Engine(settings.checkpoint, config=config, store=store)
    engine.start()
    return engine


def create_app(settings: Settings, *, engine: AnyEngine | None = None, door: Door | None = None) -> FastAPI:
    """The app for `settings`. Nothing is loaded until its lifespan starts (uvicorn, or TestClient as a
    context manager); a bad checkpoint then fails the start-up with CheckpointError. Given a started `engine`
    (`start_engine`), the lifespan serves with it instead, and stops it and its store at shutdown; given a
    `RemoteEngine` (an HTTP worker of `serve_workers`), it connects to the engine process at start-up and lets go of
    it at shutdown. `door`: where the places of requests for model work are counted (`server/_admission.py`; a
    worker's are shared with the server's other workers), else in the app. The lifespan's state carries the app's
    `Admission` (STATE_KEY), where the server's HTTP protocol finds the door."""
    metrics = Metrics()
    admission = Admission(door or Door(settings.max_queue), settings.retry_after_s, metrics,
                          cors=bool(settings.cors_origins))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        if isinstance(engine, RemoteEngine):  # an HTTP worker: the engine runs in the serving process
            await engine.connect()
            metrics.refresh_engine_stats = engine.refresh_stats
            _serve_with(app, engine, metrics)
            try:
                yield {STATE_KEY: admission}
            finally:
                await engine.close()
            return
        # start() and stop() block (loading, joining the worker): keep them off the event loop.
        running = engine if engine is not None else await asyncio.to_thread(start_engine, settings)
        _serve_with(app, running, metrics)
        try:
            yield {STATE_KEY: admission}
        finally:
            # The engine finishes its queued and running work, writing every session back to the store. With
            # Redis that is all there is to keep (each change was written when it was made); the memory store
            # writes its snapshot file when it closes (ADAPTLM_SESSION_SNAPSHOT; without one its sessions end
            # with the process).
            await asyncio.to_thread(running.stop)
            await asyncio.to_thread(running.store.close)

    # redirect_slashes=False: a path with a trailing slash (`/v1/sessions/%2e%2e%2f`) is a 404 in the one error
    # shape, not a 307 to a Location built from the client's Host header.
    app = FastAPI(title="adaptlm", version=_version(), lifespan=lifespan, redirect_slashes=False,
                  description="Scoring and generation with adaptive byte-level language models.")
    app.openapi = functools.partial(_openapi, app, settings)  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.rate_limiter = rate_limiter(settings)
    install_error_handler(app)
    for router in ROUTERS:
        app.include_router(router)
    # The last added middleware is the outermost: metrics also see refused bodies and 500s, and every answer gets
    # its request ID.
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, idle_s=settings.client_timeout_s)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if settings.cors_origins:  # pages of other origins (a keyboard web app) call the API from the browser
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_credentials=False,
                           allow_methods=["GET", "POST", "PUT", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-ID", "X-Session-Id",
                                          "Idempotency-Key"],
                           expose_headers=["X-Request-ID", "Retry-After", "Idempotent-Replayed"], max_age=600)
    app.add_middleware(RequestIdMiddleware)  # every answer carries X-Request-ID, the log lines it causes too
    return app


def _serve_with(app: FastAPI, running: AnyEngine, metrics: Metrics) -> None:
    """The app serves with `running` (an engine, or a worker's RemoteEngine) from now: its metrics' labels and
    counters, `app.state.engine`."""
    metrics.model = running.info.name
    metrics.start_counting_refusals()
    metrics.kernel = running.info.kernel
    metrics.kernel_check_failed = bool(running.info.kernel_check)
    metrics.precision = running.info.precision
    metrics.engine_stats = lambda: running.stats
    app.state.engine = running


def rate_limiter(settings: Settings) -> RateLimiter:
    """The API keys' token buckets of `settings` (kept by the app, or by the engine's process for its HTTP workers,
    so that a key's rate is the server's, whichever worker answers)."""
    return RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst or math.ceil(2 * settings.rate_limit_per_s))


def _openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's schema with the limits that only this server knows (its settings, and the checkpoint's adapter
    size once it is loaded), so that the schema and the server accept the same requests. What the schema cannot
    say: texts are limited in UTF-8 bytes (ADAPTLM_MAX_TEXT_BYTES, a 413; on /v1/completions OpenAI's 400
    `context_length_exceeded`), and `model` must be the served one."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = FastAPI.openapi(app)
    app.openapi_schema = None  # FastAPI cached its own: cache ours instead, complete
    models = schema.get("components", {}).get("schemas", {})
    _drop_fastapi_422(schema)
    limits: list[tuple[str, str, float]] = [
        ("SessionCreateRequest", "ttl_s", settings.max_session_ttl_s),
        ("GenerateRequest", "max_tokens", settings.max_tokens),
        ("CompletionRequest", "max_tokens", settings.max_tokens),
        ("CompletionRequest", "n", settings.max_n),
    ]
    engine = getattr(app.state, "engine", None)
    limits_known = isinstance(engine, (Engine, RemoteEngine)) and engine.alive
    if isinstance(engine, (Engine, RemoteEngine)) and limits_known and engine.info.sessions is not None:
        limits.append(("AdaptationParams", "adapter_size", engine.info.sessions.max_adapter_size))
    for model, field, maximum in limits:
        prop = models.get(model, {}).get("properties", {}).get(field)
        if prop is not None:
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") in ("number", "integer"):
                    branch["maximum"] = maximum
    # a list of prompts: n choices of each, at most max_n choices in all (so at most max_n prompts)
    prompt = models.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for branch in prompt.get("anyOf", []):
        if branch.get("type") == "array":
            branch["maxItems"] = settings.max_n
    if limits_known:  # before the model is loaded, the checkpoint's limits are not known yet: not cached
        app.openapi_schema = schema
    return schema


def _drop_fastapi_422(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 in its own shape (HTTPValidationError) on each route that takes input and declares
    none; this server never sends that shape, and such routes answer no 422 (the OpenAI routes send OpenAI's 400
    instead: errors.OPENAI_ROUTES). The routes that do answer 422 declare it (errors.openapi_responses)."""
    fastapi_422 = {"$ref": "#/components/schemas/HTTPValidationError"}
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            responses = operation.get("responses", {})
            if responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema") == fastapi_422:
                del responses["422"]
    models = schema.get("components", {}).get("schemas", {})
    models.pop("HTTPValidationError", None)
    models.pop("ValidationError", None)


def _unreachable_store(settings: Settings) -> str | None:
    """What is wrong with a Redis session store that does not answer a PING (no password in it), or None."""
    if settings.session_store == "memory":
        return None
    import redis

    url = settings.session_store
    where = f"{url.scheme}://{url.host}:{url.port}{url.path or ''}"
    client = redis.Redis.from_url(str(url), socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        client.ping()
    except redis.AuthenticationError as e:  # a ConnectionError in redis-py, but Redis did answer
        return f"the session store {where} refused the credentials ({e})"
    except (redis.ConnectionError, redis.TimeoutError) as e:
        return f"the session store {where} does not answer ({e})"
    except redis.RedisError as e:
        return f"the session store {where} answered with an error ({type(e).__name__}: {e})"
    finally:
        client.close()
    return None


def _session_store(settings: Settings) -> SessionStore:
    owner_sessions, owner_bytes = settings.session_share()
    if settings.session_store == "memory":
        return MemorySessionStore(max_sessions=settings.max_sessions, max_bytes=settings.session_memory_bytes,
                                  snapshot=settings.session_snapshot, owner_max_sessions=owner_sessions,
                                  owner_max_bytes=owner_bytes)
    return RedisSessionStore(str(settings.session_store), max_sessions=settings.max_sessions,
                             max_bytes=settings.session_memory_bytes, owner_max_sessions=owner_sessions,
                             owner_max_bytes=owner_bytes, cache_bytes=settings.session_cache_bytes)


class BodyLimitMiddleware(HTTPMiddleware):
    """413 for a request body over `max_bytes`, before the app parses it; 408 for one that stalls `idle_s` between
    two reads (a slow client, or a chunked body without its end: it would hold the connection forever).

    A declared Content-Length is checked up front (the server enforces it); the body is then read here up to the
    limit and handed on in one piece.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, idle_s: float = 30.0) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes
        self.idle_s = idle_s

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body = bytearray()
        while True:
            try:
                async with asyncio.timeout(self.idle_s):
                    message = await receive()
            except TimeoutError:
                error = RequestTimeoutError(f"the request body stalled for {self.idle_s:g} s; the connection is "
                                            "closed", code="request_timeout", headers={"Connection": "close"})
                await error_response(error)(scope, receive, send)
                return
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = PayloadTooLargeError(f"the request body is over this server's limit of {self.max_bytes} bytes",
                                     code="body_too_large")
        await error_response(error)(scope, receive, send)
