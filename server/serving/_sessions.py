"""The /v1/sessions resource: per-session dynamic evaluation (thesis sec. 4.6) with the checkpoint's session memories
(models/memory.py: the weights a session learns, the output rows' delta or the sparse adapter M; its copy model).

A session is one text stream: each observe scores the text under the session (before adapting on each
segment), then keeps the adaptation. Sessions belong to the API key that created them; another key gets
404 for them, as for a session that does not exist, and its import onto their id creates its own session there, as
onto a free id (ids are per key: server/engine/_idspace.py).
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any

from fastapi import Response

from server.engine import (
    IdempotencyKeyReused,
    InvalidSessionSettings,
    Session,
    SessionConfig,
    SessionInfo,
    SettingsView,
    TextScore,
)
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

# The request's flat settings: shorthands for the shipped memories' (memory, setting; None: the memory on or off).
# _LEARNER: the checkpoint's weight-learning memory (`SessionLimits.learner`: M, or the output rows' delta where it
# takes M's place by default), whose rate and decay the session answer's `lr` and `decay` report (M's, where a session
# has M instead).
_LEARNER = ""
_ADAPTER = "adapter"
_SHORTHANDS: dict[str, tuple[str, str | None]] = {
    "lr": (_LEARNER, "lr"), "decay": (_LEARNER, "decay"), "adapter_size": (_ADAPTER, "size"),
    "cache_weight": ("words", "weight"), "neural_cache": ("cache", None), "copy_model": ("copy", None)}


def observed(result: TextScore) -> ObserveResponse:
    static = result.static_bits if result.static_bits is not None else float("nan")
    scored = result.bytes > 0
    return ObserveResponse(bits=result.bits, bytes=result.bytes,
                           bits_per_byte=result.bits_per_byte if scored else None, static_bits=static,
                           static_bits_per_byte=static / result.bytes if scored else None, updates=result.updates,
                           nonfinite_reset=result.nonfinite_reset, tokens=result.tokens,
                           pending_bytes=result.pending_bytes)


def session_response(session: Session | SessionInfo, ctx: Context, result: TextScore | None = None) -> SessionResponse:
    limits = ctx.engine.session_limits()
    st = session.stats
    on = session.config.to_dict()
    adapter, words = on.get(_ADAPTER, {}), on.get("words", {})
    learner = on.get(limits.learner) or adapter  # the weights the session learns: M's where it has M in their place
    return SessionResponse(
        id=session.id, model=ctx.engine.info.name, created=session.created, last_used=session.last_used,
        expires_at=session.expires_at(), ttl_s=session.ttl_s,
        adaptation=AdaptationSettings(memories=on, lr=learner.get("lr", 0.0), decay=learner.get("decay", 0.0),
                                      adapter_size=adapter.get("size", 0), rule=limits.rule, eps=limits.eps,
                                      segment=limits.segment, cache_weight=words.get("weight", 0.0),
                                      neural_cache="cache" in on, copy_model="copy" in on),
        state_bytes=session.nbytes,
        stats=SessionStatsBody(bytes_observed=st.bytes_observed, updates=st.updates,
                               nonfinite_resets=st.nonfinite_resets, bits=st.bits, bits_per_byte=st.bits_per_byte,
                               static_bits=st.static_bits, static_bits_per_byte=st.static_bits_per_byte,
                               gain_over_static=st.gain_over_static, pending_bytes=len(session.pending)),
        observed=observed(result) if result is not None else None)


async def _settings(body: SessionCreateRequest, ctx: Context) -> tuple[SessionConfig | SettingsView, float]:
    """The request's memory settings and TTL, completed and checked by the engine's session service (the
    checkpoint's defaults and limits, the server's TTLs); what it refuses is a 422 on the request's field."""
    p = body.adaptation or AdaptationParams()
    learner = ctx.engine.session_limits().learner
    asked: dict[str, dict[str, Any] | None] = {k: dict(v) if v is not None else None
                                               for k, v in (p.memories or {}).items()}
    flat: dict[tuple[str, str], str] = {}  # (memory, setting) -> the shorthand the request used
    for name, (memory, setting) in _SHORTHANDS.items():
        memory = memory or learner
        value = getattr(p, name)
        if value is None or (name == "copy_model" and value and memory not in ctx.engine.memory_names):
            continue  # copy_model: on "where the checkpoint has one"
        if setting is None:
            if not value:
                asked[memory] = None
            elif asked.get(memory) is None:
                asked[memory] = {}
        else:
            mine = asked.get(memory)
            asked[memory] = {**(mine or {}), setting: value}
        flat[(memory, setting or "")] = name
    # `lr: 0` asks for no weight learning. M, inside the network, stays on at rate 0 (it adds M h = 0), as it always
    # has; a distribution memory at rate 0 would cost its step a segment and renormalise the network's distribution
    # for nothing, so it is turned off, once its settings are checked
    idle = p.lr == 0 and learner != _ADAPTER and asked.get(learner) is not None
    try:
        settings = await ctx.engine.session_settings(asked, body.ttl_s)
        if idle:
            settings = await ctx.engine.session_settings({**asked, learner: None}, body.ttl_s)
        return settings
    except InvalidSessionSettings as e:
        if e.param == "ttl_s":
            raise _unprocessable(e, "ttl_s") from None
        memory, _, setting = (e.param or "").partition(".")
        short = flat.get((memory, setting))
        if short is None and memory in ("cache", "copy") and e.code == "unsupported":
            short = flat.get((memory, ""))
        raise _unprocessable(e, f"adaptation.{short}" if short else f"adaptation.memories.{e.param}") from None


