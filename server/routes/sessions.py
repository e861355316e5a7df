"""/v1/sessions: per-session dynamic evaluation (create, read, delete, reset, observe, export, import) and
keyboard suggestions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Path, Response

from server.engine import IDEMPOTENCY_KEY
from server.errors import (
    ConflictError,
    openapi_responses,
)
from server.protocol import (
    SESSION_ID_MAX_LENGTH,
    SESSION_ID_PATTERN,
    ObserveRequest,
    ObserveResponse,
    SessionCreateRequest,
    SessionResponse,
    SuggestRequest,
    SuggestResponse,
)
from server.routes._deps import ContextDep, work_router
from server.serving import sessions

__all__ = ["router"]

router = work_router("/v1/sessions", "sessions")

# Any id the store could hold is looked up (404 if absent); a longer one is a 422 before any lookup.
SessionPath = Annotated[str, Path(min_length=1, max_length=SESSION_ID_MAX_LENGTH, description="The session's id.")]
_BLOB: dict[str, Any] = {"content": {sessions.STATE_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
                         "description": "The session's export: safetensors bytes with versioned JSON metadata, "
                                        "tagged with the checkpoint's weights hash."}


@router.post("", response_model=SessionResponse, status_code=201)
async def create_session(ctx: ContextDep, body: SessionCreateRequest | None = None) -> SessionResponse | Response:
    """A new session (optionally having observed `initial_text`); every field has a default, so the body may be left
    out (`curl -X POST .../v1/sessions`)."""
    return await sessions.create_session(body if body is not None else SessionCreateRequest(), ctx)


@router.get("/{session_id}", response_model=SessionResponse)
async def get_session(session_id: SessionPath, ctx: ContextDep) -> SessionResponse:
    """The session's settings and running statistics (bits per byte observed, static, gain)."""
    return await sessions.get_session(session_id, ctx)


@router.delete("/{session_id}", status_code=204, response_class=Response)
async def delete_session(session_id: SessionPath, ctx: ContextDep) -> Response:
    return await sessions.delete_session(session_id, ctx)


# The IETF draft's header (draft-ietf-httpapi-idempotency-key-header): a Structured Field string, so its quoted form
# is read too; most clients send the bare token.
IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key", pattern=rf'^(?:{IDEMPOTENCY_KEY}|"{IDEMPOTENCY_KEY}")$',
    description="A key of the client's (e.g. a UUID) naming this observe: the session applies it once, however "
                "often it is sent; a retry of one that was applied answers as it did (`Idempotent-Replayed: true`). "
                "1-128 of `A-Za-z0-9_.:+/=-`.")]

# 409 session_conflict: another request (on another replica) changed the session meanwhile; nothing was applied
_CONFLICT = openapi_responses(ConflictError)


@router.post("/{session_id}/reset", response_model=SessionResponse, responses=_CONFLICT)
async def reset_session(session_id: SessionPath, ctx: ContextDep) -> SessionResponse | Response:
    """Back to the start: initial state, adapter zero, statistics cleared; id, settings and TTL kept. 409
    `session_conflict` if another request changed the session meanwhile (nothing applied: send it again)."""
    return await sessions.reset_session(session_id, ctx)


@router.post("/{session_id}/observe", response_model=ObserveResponse, responses=_CONFLICT)
async def observe(session_id: SessionPath, body: ObserveRequest, ctx: ContextDep, response: Response,
                  idempotency_key: IdempotencyKey = None) -> ObserveResponse | Response:
    """The text's bits under the session, each segment scored before the session adapts on it. 409
    `session_conflict` if another request changed the session meanwhile (nothing applied: send it again). With an
    `Idempotency-Key`, it is applied once: send it again with the same key after any failure (a 503 may come after
    the session was written)."""
    return await sessions.observe(session_id, body, ctx, response, idempotency_key)


@router.post("/{session_id}/suggest", response_model=SuggestResponse)
async def suggest(session_id: SessionPath, body: SuggestRequest, ctx: ContextDep) -> SuggestResponse | Response:
    """Keyboard suggestions: the k most likely completions of the word being typed at the end of `context`, and
    the most likely next characters, under the session's adaptation; the session is not changed."""
    return await sessions.suggest(session_id, body, ctx)


@router.get("/{session_id}/state", response_class=Response, responses={200: _BLOB})
async def export_state(session_id: SessionPath, ctx: ContextDep) -> Response:
    """The session's state, adapter, settings and statistics as one binary blob (no pickle)."""
    return await sessions.export_state(session_id, ctx)


@router.put("/{session_id}/state", response_model=SessionResponse,
            responses=openapi_responses(ConflictError) | {200: {"description": "The imported session."}},
            openapi_extra={"requestBody": {"required": True, **_BLOB}})
async def import_state(session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN)],
                       ctx: ContextDep) -> SessionResponse | Response:
    """Create or replace the session from an export of this checkpoint (409 for another checkpoint's)."""
    return await sessions.import_state(session_id, ctx)
