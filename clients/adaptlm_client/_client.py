"""`Client`: the blocking SDK, and `Session`, a handle on one adaptive session."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from adaptlm_client import _calls
from adaptlm_client._calls import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, Attempts, Call
from adaptlm_client._retry import DEFAULT_RETRY, RetryPolicy
from adaptlm_client._streaming import GenerateStream
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

__all__ = ["Client", "Session"]

T = TypeVar("T")


class Client:
    """The adaptlm HTTP API, blocking (httpx underneath; one connection pool per client).

        from adaptlm_client import Client

        with Client("http://127.0.0.1:8000", api_key="...") as client:
            print(client.score("It is a truth universally acknowledged").bits_per_byte)
            print(client.generate("It was a dark", max_tokens=50, seed=1).text)
            session = client.create_session(initial_text="Dear Sir,")
            session.observe("I write to you about ...")
            print(session.get().stats.gain_over_static)

    `api_key` is sent as `Authorization: Bearer <key>` (the SDK reads no environment variables). `timeout`:
    seconds, or an `httpx.Timeout` (default: 120 s to answer, 10 s to connect; None waits forever). `retry`:
    how 429 and 503 answers, and a 409 session_conflict, are retried (`RetryPolicy`). `headers` are added to every
    request; `transport` replaces httpx's (e.g. `httpx.MockTransport` in tests). Errors are raised as `AdaptlmError`
    subclasses.
    Use it as a context manager, or call `close`.
    """

    def __init__(self, base_url: str | httpx.URL = DEFAULT_BASE_URL, *, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT, retry: RetryPolicy = DEFAULT_RETRY,
                 headers: Mapping[str, str] | None = None, transport: httpx.BaseTransport | None = None) -> None:
        self.retry = retry
        self._http = httpx.Client(base_url=_calls.base_url(base_url), headers=_calls.headers(api_key, headers),
                                  timeout=timeout, transport=transport)

    @property
    def base_url(self) -> httpx.URL:
        return self._http.base_url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({str(self.base_url)!r})"

    # -- sending -----------------------------------------------------------------------------------------

    def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        """The successful response to `call`, after the retries its refusals allow; else its error, raised."""
        request, attempts = call.request(self._http), Attempts(call, self.retry)
        while True:
            try:
                response = self._http.send(request, stream=stream)
                if response.is_success:
                    return response
                response.read()
                response.close()
            except httpx.RequestError as e:
                time.sleep(attempts.after_transport_error(e))
                continue
            time.sleep(attempts.after_refusal(response))

    def _request(self, call: Call[T]) -> T:
        return call.parse(self._send(call))

    # -- the API -------------------------------------------------------------------------------------------

    def health(self) -> HealthResponse:
        """`GET /healthz`: the process is up."""
        return self._request(_calls.health())

    def ready(self) -> ReadyResponse:
        """`GET /readyz`: the model is loaded; `ServiceUnavailableError` at once (no retry) when it is not."""
        return self._request(_calls.ready())

    def models(self) -> ModelList:
        """`GET /v1/models`: the served checkpoint (`.data[0].id`)."""
        return self._request(_calls.models())

    def score(self, text: str, *, logprobs: bool = False, session_id: str | None = None,
              adapt: bool = False) -> ScoreResponse:
        """`POST /v1/score`: the text's bits and bits per byte (and each byte's natural-log probability with
        `logprobs`). With `session_id`, scored as the session's continuation under its adapter; `adapt`: the
        session then adapts on it, as an observe does.

            client.score("It was the best of times").bits_per_byte
        """
        return self._request(_calls.score(text, logprobs=logprobs, session_id=session_id, adapt=adapt))

    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | None = None, session_id: str | None = None,
                 adapt_while_generating: bool = False) -> GenerateResponse:
        """`POST /v1/generate`, whole: the text, finish reason and usage. Options left out take the server's
        defaults (200 bytes, temperature 1, no top-k or top-p). With `session_id`, continues the session's
        stream; `adapt_while_generating`: the session then observes the prompt and the generated text.

            client.generate("It was a dark", max_tokens=50, temperature=0.8, seed=1, stop=["\\n\\n"]).text
        """
        return self._request(_calls.generate(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            session_id=session_id, adapt_while_generating=adapt_while_generating))

    def generate_stream(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop: Sequence[str] | None = None, session_id: str | None = None,
                        adapt_while_generating: bool = False) -> GenerateStream:
        """`POST /v1/generate` with `stream: true`: the text chunks as they are generated (see `GenerateStream`).

            with client.generate_stream("It was a dark", max_tokens=100) as stream:
                for chunk in stream:
                    print(chunk, end="", flush=True)
            print(stream.result.finish_reason)
        """
        call = _calls.generate_stream(
            prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            session_id=session_id, adapt_while_generating=adapt_while_generating)
        return GenerateStream(lambda: self._send(call, stream=True))

    # -- sessions --------------------------------------------------------------------------------------------

    def create_session(self, initial_text: str | None = None, *, ttl_s: float | None = None,
                       lr: float | None = None, decay: float | None = None,
                       adapter_size: int | None = None, cache_weight: float | None = None,
                       neural_cache: bool | None = None, copy_model: bool | None = None) -> Session:
        """`POST /v1/sessions`: a new adaptive session, having observed `initial_text` if given
        (`session.info.observed`). `lr`, `decay`, `adapter_size`, `cache_weight` (the word cache's weight in
        suggestions), `neural_cache` (mix the neural cache into its predictions) and `copy_model` (False: no copy
        model; with lr=0 and cache_weight=0, the unadapted model) override the checkpoint's adaptation settings.

            session = client.create_session("Dear Sir,", ttl_s=600)
        """
        info = self._request(_calls.create_session(initial_text, ttl_s=ttl_s, lr=lr, decay=decay,
                                                   adapter_size=adapter_size, cache_weight=cache_weight,
                                                   neural_cache=neural_cache, copy_model=copy_model))
        return Session(self, info.id, info)

    def session(self, session_id: str) -> Session:
        """A handle on an existing session (no request is sent)."""
        return Session(self, session_id)

    def get_session(self, session_id: str) -> SessionResponse:
        """`GET /v1/sessions/{id}`: settings and statistics (bits per byte observed, static, gain)."""
        return self._request(_calls.get_session(session_id))

    def delete_session(self, session_id: str) -> None:
        """`DELETE /v1/sessions/{id}`."""
        self._request(_calls.delete_session(session_id))

    def reset_session(self, session_id: str) -> SessionResponse:
        """`POST /v1/sessions/{id}/reset`: back to the start (state, adapter, statistics); same id and settings."""
        return self._request(_calls.reset_session(session_id))

    def observe(self, session_id: str, text: str, *, idempotency_key: str | None = None) -> ObserveResponse:
        """`POST /v1/sessions/{id}/observe`: the text's bits under the session (each segment scored before the
        session adapts on it) and under the unadapted model. Applied once, whatever the retries: the call sends
        an `Idempotency-Key` (a new UUID, or `idempotency_key`: give the same one to send an observe again after
        this call raised), and a retry of an observe the server applied is answered as the first was."""
        return self._request(_calls.observe(session_id, text, idempotency_key))

    def export_state(self, session_id: str) -> bytes:
        """`GET /v1/sessions/{id}/state`: the session as bytes (safetensors with versioned metadata, tied to the
        checkpoint's weights), for `import_state` here or on another server with the same checkpoint."""
        return self._request(_calls.export_state(session_id))

    def import_state(self, session_id: str, data: bytes) -> Session:
        """`PUT /v1/sessions/{id}/state`: create or replace session `session_id` from an export; it belongs to
        this client's API key. `ConflictError` for an export of another checkpoint.

            blob = client.export_state(session.id)
            moved = other_client.import_state(session.id, blob)
        """
        info = self._request(_calls.import_state(session_id, data))
        return Session(self, info.id, info)

    def suggest(self, session_id: str, context: str = "", *, k: int | None = None, max_chars: int | None = None,
                n_chars: int | None = None) -> SuggestResponse:
        """`POST /v1/sessions/{id}/suggest`: keyboard suggestions under the session's adaptation, without
        changing it: the k most probable completions of the word being typed at the end of `context` (the
        message so far), and the most likely next characters. After a mark ("Hi," "Done." an emoji) a completion
        may be the next word after a space the keyboard inserts: `space_before` (insert " " + text).

            s = client.suggest(session.id, "I will see you tomor")
            [w.text for w in s.completions]   # e.g. ['tomorrow', ...]
            s = client.suggest(session.id, "Hi,")
            [(" " if w.space_before else "") + w.text for w in s.completions]   # e.g. [' there', ...]
        """
        return self._request(_calls.suggest(session_id, context, k, max_chars, n_chars))


class Session:
    """One adaptive session of a `Client`: its `id`, and `info`, the last `SessionResponse` seen (from
    creation, import, `get` or `reset`; None for a handle made with `Client.session` until `get`).

        session = client.create_session()
        session.observe("The first letter of the user's text ...")   # scored, then adapted on
        session.score("a continuation").bits_per_byte                  # under the adapted model
        session.generate("Yours ", max_tokens=40).text
        blob = session.export()
        session.delete()
    """

    def __init__(self, client: Client, session_id: str, info: SessionResponse | None = None) -> None:
        self.client = client
        self.id = session_id
        self.info = info

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def get(self) -> SessionResponse:
        """Fetch the session's settings and statistics (and keep them in `info`)."""
        self.info = self.client.get_session(self.id)
        return self.info

    def observe(self, text: str, *, idempotency_key: str | None = None) -> ObserveResponse:
        """Score `text` under the session, adapting on each segment after scoring it (`Client.observe`)."""
        return self.client.observe(self.id, text, idempotency_key=idempotency_key)

    def score(self, text: str, *, logprobs: bool = False, adapt: bool = False) -> ScoreResponse:
        """Score `text` as the session's continuation; with `adapt`, the session keeps the adaptation."""
        return self.client.score(text, logprobs=logprobs, session_id=self.id, adapt=adapt)

    def generate(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | None = None, adapt_while_generating: bool = False) -> GenerateResponse:
        """Continue the session's stream with its adapter (`Client.generate`)."""
        return self.client.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed, stop=stop, session_id=self.id,
                                    adapt_while_generating=adapt_while_generating)

    def generate_stream(self, prompt: str, *, max_tokens: int | None = None, temperature: float | None = None,
                        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                        stop: Sequence[str] | None = None, adapt_while_generating: bool = False) -> GenerateStream:
        """`generate`, streamed (`Client.generate_stream`)."""
        return self.client.generate_stream(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                           top_p=top_p, seed=seed, stop=stop, session_id=self.id,
                                           adapt_while_generating=adapt_while_generating)

    def reset(self) -> SessionResponse:
        """Back to the start; same id and settings."""
        self.info = self.client.reset_session(self.id)
        return self.info

    def export(self) -> bytes:
        """The session's state as bytes (`Client.export_state`)."""
        return self.client.export_state(self.id)

    def delete(self) -> None:
        self.client.delete_session(self.id)

    def suggest(self, context: str = "", *, k: int | None = None, max_chars: int | None = None,
                n_chars: int | None = None) -> SuggestResponse:
        """Keyboard suggestions for `context` under this session (`Client.suggest`)."""
        return self.client.suggest(self.id, context, k=k, max_chars=max_chars, n_chars=n_chars)
