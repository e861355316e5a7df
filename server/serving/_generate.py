"""POST /v1/generate: the native generation API, whole or streamed as server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Response

from models.sampling import SamplingParams
from server.engine import Finished, GenerationStream, Token
from server.errors import UnprocessableEntityError
from server.protocol import GenerateChunk, GenerateDone, GenerateRequest, GenerateResponse, Timings, Usage
from server.serving._common import (
    Context,
    StreamTimer,
    check_limit,
    check_prompt,
    error_event,
    run_unless_disconnected,
    sse,
    sse_response,
)

__all__ = ["DEFAULT_MAX_TOKENS", "create_generation"]

DEFAULT_MAX_TOKENS = 200


async def create_generation(body: GenerateRequest, ctx: Context) -> GenerateResponse | Response:
    prompt = body.prompt.encode("utf-8")
    check_prompt(prompt, ctx.settings)
    limit = ctx.settings.max_tokens
    max_tokens = body.max_tokens if body.max_tokens is not None else min(DEFAULT_MAX_TOKENS, limit)
    check_limit(max_tokens, limit, "max_tokens")
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                            seed=body.seed, stop=tuple(body.stop))
    if body.adapt_while_generating and body.session_id is None:
        raise UnprocessableEntityError("adapt_while_generating: adapting needs a session_id",
                                       param="adapt_while_generating", code="session_required")
    if body.session_id is not None:
        ctx.engine.session_limits()  # a model without sessions (a word model) says so, rather than "not found"
        # a 404 now, rather than in the stream (off the event loop: the store may do I/O)
        await ctx.engine.read_session(body.session_id, ctx.owner, touch=False)
    stream = ctx.engine.generate(prompt, params, session_id=body.session_id, owner=ctx.owner,
                                 adapt=body.adapt_while_generating)
    if body.stream:
        return sse_response(_events(stream, ctx))
    response = await run_unless_disconnected(ctx.request, _collect(stream))
    return response if response is not None else Response(status_code=499)  # nginx's "client closed request"


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


async def _collect(stream: GenerationStream) -> GenerateResponse:
    parts: list[str] = []
    done: Finished | None = None
    async with stream:
        async for event in stream:
            if isinstance(event, Token):
                parts.append(event.text)
            elif isinstance(event, Finished):
                done = event
    assert done is not None
    return GenerateResponse(text="".join(parts), finish_reason=done.finish_reason,
                            usage=_usage(done.prompt_tokens, done.completion_tokens))


async def _events(stream: GenerationStream, ctx: Context) -> AsyncIterator[bytes]:
    timer = StreamTimer(ctx.metrics, ctx.route, stream.submitted)
    async with stream:
        try:
            async for event in stream:
                timer.observe(event)
                if isinstance(event, Token) and event.text:
                    yield sse(GenerateChunk(text=event.text))
                elif isinstance(event, Finished):
                    timings = Timings(first_token_seconds=event.first_token_seconds or 0.0,
                                      total_seconds=event.seconds)
                    yield sse(GenerateDone(finish_reason=event.finish_reason,
                                           usage=_usage(event.prompt_tokens, event.completion_tokens),
                                           timings=timings))
        except Exception as exc:
            yield sse(error_event(exc, ctx.request))

