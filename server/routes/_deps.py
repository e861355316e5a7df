"""Dependencies shared by the routers: typed access to what the app's lifespan built, and the API-key check."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server.engine import AnyEngine, Engine, RemoteEngine
from server.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
    openapi_responses,
)
from server.metrics import Metrics
from server.ratelimit import RateLimiter
from server.serving import Context
from server.settings import Settings

# The dependencies are coroutines, though they do no I/O: FastAPI runs a plain function's dependency on its thread
# pool, a thread hop per dependency and request (about an eighth of the event loop's time a request, profiled under a
# burst of scores).
__all__ = [
    "event_stream_responses", "work_router",
    "ContextDep", "EngineDep", "MetricsDep", "OwnerDep", "SettingsDep", "api_key_owner", "get_context", "get_engine",
    "get_metrics", "get_settings", "require_api_key",
]


async def get_settings(request: Request) -> Settings:
    settings = request.app.state.settings
    assert isinstance(settings, Settings)
    return settings


async def get_metrics(request: Request) -> Metrics:
    metrics = request.app.state.metrics
    assert isinstance(metrics, Metrics)
    return metrics


async def get_engine(request: Request) -> AnyEngine:
    """The running engine, or 503 (not loaded yet, stopped, or its thread died)."""
    engine = getattr(request.app.state, "engine", None)
    if not isinstance(engine, (Engine, RemoteEngine)) or not engine.alive:
        raise ServiceUnavailableError("the model is not loaded", code="engine_unavailable")
    return engine


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
EngineDep = Annotated[AnyEngine, Depends(get_engine)]

_bearer = HTTPBearer(auto_error=False, description="One of the server's API keys (ADAPTLM_API_KEYS).")


async def api_key_owner(request: Request, settings: SettingsDep,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str | None:
    """No-op unless keys are configured; then `Authorization: Bearer <key>` must carry one of them. Then the key's
    rate limit (server/ratelimit.py): 429 when its bucket is empty.
    -> who owns the sessions this request creates and may see: the key's SHA-256 (None without keys)."""
    owner = _authenticate(settings, credentials)
    limiter = request.app.state.rate_limiter
    assert isinstance(limiter, RateLimiter)
    engine = getattr(request.app.state, "engine", None)
    if limiter.enabled and isinstance(engine, RemoteEngine):  # an HTTP worker: the buckets are the server's
        wait = await engine.take_rate(owner or "")
    else:
        wait = limiter.take(owner or "")
    if wait is not None:
        raise RateLimitError("this API key's rate limit is reached; retry after the Retry-After header's seconds",
                             code="rate_limited", headers={"Retry-After": RateLimiter.retry_after(wait)})
    return owner


def _authenticate(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> str | None:
    if not settings.api_keys:
        return None
    if credentials is None:
        raise AuthenticationError("missing API key: send `Authorization: Bearer <key>`", code="missing_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
    given = hashlib.sha256(credentials.credentials.encode()).digest()
    # Compare with every key (no early exit), in constant time per key: SHA-256 digests, so that even the keys'
    # lengths take no part in the time a wrong key takes.
    matches = [hmac.compare_digest(given, hashlib.sha256(key.get_secret_value().encode()).digest())
               for key in settings.api_keys]
    if not any(matches):
        raise AuthenticationError("invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return given.hex()


OwnerDep = Annotated[str | None, Depends(api_key_owner)]


async def get_context(request: Request, engine: EngineDep, settings: SettingsDep, metrics: MetricsDep,
                owner: OwnerDep) -> Context:
    """What the serving layer needs; `route` (a metric label) is the route's path template."""
    route = getattr(request.scope.get("route"), "path", request.url.path)
    return Context(engine=engine, settings=settings, metrics=metrics, request=request, route=str(route), owner=owner)


ContextDep = Annotated[Context, Depends(get_context)]


async def require_api_key(owner: OwnerDep) -> None:
    """A router dependency: the request carries a valid key (when keys are configured)."""


def work_router(prefix: str, tag: str, *, openai: bool = False) -> APIRouter:
    """A router of /v1 routes that do model work: API key required, their common error answers documented.
    `openai`: its routes are in errors.OPENAI_ROUTES, which answer 400 where the others answer 422 (and their only
    413 is a body over ADAPTLM_MAX_BODY_BYTES, refused before routing)."""
    errors = (BadRequestError, AuthenticationError, NotFoundError, PayloadTooLargeError,
              *(() if openai else (UnprocessableEntityError,)), RateLimitError, ServiceUnavailableError)
    return APIRouter(prefix=prefix, tags=[tag], dependencies=[Depends(require_api_key)],
                     responses=openapi_responses(*errors))


# One server-sent event, as a client's parser reads it (OpenAPI 3.2 describes an event stream by its events): `data`
# is the JSON object of the route's stream (adaptlm_client.protocol), or OpenAI's "[DONE]" at the end of a completion's.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}},
}


def event_stream_responses(description: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entry of a route that answers JSON or, with `stream: true`, server-sent events (FastAPI adds the
    JSON body of `response_model` beside it)."""
    return {200: {"description": description, "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}}}
