"""POST /v1/generate: a continuation of a prompt (or of a session's stream), whole or streamed as server-sent
events."""

from __future__ import annotations

from typing import Any

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
from server.protocol import GenerateRequest, GenerateResponse
from server.routes._deps import ContextDep, require_api_key
from server.serving import create_generation

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["generation"], dependencies=[Depends(require_api_key)],
                   responses=openapi_responses(BadRequestError, AuthenticationError, NotFoundError,
                                               PayloadTooLargeError, UnprocessableEntityError, RateLimitError,
                                               ServiceUnavailableError))

# FastAPI adds the JSON body of `response_model` beside this.
_STREAM: dict[int | str, dict[str, Any]] = {200: {
    "description": "The whole answer; with `stream: true`, server-sent events: `GenerateChunk`s, then a "
                   "`GenerateDone`, or an `ErrorResponse` if it fails after starting (see server/protocol.py).",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}}


@router.post("/generate", response_model=GenerateResponse, responses=_STREAM)
async def generate(body: GenerateRequest, ctx: ContextDep) -> GenerateResponse | Response:
    return await create_generation(body, ctx)

