"""GET /v1/models, in OpenAI's shape."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.errors import AuthenticationError, ServiceUnavailableError, openapi_responses
from server.protocol import ModelCard, ModelList
from server.routes._deps import EngineDep, require_api_key

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_api_key)],
                   responses=openapi_responses(AuthenticationError, ServiceUnavailableError))


@router.get("/models", response_model=ModelList)
async def list_models(engine: EngineDep) -> ModelList:
    info = engine.info
    return ModelList(data=[ModelCard(id=info.name, created=info.created, tokenizer=info.tokenizer.kind,
                                     vocab_size=info.tokenizer.vocab_size)])
