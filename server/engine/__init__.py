"""The engine: owns the model and runs it on a worker thread; no FastAPI here."""

from server.engine._engine import Engine, EngineUnavailable, ModelInfo

__all__ = ["Engine", "EngineUnavailable", "ModelInfo"]
