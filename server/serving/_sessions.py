"""The /v1/sessions resource: per-session dynamic evaluation with sparse adapters (thesis sec. 4.6).

A session is one text stream: each observe scores the text under the session (before adapting on each
segment), then keeps the adaptation. Sessions belong to the API key that created them; another key gets
404 for them, as for a session that does not exist.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Response

from server.engine import AdaptationConfig, InvalidSessionSettings, Session, TextScore
from server.errors import UnprocessableEntityError
from server.protocol import (
    AdaptationParams,
    AdaptationSettings,
    ObserveRequest,
    ObserveResponse,
    SessionCreateRequest,
    SessionResponse,
    SessionStatsBody,
    SuggestedChar,
    SuggestedWord,
    SuggestRequest,
    SuggestResponse,
)
from server.serving._common import Context, check_text, run_unless_disconnected

__all__ = ["create_session", "delete_session", "export_state", "get_session", "import_state", "observe",
           "reset_session", "suggest"]

STATE_MEDIA_TYPE = "application/octet-stream"


def observed(result: TextScore) -> ObserveResponse:
    static = result.static_bits if result.static_bits is not None else float("nan")
    scored = result.bytes > 0
    return ObserveResponse(bits=result.bits, bytes=result.bytes,
                           bits_per_byte=result.bits_per_byte if scored else None, static_bits=static,
                           static_bits_per_byte=static / result.bytes if scored else None, updates=result.updates,
                           nonfinite_reset=result.nonfinite_reset, tokens=result.tokens,
                           pending_bytes=result.pending_bytes)


def session_response(session: Session, ctx: Context, result: TextScore | None = None) -> SessionResponse:
    limits = ctx.engine.session_limits()
    st = session.stats
    return SessionResponse(
        id=session.id, model=ctx.engine.info.name, created=session.created, last_used=session.last_used,
        expires_at=session.expires_at(), ttl_s=session.ttl_s,
        adaptation=AdaptationSettings(lr=session.config.lr, decay=session.config.decay,
                                      adapter_size=session.config.adapter_size, rule=limits.rule, eps=limits.eps,
                                      segment=limits.segment, cache_weight=session.config.cache_weight,
                                      neural_cache=session.config.neural_cache, copy_model=session.copy is not None),
        state_bytes=session.nbytes,
        stats=SessionStatsBody(bytes_observed=st.bytes_observed, updates=st.updates,
                               nonfinite_resets=st.nonfinite_resets, bits=st.bits, bits_per_byte=st.bits_per_byte,
                               static_bits=st.static_bits, static_bits_per_byte=st.static_bits_per_byte,
                               gain_over_static=st.gain_over_static, pending_bytes=len(session.pending)),
        observed=observed(result) if result is not None else None)


def _settings(body: SessionCreateRequest, ctx: Context) -> tuple[AdaptationConfig, float]:
    """The request's adaptation settings and TTL, completed and checked by the engine's session service (the
    checkpoint's defaults and limits, the server's TTLs); what it refuses is a 422 on the request's field."""
    p = body.adaptation or AdaptationParams()
    try:
        config = ctx.engine.sessions.config(lr=p.lr, decay=p.decay, adapter_size=p.adapter_size,
                                            cache_weight=p.cache_weight, neural_cache=p.neural_cache,
                                            copy_model=p.copy_model)
    except InvalidSessionSettings as e:
        raise _unprocessable(e, f"adaptation.{e.param}") from None
    try:
        return config, ctx.engine.sessions.ttl(body.ttl_s)
    except InvalidSessionSettings as e:
        raise _unprocessable(e, "ttl_s") from None


def _unprocessable(error: InvalidSessionSettings, param: str) -> UnprocessableEntityError:
    return UnprocessableEntityError(f"{param}: {error}", param=param, code=error.code)


async def create_session(body: SessionCreateRequest, ctx: Context) -> SessionResponse | Response:
    config, ttl_s = _settings(body, ctx)
    initial = body.initial_text.encode("utf-8") if body.initial_text is not None else None
    if initial is not None:
        check_text(initial, ctx.settings, "initial_text")
    work = ctx.engine.create_session(owner=ctx.owner, config=config, ttl_s=ttl_s, initial_text=initial)
    created = await run_unless_disconnected(ctx.request, work)
    if created is None:
        return Response(status_code=499)
    session, result = created
    return session_response(session, ctx, result)


# Reads and deletes go to the store directly, off the event loop: the store may do I/O (Redis).


async def get_session(session_id: str, ctx: Context) -> SessionResponse:
    return session_response(await asyncio.to_thread(ctx.engine.get_session, session_id, ctx.owner), ctx)


async def delete_session(session_id: str, ctx: Context) -> Response:
    await asyncio.to_thread(ctx.engine.delete_session, session_id, ctx.owner)
    return Response(status_code=204)


async def reset_session(session_id: str, ctx: Context) -> SessionResponse | Response:
    session = await run_unless_disconnected(ctx.request, ctx.engine.reset_session(session_id, ctx.owner))
    return session_response(session, ctx) if session is not None else Response(status_code=499)


async def observe(session_id: str, body: ObserveRequest, ctx: Context) -> ObserveResponse | Response:
    data = body.text.encode("utf-8")
    check_text(data, ctx.settings, "text")
    work = ctx.engine.score(data, session_id=session_id, owner=ctx.owner, adapt=True)
    result = await run_unless_disconnected(ctx.request, work)
    return observed(result) if result is not None else Response(status_code=499)


async def export_state(session_id: str, ctx: Context) -> Response:
    blob = await ctx.engine.export_session(session_id, ctx.owner)
    return Response(blob, media_type=STATE_MEDIA_TYPE,
                    headers={"Content-Disposition": f'attachment; filename="session-{session_id}.safetensors"'})


async def import_state(session_id: str, ctx: Context) -> SessionResponse | Response:
    blob = await ctx.request.body()
    if not blob:
        raise UnprocessableEntityError("body: send the bytes of GET /v1/sessions/{id}/state", param="body",
                                       code="missing")
    session = await run_unless_disconnected(ctx.request, ctx.engine.import_session(session_id, ctx.owner, blob))
    return session_response(session, ctx) if session is not None else Response(status_code=499)


async def suggest(session_id: str, body: SuggestRequest, ctx: Context) -> SuggestResponse | Response:
    check_text(body.context.encode("utf-8"), ctx.settings, "context")
    start = time.perf_counter()
    work = ctx.engine.suggest(session_id, ctx.owner, body.context, k=body.k, max_chars=body.max_chars,
                              n_chars=body.n_chars)
    result = await run_unless_disconnected(ctx.request, work)
    if result is None:
        return Response(status_code=499)
    ctx.metrics.suggest_latency.labels(ctx.metrics.model).observe(time.perf_counter() - start)
    ctx.metrics.suggest_expansions.labels(ctx.metrics.model).observe(result.expansions)
    return SuggestResponse(prefix=result.prefix,
                           completions=[SuggestedWord(text=c.text, prob=c.prob, space_before=c.space_before)
                                        for c in result.completions],
                           next_chars=[SuggestedChar(char=c.char, prob=c.prob) for c in result.next_chars],
                           exact=result.exact)
