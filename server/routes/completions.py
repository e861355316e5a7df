"""POST /v1/completions: OpenAI's legacy completions API (the official clients work against it)."""

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
from server.protocol import CompletionRequest, CompletionResponse
from server.routes._deps import ContextDep, require_api_key
from server.serving import create_completion

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)],
                   responses=openapi_responses(BadRequestError, AuthenticationError, NotFoundError,
                                               PayloadTooLargeError, UnprocessableEntityError, RateLimitError,
                                               ServiceUnavailableError))

# FastAPI adds the JSON body of `response_model` beside this.
_STREAM: dict[int | str, dict[str, Any]] = {200: {
    "description": "The completion; with `stream: true`, server-sent events: `CompletionResponse` chunks, then "
                   "`data: [DONE]` (see server/protocol.py).",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}}


@router.post("/completions", response_model=CompletionResponse, responses=_STREAM)
async def completions(body: CompletionRequest, ctx: ContextDep) -> CompletionResponse | Response:
    return await create_completion(body, ctx)
