"""Liveness and readiness probes."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.engine import Engine, RemoteEngine
from server.errors import ServiceUnavailableError, openapi_responses
from server.protocol import HealthResponse, ReadyResponse
from server.routes._deps import EngineDep, SettingsDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthResponse, responses=openapi_responses(ServiceUnavailableError))
async def healthz(request: Request) -> HealthResponse:
    """The process is up and serving HTTP, and its engine thread has not died (503 then: a liveness probe restarts
    the process; while the model loads, and while it drains, this is 200)."""
    engine = getattr(request.app.state, "engine", None)
    if isinstance(engine, (Engine, RemoteEngine)) and engine.crashed:
        raise ServiceUnavailableError("the engine thread died; restart the process", code="engine_crashed")
    return HealthResponse()


@router.get("/readyz", response_model=ReadyResponse, responses=openapi_responses(ServiceUnavailableError))
async def readyz(engine: EngineDep, settings: SettingsDep) -> ReadyResponse:
    """The model is loaded and the engine thread is taking work and making progress (503 otherwise: `engine_stalled`
    while it has had work waiting or running and made no progress for `ready_stall_s`; the balancer then sends new
    requests elsewhere, and it is ready again once the engine moves)."""
    stalled = engine.stalled_s()
    if settings.ready_stall_s > 0 and stalled > settings.ready_stall_s:
        raise ServiceUnavailableError(f"the engine has made no progress for {stalled:.0f} s with work waiting",
                                      code="engine_stalled")
    return ReadyResponse(model=engine.info.name)
