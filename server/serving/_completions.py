"""POST /v1/completions in OpenAI's shape (vLLM's split: the wire models are in protocol.py, the route in
routes/completions.py, and the request-to-engine-to-response work here).

A token is the model's (GET /v1/models `tokenizer`): a byte, or a word model's word (its text from the tokenizer,
its leading space included); `max_tokens` and the usage count them. Log-probabilities are under the model's raw
distribution (temperature 1, no top-p), as scoring gives them. A generated token's logprobs entry goes out with the
chunk whose text contains its first character, so that streamed and whole answers agree; tokens of a stop string
are left out like its text. A word model holds back the prompt's end that the first tokens continue (token healing,
`Stepper.prefill`): such a token's entry shows what it adds past the prompt, its logprob under the distribution
restricted to the tokens allowed there; echo lists the prompt's tokens as written. With a seed, choice i of the
response samples from seed + i (each choice its own stream, whichever prompt it is of).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field, replace

from fastapi import Response

from models.sampling import SamplingParams, TextDecoder
from models.tokenizer import Tokenizer
from server.engine import Event, Finished, GenerationStream, PromptScored, SessionNotFound, Token, TokenLogprob
from server.errors import NotFoundError, UnprocessableEntityError
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
    Usage,
)
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

__all__ = ["create_completion"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's


async def create_completion(body: CompletionRequest, ctx: Context) -> CompletionResponse | Response:
    info = ctx.engine.info
    if body.model != info.name:
        raise NotFoundError("no such model here; GET /v1/models lists the served one", param="model",
                            code="model_not_found")
    prompts = [text.encode("utf-8") for text in body.prompt]
    for prompt in prompts:
        check_prompt(prompt, ctx.settings)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    check_limit(max_tokens, ctx.settings.max_tokens, "max_tokens")
    n = body.n or 1
    check_limit(n, ctx.settings.max_n, "n")
    if len(prompts) * n > ctx.settings.max_n:
        raise UnprocessableEntityError(f"prompt: {len(prompts)} prompts x n={n} make {len(prompts) * n} choices; this "
                                       f"server makes at most {ctx.settings.max_n} a request", param="prompt",
                                       code="too_many_choices")
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0:  # the nucleus shrunk to the most likely token (models.sampling takes top_p in (0, 1])
        temperature, top_p = 0.0, 1.0
    params = None  # max_tokens 0: only the prompt (with echo and logprobs: scoring)
    if max_tokens:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed,
                                stop=tuple(body.stop or ()))
    echo = bool(body.echo)
    session_id = await _session_named(body.user, ctx)
    # One generation a prompt, all submitted now so that the engine batches them; if one is refused (a full
    # queue), those already submitted are cancelled. They share the request's engine-time budget.
    streams: list[GenerationStream] = []
    budget = ctx.engine.budget()
    try:
        for p, prompt in enumerate(prompts):
            # choice i of the response (prompt p's choice j: i = p * n + j) samples from seed + i, the engine
            # adding j: each prompt's choices their own streams, not the same draws as the first prompt's
            seeded = params if params is None or params.seed is None else replace(params, seed=params.seed + p * n)
            streams.append(ctx.engine.generate(prompt, seeded, n=n, logprobs=body.logprobs,
                                               prompt_logprobs=echo and body.logprobs is not None,
                                               session_id=session_id, owner=ctx.owner, budget=budget))
    except BaseException:
        for submitted in streams:
            submitted.cancel()
        raise
    job = _Job(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=info.name, prompts=list(body.prompt),
               tokenizer=info.tokenizer, n=n, echo=echo, logprobs=body.logprobs is not None)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chunks(streams, job, include_usage, ctx))
    response = await run_unless_disconnected(ctx.request, _complete(streams, job))
    return response if response is not None else Response(status_code=499)  # nginx's "client closed request"


async def _session_named(user: str | None, ctx: Context) -> str | None:
    """`user` when it is the id of one of the caller's sessions; None for any other value (OpenAI's end-user
    identifier), including another key's session, whose existence is not revealed."""
    if not user or ctx.engine.info.sessions is None:
        return None
    try:
        await ctx.engine.read_session(user, ctx.owner, touch=False)
    except SessionNotFound:
        return None
    return user