def _unprocessable(error: InvalidSessionSettings, param: str) -> UnprocessableEntityError:
    return UnprocessableEntityError(f"{param}: {error}", param=param, code=error.code)


async def create_session(body: SessionCreateRequest, ctx: Context) -> SessionResponse | Response:
    config, ttl_s = await _settings(body, ctx)
    initial = body.initial_text.encode("utf-8") if body.initial_text is not None else None
    if initial is not None:
        check_text(initial, ctx.settings, "initial_text")
    work: Coroutine[Any, Any, tuple[Session | SessionInfo, TextScore | None]] = ctx.engine.create_session(
        owner=ctx.owner, config=config, ttl_s=ttl_s, initial_text=initial)
    created = await run_unless_disconnected(ctx.request, work)
    if created is None:
        return Response(status_code=499)
    session, result = created
    return session_response(session, ctx, result)


async def get_session(session_id: str, ctx: Context) -> SessionResponse:
    return session_response(await ctx.engine.read_session(session_id, ctx.owner), ctx)


async def delete_session(session_id: str, ctx: Context) -> Response:
    await ctx.engine.remove_session(session_id, ctx.owner)
    return Response(status_code=204)


async def reset_session(session_id: str, ctx: Context) -> SessionResponse | Response:
    reset: Coroutine[Any, Any, Session | SessionInfo] = ctx.engine.reset_session(session_id, ctx.owner)
    session = await run_unless_disconnected(ctx.request, reset)
    return session_response(session, ctx) if session is not None else Response(status_code=499)


IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # "true" on the answer of an observe whose key was applied before


async def observe(session_id: str, body: ObserveRequest, ctx: Context, response: Response,
                  idempotency_key: str | None = None) -> ObserveResponse | Response:
    data = body.text.encode("utf-8")
    check_text(data, ctx.settings, "text")
    key = idempotency_key.strip('"') if idempotency_key is not None else None  # its Structured Field form
    work = ctx.engine.observe(data, session_id=session_id, owner=ctx.owner, idempotency_key=key)
    try:
        done = await run_unless_disconnected(ctx.request, work)
    except IdempotencyKeyReused as e:
        raise UnprocessableEntityError(str(e), param=IDEMPOTENCY_HEADER, code="idempotency_key_reused") from None
    if done is None:
        return Response(status_code=499)
    result, replayed = done
    if key is not None:
        response.headers[REPLAYED_HEADER] = "true" if replayed else "false"
    return observed(result)


async def export_state(session_id: str, ctx: Context) -> Response:
    blob = await ctx.engine.export_session(session_id, ctx.owner)
    return Response(blob, media_type=STATE_MEDIA_TYPE,
                    headers={"Content-Disposition": f'attachment; filename="session-{session_id}.safetensors"'})


async def import_state(session_id: str, ctx: Context) -> SessionResponse | Response:
    blob = await ctx.request.body()
    if not blob:
        raise UnprocessableEntityError("body: send the bytes of GET /v1/sessions/{id}/state", param="body",
                                       code="missing")
    load: Coroutine[Any, Any, Session | SessionInfo] = ctx.engine.import_session(session_id, ctx.owner, blob)
    session = await run_unless_disconnected(ctx.request, load)
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
