"""POST /v1/score: bits, bits per byte and optionally per-byte log-probabilities of a text."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.errors import (
    AuthenticationError,
    BadRequestError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    UnprocessableEntityError,
    openapi_responses,
)
from server.protocol import ScoreRequest, ScoreResponse
from server.routes._deps import EngineDep, MetricsDep, SettingsDep, require_api_key

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["scoring"], dependencies=[Depends(require_api_key)],
                   responses=openapi_responses(BadRequestError, AuthenticationError, PayloadTooLargeError,
                                               UnprocessableEntityError, ServiceUnavailableError))


@router.post("/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, engine: EngineDep, settings: SettingsDep, metrics: MetricsDep) -> ScoreResponse:
    data = body.text.encode("utf-8")
    if len(data) > settings.max_text_bytes:
        raise PayloadTooLargeError(f"text is {len(data)} bytes; this server scores at most {settings.max_text_bytes}",
                                   param="text", code="text_too_long")
    result = await engine.score(data, logprobs=body.logprobs)
    metrics.scored_bytes.labels(metrics.model).inc(result.bytes)
    return ScoreResponse(model=engine.info.name, bits=result.bits, bytes=result.bytes,
                         bits_per_byte=result.bits_per_byte, logprobs=result.logprobs)
