"""The engine: owns the model and runs it on a worker thread, batching work across requests and sessions;
no FastAPI here."""

from server.engine._engine import Engine, EngineConfig, ModelInfo, SessionLimits, TextScore, new_session_id
from server.engine._errors import (
    EngineBudgetExceeded,
    EngineOverloaded,
    EngineUnavailable,
    IdempotencyKeyReused,
    InvalidSessionSettings,
    SessionConflict,
    SessionImportError,
    SessionNotFound,
    SessionStoreFull,
    SessionStoreUnavailable,
    SessionsUnavailable,
)
from server.engine._export import export_session, import_session
from server.engine._generation import Event, Finished, GenerationStream, PromptScored, Token, TokenLogprob
from server.engine._memory_store import MemorySessionStore
from server.engine._redis import RedisSessionStore
from server.engine._remote import EngineHost, RemoteEngine, RemoteStream, SessionInfo
from server.engine._session import IDEMPOTENCY_KEY, Session, SessionConfig, SessionStats, SettingsView
from server.engine._stats import EngineStats
from server.engine._store import SessionStore, StoreStats
from server.engine._suggest import Suggestions
from server.engine._work import Budget

__all__ = [
    "AnyEngine", "Budget", "Engine", "EngineBudgetExceeded", "EngineConfig", "EngineHost", "EngineOverloaded",
    "EngineStats", "EngineUnavailable", "Event", "Finished", "GenerationStream", "IDEMPOTENCY_KEY",
    "IdempotencyKeyReused", "InvalidSessionSettings", "MemorySessionStore", "ModelInfo", "PromptScored",
    "RedisSessionStore", "RemoteEngine", "RemoteStream", "Session", "SessionConfig", "SessionConflict",
    "SessionImportError", "SessionInfo", "SessionLimits", "SessionNotFound", "SessionStats", "SessionStore",
    "SessionStoreFull", "SessionStoreUnavailable", "SessionsUnavailable", "SettingsView", "StoreStats", "Suggestions",
    "TextScore", "Token", "TokenLogprob", "export_session", "import_session", "new_session_id",
]

# What the HTTP layer serves with: the engine in this process, or in its own (`RemoteEngine`, the same async API)
AnyEngine = Engine | RemoteEngine
