"""The engine: owns the model and runs it on a worker thread; no FastAPI here."""

from server.engine._engine import Engine, EngineUnavailable, ModelInfo
from server.engine._generation import EngineStats, Event, Finished, GenerationStream, PromptScored, Token, TokenLogprob

__all__ = [
    "Engine", "EngineStats", "EngineUnavailable", "Event", "Finished", "GenerationStream", "ModelInfo", "PromptScored",
    "Token", "TokenLogprob",
]
