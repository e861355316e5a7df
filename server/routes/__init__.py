"""One router per resource; `ROUTERS` is what the app includes."""

from fastapi import APIRouter

from server.routes import health, metrics, models, score

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (health.router, models.router, score.router, metrics.router)
