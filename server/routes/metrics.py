"""GET /metrics: the app's Prometheus registry in the text exposition format."""

from __future__ import annotations

from fastapi import APIRouter, Response

from server.metrics import CONTENT_TYPE
from server.routes._deps import MetricsDep

__all__ = ["router"]

router = APIRouter(tags=["monitoring"])


@router.get("/metrics", response_class=Response)
async def metrics(registry: MetricsDep) -> Response:
    return Response(registry.render(), media_type=CONTENT_TYPE)