def _show(tokenizer: Tokenizer, token: int, held: bytes = b"") -> str:
    """A token's text: a byte decoded alone (U+FFFD when it is part of a character), a word with its space; a token
    that continues the prompt's held-back text `held` (token healing), what it adds past it ("ng" of " thing" after
    "a thi"; "" for one that covers a start of it)."""
    return tokenizer.token_bytes(token)[len(held):].decode("utf-8", errors="replace")


def _top(tokenizer: Tokenizer, logprob: TokenLogprob, token: int, held: bytes = b"") -> dict[str, float]:
    """The top alternatives and the chosen token (as OpenAI: up to logprobs + 1 entries). Bytes that show as the
    same string (U+FFFD) keep the most likely one's value."""
    top: dict[str, float] = {}
    for t, lp in (*logprob.top, (token, logprob.logprob)):
        top.setdefault(_show(tokenizer, t, held), lp)
    return top


def _block(tokenizer: Tokenizer, tokens: list[Token], base: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for t in tokens:
        assert t.logprob is not None
        out.tokens.append(_show(tokenizer, t.token, t.held))
        out.token_logprobs.append(t.logprob.logprob)
        out.top_logprobs.append(_top(tokenizer, t.logprob, t.token, t.held))
        out.text_offset.append(base + t.offset)
    return out


def _prompt_block(tokenizer: Tokenizer, prompt: bytes, scored: PromptScored) -> CompletionLogprobs:
    """The prompt's entries; the first token's logprob is null, as OpenAI has it (it has no context). A word
    session's pending text (`scored.prefix`) is scored with the prompt: its tokens come first, at offset 0, and the
    offsets of the others are into the prompt as sent."""
    out = CompletionLogprobs()
    decoder = TextDecoder()
    before = len(scored.prefix.decode("utf-8", errors="replace"))  # characters of the pending text
    # a word the vocabulary lacks keeps its own text: the offsets that follow are into the prompt as sent, not into
    # "<unk>"
    pieces = tokenizer.pieces(scored.prefix + prompt)
    for i, (token, piece, lp) in enumerate(zip(scored.tokens, pieces, scored.logprobs, strict=True)):
        out.tokens.append(_show(tokenizer, token))
        out.token_logprobs.append(lp.logprob if i else None)
        out.top_logprobs.append(_top(tokenizer, lp, token) if i else None)
        out.text_offset.append(max(0, decoder.chars - before))
        decoder.push(piece)
    return out


def _concat(blocks: list[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for b in blocks:
        out.tokens += b.tokens
        out.token_logprobs += b.token_logprobs
        out.top_logprobs += b.top_logprobs
        out.text_offset += b.text_offset
    return out


@dataclass
class _Job:
    """One request: `n` choices of each prompt, numbered as OpenAI does, prompt by prompt (prompt p's choice j is
    choice p * n + j)."""

    id: str
    created: int
    model: str
    prompts: list[str]
    tokenizer: Tokenizer
    n: int
    echo: bool
    logprobs: bool

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def choices(self) -> list[_Choice]:
        return [_Choice(p * self.n + j, self.tokenizer, len(text) if self.echo else 0, self.logprobs)
                for p, text in enumerate(self.prompts) for j in range(self.n)]

    def usage(self, choices: list[_Choice]) -> Usage:
        """Each prompt's tokens (counted by the engine, once however many its choices) and those of every choice."""
        prompt_tokens = 0
        for p in range(len(self.prompts)):
            finished = [c.finished for c in choices[p * self.n : (p + 1) * self.n] if c.finished is not None]
            prompt_tokens += finished[0].prompt_tokens if finished else 0
        completion_tokens = sum(c.finished.completion_tokens for c in choices if c.finished is not None)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


@dataclass
class _Choice:
    """One choice's text and logprobs as its events arrive; a token's entry is released with its first character."""

    index: int
    tokenizer: Tokenizer
    base: int  # text_offset of the first generated character (the prompt's length with echo)
    logprobs: bool
    text: list[str] = field(default_factory=list)
    chars: int = 0  # generated characters released so far
    waiting: list[Token] = field(default_factory=list)  # tokens whose entry waits for their first character
    released: list[CompletionLogprobs] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, token: Token) -> tuple[str, CompletionLogprobs | None]:
        self.text.append(token.text)
        self.chars += len(token.text)
        if not self.logprobs:
            return token.text, None
        self.waiting.append(token)
        ready = [t for t in self.waiting if t.offset < self.chars]
        self.waiting = self.waiting[len(ready):]
        block = _block(self.tokenizer, ready, self.base) if ready else None
        if block is not None:
            self.released.append(block)
        return token.text, block

    def finish(self, event: Finished) -> CompletionLogprobs | None:
        """The choice is complete; -> the entries released with it. At a length finish all the text is out (the
        decoder's last push is final): tokens still waiting added none (a token that covers only a start of the
        prompt's held-back text) and are released now, at the end of the text. At a stop they are the stop
        string's, whose text never went out either."""
        self.finished = event
        waiting, self.waiting = self.waiting, []
        if not self.logprobs or event.finish_reason != "length" or not waiting:
            return None
        block = _block(self.tokenizer, waiting, self.base)
        self.released.append(block)
        return block

    @property
    def finish_reason(self) -> FinishReason:
        assert self.finished is not None
        return self.finished.finish_reason


async def _complete(streams: list[GenerationStream], job: _Job) -> CompletionResponse:
    choices = job.choices()
    prompt_blocks: list[CompletionLogprobs | None] = [
        CompletionLogprobs() if job.echo and job.logprobs else None for _ in job.prompts]
    async with aclosing(_interleaved(streams)) as events:
        async for p, event in events:
            if isinstance(event, PromptScored):
                prompt_blocks[p] = _prompt_block(job.tokenizer, job.prompts[p].encode("utf-8"), event)
            elif isinstance(event, Token):
                choices[p * job.n + event.index].add(event)
            else:
                choices[p * job.n + event.index].finish(event)
    out: list[CompletionChoice] = []
    for c in choices:
        prompt_text, prompt_block = job.prompts[c.index // job.n], prompt_blocks[c.index // job.n]
        blocks = ([prompt_block] if prompt_block is not None else []) + c.released
        out.append(CompletionChoice(index=c.index, text=(prompt_text if job.echo else "") + "".join(c.text),
                                    logprobs=_concat(blocks) if job.logprobs else None,
                                    finish_reason=c.finish_reason))
    return job.chunk(out, job.usage(choices))


async def _interleaved(streams: list[GenerationStream]) -> AsyncGenerator[tuple[int, Event], None]:
    """(p, event) of every stream (prompt p's) as the events arrive (the generations run together in the engine);
    a stream's failure is raised. Closing it (`aclosing`: at once, on a failure or a disconnect too) cancels every
    generation not finished."""
    async with AsyncExitStack() as streams_open:
        for stream in streams:
            await streams_open.enter_async_context(stream)
        async for item in _as_they_come(streams):
            yield item


async def _as_they_come(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, Event]]:
    pending = {asyncio.ensure_future(anext(stream)): p for p, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # arrived together: in prompt order
                p = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                yield p, event
                pending[asyncio.ensure_future(anext(streams[p]))] = p
    finally:
        for task in pending:  # left early (a failure, a disconnect): no read outlives the response
            task.cancel()


async def _chunks(streams: list[GenerationStream], job: _Job, include_usage: bool,
                  ctx: Context) -> AsyncIterator[bytes]:
    choices = job.choices()
    timers = [StreamTimer(ctx.metrics, ctx.route, stream.submitted) for stream in streams]
    async with aclosing(_interleaved(streams)) as events:
        try:
            if job.echo and not job.logprobs:
                for i in range(len(choices)):
                    yield sse(job.chunk([CompletionChoice(index=i, text=job.prompts[i // job.n])]))
            # every prompt's choices as they come (each chunk names its choice), as they are generated: together
            async for p, event in events:
                timers[p].observe(event)
                prompt_text, first = job.prompts[p], p * job.n
                if isinstance(event, PromptScored):
                    block = _prompt_block(job.tokenizer, prompt_text.encode("utf-8"), event)
                    for i in range(first, first + job.n):
                        yield sse(job.chunk([CompletionChoice(index=i, text=prompt_text, logprobs=block)]))
                elif isinstance(event, Token):
                    index = first + event.index
                    text, released = choices[index].add(event)
                    if text or released is not None:
                        yield sse(job.chunk([CompletionChoice(index=index, text=text, logprobs=released)]))
                else:
                    index = first + event.index
                    released = choices[index].finish(event)
                    yield sse(job.chunk([CompletionChoice(index=index, text="", logprobs=released,
                                                          finish_reason=event.finish_reason)]))
            if include_usage:
                yield sse(job.chunk([], job.usage(choices)))
        except Exception as exc:
            yield sse(error_event(exc, ctx.request))
    yield sse("[DONE]")
