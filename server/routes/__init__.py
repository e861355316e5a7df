"""One router per resource; `ROUTERS` is what the app includes."""

from fastapi import APIRouter

from server.routes import completions, generate, health, keyboard, metrics, models, score, sessions

__all__ = ["ROUTERS"]

ROUTERS: tuple[APIRouter, ...] = (health.router, models.router, score.router, sessions.router, generate.router,
                                  completions.router, metrics.router, keyboard.router)
