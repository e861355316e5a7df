"""The FastAPI app: `create_app(settings)`; its lifespan loads the model into the engine and stops it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine import Engine, EngineConfig, MemorySessionStore, RedisSessionStore, SessionStore
from server.errors import PayloadTooLargeError, UnexpectedErrorMiddleware, error_response, install_error_handler
from server.metrics import Metrics, MetricsMiddleware
from server.routes import ROUTERS
from server.settings import Settings

__all__ = ["create_app", "uvicorn_options"]


def _version() -> str:
    try:
        return version("adaptlm")
    except PackageNotFoundError:
        return "0.0.0"


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What a uvicorn serving this app is given besides the app, host, port and logging."""
    return {"timeout_keep_alive": settings.keep_alive_s}


def create_app(settings: Settings) -> FastAPI:
    """The app for `settings`. Nothing is loaded until its lifespan starts (uvicorn, or TestClient as a
    context manager); a bad checkpoint then fails the start-up with CheckpointError."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = EngineConfig(max_batch=settings.max_batch, max_wait_ms=settings.max_wait_ms,
                              max_queue=settings.max_queue, retry_after_s=settings.retry_after_s,
                              session_ttl_s=settings.session_ttl_s, max_session_ttl_s=settings.max_session_ttl_s,
                              suggest_budget_ms=settings.suggest_budget_ms, precision=settings.precision,
                              device=settings.device)
        store = _session_store(settings)
        engine = Engine(settings.checkpoint, config=config, store=store)
        # start() and stop() block (loading, joining the worker): keep them off the event loop.
        await asyncio.to_thread(engine.start)
        metrics.model = engine.info.name
        metrics.kernel = engine.info.kernel
        metrics.precision = engine.info.precision
        metrics.engine_stats = lambda: engine.stats
        app.state.engine = engine
        try:
            yield
        finally:
            # The engine finishes its queued and running work, writing every session back to the store. With
            # Redis that is all there is to keep (each change was written when it was made); the memory store
            # writes its snapshot file when it closes (ADAPTLM_SESSION_SNAPSHOT; without one its sessions end
            # with the process).
            await asyncio.to_thread(engine.stop)
            await asyncio.to_thread(store.close)

    app = FastAPI(title="adaptlm", version=_version(), lifespan=lifespan,
                  description="Scoring and generation with adaptive byte-level language models.")
    app.state.settings = settings
    app.state.metrics = metrics
    install_error_handler(app)
    for router in ROUTERS:
        app.include_router(router)
    # The last added middleware is the outermost: metrics also see refused bodies and 500s.
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def _session_store(settings: Settings) -> SessionStore:
    if settings.session_store == "memory":
        return MemorySessionStore(max_sessions=settings.max_sessions, max_bytes=settings.session_memory_bytes,
                                  snapshot=settings.session_snapshot)
    return RedisSessionStore(str(settings.session_store), max_sessions=settings.max_sessions,
                             max_bytes=settings.session_memory_bytes)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before the app parses it.

    A declared Content-Length is checked up front (the server enforces it); a body without one
    (chunked) is read here up to the limit and handed on in one piece.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
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
