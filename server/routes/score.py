"""POST /v1/score: bits, bits per byte and optionally per-byte log-probabilities of a text, statically or under
a session (optionally adapting it)."""

from __future__ import annotations

from fastapi import Response

from server.errors import ConflictError, openapi_responses
from server.protocol import ScoreRequest, ScoreResponse
from server.routes._deps import ContextDep, work_router
from server.serving import create_score

__all__ = ["router"]

router = work_router("/v1", "scoring")


# 409 session_conflict: with `adapt`, another request (on another replica) changed the session meanwhile
@router.post("/score", response_model=ScoreResponse, responses=openapi_responses(ConflictError))
async def score(body: ScoreRequest, ctx: ContextDep) -> ScoreResponse | Response:
    return await create_score(body, ctx)
