"""POST /v1/generate: a continuation of a prompt (or of a session's stream), whole or streamed as server-sent
events."""

from __future__ import annotations

from fastapi import Response

from server.protocol import GenerateRequest, GenerateResponse
from server.routes._deps import ContextDep, event_stream_responses, work_router
from server.serving import create_generation

__all__ = ["router"]

router = work_router("/v1", "generation")

_STREAM = event_stream_responses("The whole answer; with `stream: true`, server-sent events: `GenerateChunk`s, "
                                 "then a `GenerateDone`, or an `ErrorResponse` if it fails after starting "
                                 "(see clients/adaptlm_client/protocol.py).")


@router.post("/generate", response_model=GenerateResponse, responses=_STREAM)
async def generate(body: GenerateRequest, ctx: ContextDep) -> GenerateResponse | Response:
    return await create_generation(body, ctx)

