"""`AsyncClient`: the async SDK (asyncio or trio, through httpx and anyio), and `AsyncSession`. The same API as
`Client` and `Session`, awaited; the docstrings there say what each call does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import anyio
import httpx

from adaptlm_client import _calls
from adaptlm_client._calls import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, Attempts, Call
from adaptlm_client._retry import DEFAULT_RETRY, RetryPolicy
from adaptlm_client._streaming import AsyncGenerateStream
from adaptlm_client.protocol import (
    GenerateResponse,
    HealthResponse,
    ModelList,
    ObserveResponse,
    ReadyResponse,
    ScoreResponse,
    SessionResponse,
    SuggestResponse,
)

__all__ = ["AsyncClient", "AsyncSession"]

T = TypeVar("T")


class AsyncClient:
    """The adaptlm HTTP API for async code; the arguments are `Client`'s.

        from adaptlm_client import AsyncClient

        async with AsyncClient("http://127.0.0.1:8000") as client:
            print((await client.score("It is a truth")).bits_per_byte)
            async with client.generate_stream("It was a dark", max_tokens=100) as stream:
                async for chunk in stream:
                    print(chunk, end="")
            session = await client.create_session()
            await session.observe("Dear Sir, ...")
    """

    def __init__(self, base_url: str | httpx.URL = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT, retry: RetryPolicy = DEFAULT_RETRY,
                 headers: Mapping[str, str] | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.retry = retry
        self._http = httpx.AsyncClient(base_url=_calls.base_url(base_url), headers=_calls.headers(api_key, headers),
                                       timeout=timeout, transport=transport)

    @property
    def base_url(self) -> httpx.URL:
        return self._http.base_url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({str(self.base_url)!r})"

    # -- sending -----------------------------------------------------------------------------------------

    async def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        """`Client._send`, awaited."""
        request, attempts = call.request(self._http), Attempts(call, self.retry)
        while True:
            try:
                response = await self._http.send(request, stream=stream)
                if response.is_success:
                    return response
                await response.aread()
                await response.aclose()
            except httpx.RequestError as e:
                await anyio.sleep(attempts.after_transport_error(e))
                continue
            await anyio.sleep(attempts.after_refusal(response))

    async def _request(self, call: Call[T]) -> T:
        return call.parse(await self._send(call))

    # -- the API -------------------------------------------------------------------------------------------

    async def health(self) -> HealthResponse:
        return await self._request(_calls.health())

    async def ready(self) -> ReadyResponse:
        return await self._request(_calls.ready())

    async def models(self) -> ModelList:
        return await self._request(_calls.models())

    async def score(self, text: str, *, logprobs: bool = False, session_id: str | None = None,
                    adapt: bool = False) -> ScoreResponse:
        return await self._request(_calls.score(text, logprobs=logprobs, session_id=session_id, adapt=adapt))

    async def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       stop: Sequence[str] | None = None, session_id: str | None = None,
                       adapt_while_generating: bool = False) -> GenerateResponse:
        return await self._request(_calls.generate(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            session_id=session_id, adapt_while_generating=adapt_while_generating))

    def generate_stream(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop: Sequence[str] | None = None, session_id: str | None = None,
                        adapt_while_generating: bool = False) -> AsyncGenerateStream:
        """Not awaited: `async with client.generate_stream(...) as stream` (or `async for` over it)."""
        call = _calls.generate_stream(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            session_id=session_id, adapt_while_generating=adapt_while_generating)
        return AsyncGenerateStream(lambda: self._send(call, stream=True))

    # -- sessions --------------------------------------------------------------------------------------------

    async def create_session(self, initial_text: str | None = None, *, ttl_s: float | None = None,
                             lr: float | None = None, decay: float | None = None,
                             adapter_size: int | None = None, cache_weight: float | None = None,
                             neural_cache: bool | None = None, copy_model: bool | None = None) -> AsyncSession:
        info = await self._request(_calls.create_session(initial_text, ttl_s=ttl_s, lr=lr, decay=decay,
                                                         adapter_size=adapter_size, cache_weight=cache_weight,
                                                         neural_cache=neural_cache, copy_model=copy_model))
        return AsyncSession(self, info.id, info)

    def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, session_id)

    async def get_session(self, session_id: str) -> SessionResponse:
        return await self._request(_calls.get_session(session_id))

    async def delete_session(self, session_id: str) -> None:
        await self._request(_calls.delete_session(session_id))

    async def reset_session(self, session_id: str) -> SessionResponse:
        return await self._request(_calls.reset_session(session_id))

    async def observe(self, session_id: str, text: str, *, idempotency_key: str | None = None) -> ObserveResponse:
        return await self._request(_calls.observe(session_id, text, idempotency_key))

    async def export_state(self, session_id: str) -> bytes:
        return await self._request(_calls.export_state(session_id))

    async def import_state(self, session_id: str, data: bytes) -> AsyncSession:
        info = await self._request(_calls.import_state(session_id, data))
        return AsyncSession(self, info.id, info)

    async def suggest(self, session_id: str, context: str = "", *, k: int | None = None,
                      max_chars: int | None = None, n_chars: int | None = None) -> SuggestResponse:
        """`POST /v1/sessions/{id}/suggest`: keyboard suggestions under the session's adaptation, without
        changing it: the k most probable completions of the word being typed at the end of `context` (the
        message so far), and the most likely next characters. After a mark ("Hi," "Done." an emoji) a completion
        may be the next word after a space the keyboard inserts: `space_before` (insert " " + text).

            s = await client.suggest(session.id, "I will see you tomor")
            [w.text for w in s.completions]   # e.g. ['tomorrow', ...]
            s = await client.suggest(session.id, "Hi,")
            [(" " if w.space_before else "") + w.text for w in s.completions]   # e.g. [' there', ...]
        """
        return await self._request(_calls.suggest(session_id, context, k, max_chars, n_chars))


class AsyncSession:
    """`Session` for an `AsyncClient`."""

    def __init__(self, client: AsyncClient, session_id: str, info: SessionResponse | None = None) -> None:
        self.client = client
        self.id = session_id
        self.info = info

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def get(self) -> SessionResponse:
        self.info = await self.client.get_session(self.id)
        return self.info

    async def observe(self, text: str, *, idempotency_key: str | None = None) -> ObserveResponse:
        return await self.client.observe(self.id, text, idempotency_key=idempotency_key)

    async def score(self, text: str, *, logprobs: bool = False, adapt: bool = False) -> ScoreResponse:
        return await self.client.score(text, logprobs=logprobs, session_id=self.id, adapt=adapt)

    async def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       stop: Sequence[str] | None = None, adapt_while_generating: bool = False) -> GenerateResponse:
        return await self.client.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                          top_p=top_p, seed=seed, stop=stop, session_id=self.id,
                                          adapt_while_generating=adapt_while_generating)

    def generate_stream(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop: Sequence[str] | None = None,
                        adapt_while_generating: bool = False) -> AsyncGenerateStream:
        return self.client.generate_stream(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                           top_p=top_p, seed=seed, stop=stop, session_id=self.id,
                                           adapt_while_generating=adapt_while_generating)

    async def reset(self) -> SessionResponse:
        self.info = await self.client.reset_session(self.id)
        return self.info

    async def export(self) -> bytes:
        return await self.client.export_state(self.id)

    async def delete(self) -> None:
        await self.client.delete_session(self.id)

    async def suggest(self, context: str = "", *, k: int | None = None, max_chars: int | None = None,
                      n_chars: int | None = None) -> SuggestResponse:
        """Keyboard suggestions for `context` under this session (`Client.suggest`)."""
        return await self.client.suggest(self.id, context, k=k, max_chars=max_chars, n_chars=n_chars)
