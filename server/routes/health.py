"""Liveness and readiness probes."""

from __future__ import annotations

from fastapi import APIRouter

from server.errors import ServiceUnavailableError, openapi_responses
from server.protocol import HealthResponse, ReadyResponse
from server.routes._deps import EngineDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthResponse)
async def healthz() -> HealthResponse:
    """The process is up and serving HTTP."""
    return HealthResponse()


@router.get("/readyz", response_model=ReadyResponse, responses=openapi_responses(ServiceUnavailableError))
async def readyz(engine: EngineDep) -> ReadyResponse:
    """The model is loaded and the engine thread is taking work (503 otherwise)."""
    return ReadyResponse(model=engine.info.name)
