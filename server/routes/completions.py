"""POST /v1/completions: OpenAI's legacy completions API (the official clients work against it)."""

from __future__ import annotations

from fastapi import Response

from server.protocol import CompletionRequest, CompletionResponse
from server.routes._deps import ContextDep, event_stream_responses, work_router
from server.serving import create_completion

__all__ = ["router"]

router = work_router("/v1", "openai", openai=True)  # request errors are OpenAI's 400 (errors.OPENAI_ROUTES)

_STREAM = event_stream_responses("The completion; with `stream: true`, server-sent events: `CompletionResponse` "
                                 "chunks, then `data: [DONE]` (see clients/adaptlm_client/protocol.py).")


@router.post("/completions", response_model=CompletionResponse, responses=_STREAM)
async def completions(body: CompletionRequest, ctx: ContextDep) -> CompletionResponse | Response:
    return await create_completion(body, ctx)
