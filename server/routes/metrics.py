"""GET /metrics: the app's Prometheus registry in the text exposition format."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from server.metrics import CONTENT_TYPE
from server.routes._deps import MetricsDep

__all__ = ["router"]

router = APIRouter(tags=["monitoring"])


@router.get("/metrics", response_class=Response)
async def metrics(registry: MetricsDep) -> Response:
    if registry.refresh_engine_stats is not None:
        await registry.refresh_engine_stats()
    # off the event loop: the engine's statistics include the session store's, which may be a Redis round trip
    return Response(await asyncio.to_thread(registry.render), media_type=CONTENT_TYPE)
