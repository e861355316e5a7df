"""The session record is the model layer's (`models.session.Session`: one adapted text stream with its memories);
the engine adds its ids."""

from __future__ import annotations

import secrets

from models.memory import SessionConfig
from models.session import PENDING_MAX_BYTES, Session, SessionStats

__all__ = ["PENDING_MAX_BYTES", "Session", "SessionConfig", "SessionStats", "new_session_id"]


def new_session_id() -> str:
    """192 random bits, URL-safe (32 characters), never starting with "-" (a command line would read such an id
    as an option)."""
    while (session_id := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return session_id
