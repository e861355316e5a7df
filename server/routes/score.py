"""POST /v1/score: bits, bits per byte and optionally per-byte log-probabilities of a text, statically or under
a session (optionally adapting it)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

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
from server.protocol import ScoreRequest, ScoreResponse
from server.routes._deps import ContextDep, require_api_key
from server.serving import create_score

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["scoring"], dependencies=[Depends(require_api_key)],
                   responses=openapi_responses(BadRequestError, AuthenticationError, NotFoundError,
                                               PayloadTooLargeError, UnprocessableEntityError, RateLimitError,
                                               ServiceUnavailableError))


@router.post("/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, ctx: ContextDep) -> ScoreResponse | Response:
    return await create_score(body, ctx)
