"""POST /v1/score: a text's bits, statically or under a session (with or without adapting it)."""

from __future__ import annotations

from fastapi import Response

from server.errors import UnprocessableEntityError
from server.protocol import ScoreRequest, ScoreResponse
from server.serving._common import Context, check_text, run_unless_disconnected

__all__ = ["create_score"]


async def create_score(body: ScoreRequest, ctx: Context) -> ScoreResponse | Response:
    data = body.text.encode("utf-8")
    check_text(data, ctx.settings, "text")
    if body.adapt and body.session_id is None:
        raise UnprocessableEntityError("adapt: adapting needs a session_id", param="adapt", code="session_required")
    work = ctx.engine.score(data, logprobs=body.logprobs, session_id=body.session_id, owner=ctx.owner,
                            adapt=body.adapt)
    result = await run_unless_disconnected(ctx.request, work)
    if result is None:
        return Response(status_code=499)  # nginx's "client closed request"
    ctx.metrics.scored_bytes.labels(ctx.metrics.model).inc(result.bytes)
    info = ctx.engine.info
    # nothing scored (a word session's adapt that only grew its pending word): no rate, as an observe answers
    per_byte = result.bits_per_byte if result.bytes else None
    if not info.tokenizer.reports_tokens:
        return ScoreResponse(model=info.name, bits=result.bits, bytes=result.bytes, bits_per_byte=per_byte,
                             logprobs=result.logprobs, session_id=body.session_id,
                             nonfinite_reset=result.nonfinite_reset)
    # a word model: per word too (docs/algorithms.md §13), as `adaptlm score --json` reports it
    words = result.word_figures()
    return ScoreResponse(model=info.name, bits=result.bits, bytes=result.bytes, bits_per_byte=per_byte,
                         logprobs=result.logprobs, session_id=body.session_id, nonfinite_reset=result.nonfinite_reset,
                         tokens=words.tokens, token_texts=result.token_texts, bits_per_word=words.bits_per_word,
                         perplexity=words.perplexity)
