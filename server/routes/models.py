"""GET /v1/models and GET /v1/models/{model}, in OpenAI's shape (the `openai` client's `models.list` and
`models.retrieve`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from server.engine import AnyEngine
from server.errors import AuthenticationError, NotFoundError, ServiceUnavailableError, openapi_responses
from server.protocol import ModelCard, ModelList
from server.routes._deps import EngineDep, require_api_key

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_api_key)],
                   responses=openapi_responses(AuthenticationError, ServiceUnavailableError))


def _card(engine: AnyEngine) -> ModelCard:
    info = engine.info
    return ModelCard(id=info.name, created=info.created, tokenizer=info.tokenizer.kind,
                     vocab_size=info.tokenizer.vocab_size)


@router.get("/models", response_model=ModelList)
async def list_models(engine: EngineDep) -> ModelList:
    return ModelList(data=[_card(engine)])


# no 422 (nor OpenAI's 400, errors.OPENAI_ROUTES): a path's `model` is always a valid string, and it takes nothing else
@router.get("/models/{model}", response_model=ModelCard, responses=openapi_responses(NotFoundError))
async def retrieve_model(model: str, engine: EngineDep) -> ModelCard:
    card = _card(engine)
    if model != card.id:
        raise NotFoundError("no such model here; GET /v1/models lists the served one", param="model",
                            code="model_not_found")
    return card
