"""What the two clients share, without I/O: each endpoint's request and how its answer is read, the headers, a
call's retries (`Attempts`) and the server-sent-event decoder. `Client` and `AsyncClient` only send these and sleep
between retries.

Request bodies are plain dicts of the arguments given (None is left out, so the server's defaults apply);
they are not validated here: the server is the one judge, and its 422 names the field (`param`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from adaptlm_client._errors import AdaptlmError, error_from_body, error_from_response, error_from_transport
from adaptlm_client._retry import RetryPolicy, parse_retry_after
from adaptlm_client.protocol import (
    GenerateChunk,
    GenerateDone,
    GenerateResponse,
    HealthResponse,
    ModelList,
    ObserveResponse,
    ReadyResponse,
    ScoreResponse,
    SessionResponse,
    SuggestResponse,
)

__all__ = [
    "DEFAULT_BASE_URL", "DEFAULT_TIMEOUT", "IDEMPOTENCY_HEADER", "SESSION_HEADER", "STATE_MEDIA_TYPE", "Attempts",
    "Call", "SSEDecoder", "base_url",
    "create_session", "delete_session", "export_state", "generate", "generate_stream", "get_session", "headers",
    "health", "import_state", "models", "observe", "parse_generate_event", "ready", "reset_session", "score",
    "suggest",
]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# Generation of a few thousand bytes on a CPU can take a while; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
STATE_MEDIA_TYPE = "application/octet-stream"
SESSION_HEADER = "X-Session-Id"  # the session a request works on, for a session-affine balancer
IDEMPOTENCY_HEADER = "Idempotency-Key"  # an observe's: the server applies it once whatever the retries


@lru_cache(maxsize=1)
def user_agent() -> str:
    try:
        ours = version("adaptlm-client")
    except PackageNotFoundError:
        ours = "0.0.0"
    return f"adaptlm-python/{ours} httpx/{httpx.__version__}"


def headers(api_key: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    out = {"User-Agent": user_agent()}
    if api_key is not None:
        out["Authorization"] = f"Bearer {api_key}"
    out.update(extra or {})
    return out


def base_url(value: str | httpx.URL) -> httpx.URL:
    """The server's URL, checked when the client is made: "localhost:8000" would otherwise fail only at the first
    request, as a connection error (which reads like a server that is down). A path prefix (a server behind a
    proxy at /adaptlm/) is kept, with or without its trailing slash."""
    url = httpx.URL(value)
    if url.scheme not in ("http", "https"):
        raise ValueError(f"base_url must be an http:// or https:// URL (e.g. 'http://127.0.0.1:8000'), "
                         f"not {str(value)!r}")
    return url


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its (successful) answer. `retry`: False where a refusal is the answer
    (a readiness probe's 503 means "not ready", not "ask again"). `idempotency_key`: sent as IDEMPOTENCY_HEADER,
    the same on every retry (the request is built once), so that the server applies the request once; such a
    request may also be sent again after its connection broke once sent."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: Mapping[str, Any] | None = None
    content: bytes | None = None
    content_type: str | None = None
    retry: bool = True
    session_id: str | None = None  # a session named in the body: sent as SESSION_HEADER too
    idempotency_key: str | None = None

    def request(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        content, content_type = self.content, self.content_type
        if self.json is not None:
            content, content_type = _json_bytes(self.json), "application/json"
        extra = {"Content-Type": content_type} if content_type else {}
        if self.session_id:
            # a balancer cannot read bodies: the header keeps the session's requests on one replica
            # (deploy/nginx/adaptlm.conf.template hashes on the path's session id, else on this header).
            # Percent-encoded: a real id is [A-Za-z0-9_-] and unchanged; any other str must still reach the
            # server (its 404) rather than fail in httpx's ASCII header encoding.
            extra[SESSION_HEADER] = quote(self.session_id, safe="", errors="surrogatepass")
        if self.idempotency_key is not None:
            extra[IDEMPOTENCY_HEADER] = self.idempotency_key
        return http.build_request(self.method, self.path, content=content, headers=extra or None)


class Attempts:
    """One call's tries, without I/O: after each failure, how long to wait before sending its request again, or the
    error to raise instead (what is retried: `RetryPolicy`). Each client's send loop asks it after every failure."""

    def __init__(self, call: Call[Any], policy: RetryPolicy) -> None:
        self._call = call
        self._policy = policy
        self._retries = 0

    def after_transport_error(self, exc: httpx.RequestError) -> float:
        """Seconds to wait before sending again after `exc` (no answer came); else its `AdaptlmError`, raised."""
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):  # nothing was sent: safe to send again
            again = self._call.retry
        else:  # sent, then broken or timed out: done or not, unknown; sent again only under an idempotency key
            again = self._call.retry and bool(self._call.idempotency_key)
        delay = self._policy.connect_delay(self._retries) if again else None
        if delay is None:
            raise error_from_transport(exc) from None
        self._retries += 1
        return delay

    def after_refusal(self, response: httpx.Response) -> float:
        """Seconds to wait before sending again after an error answer (its body read); else its error, raised."""
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        error = error_from_response(response, retry_after)
        delay = (self._policy.delay(self._retries, response.status_code, retry_after, error.code)
                 if self._call.retry else None)
        if delay is None:
            raise error
        self._retries += 1
        return delay


def _json_bytes(body: Mapping[str, Any]) -> bytes:
    """The body as UTF-8 JSON, for whatever Python values the caller gave: the server is the one judge of them.
    httpx's own encoding raises instead for a lone surrogate (text from a platform that hands out UTF-16 halves)
    and for NaN or infinity; here the first goes as a `\\udXXX` escape and the others as `NaN` / `Infinity`,
    which the server reads and answers with a 422 naming the field (`string_unicode`, `finite_number`)."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()  # ASCII: every code point escaped


def _model(cls: type[M]) -> Callable[[httpx.Response], M]:
    def parse(response: httpx.Response) -> M:
        try:
            return cls.model_validate_json(response.content)
        except ValidationError as e:
            raise AdaptlmError(f"unexpected answer from {response.request.method} {response.request.url.path} "
                               f"(HTTP {response.status_code}): not a {cls.__name__} ({e.error_count()} "
                               f"errors)", status=response.status_code) from None
    return parse


def _nothing(response: httpx.Response) -> None:
    return None


def _bytes(response: httpx.Response) -> bytes:
    return response.content


def _body(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def _session_path(session_id: str, suffix: str = "") -> str:
    if not session_id:
        raise ValueError("session_id must not be empty")
    return f"/v1/sessions/{quote(session_id, safe='', errors='surrogatepass')}{suffix}"  # any str: the server's 404


# -- the endpoints -------------------------------------------------------------------------------------------


def health() -> Call[HealthResponse]:
    return Call("GET", "/healthz", _model(HealthResponse), retry=False)


def ready() -> Call[ReadyResponse]:
    return Call("GET", "/readyz", _model(ReadyResponse), retry=False)


def models() -> Call[ModelList]:
    return Call("GET", "/v1/models", _model(ModelList))


def score(text: str, *, logprobs: bool, session_id: str | None, adapt: bool) -> Call[ScoreResponse]:
    body = _body(text=text, logprobs=logprobs or None, session_id=session_id, adapt=adapt or None)
    return Call("POST", "/v1/score", _model(ScoreResponse), json=body, session_id=session_id)


def _generate_body(prompt: str, *, max_tokens: int | None, temperature: float | None, top_k: int | None,
                   top_p: float | None, seed: int | None, stop: Sequence[str] | None, session_id: str | None,
                   adapt_while_generating: bool, stream: bool) -> dict[str, Any]:
    if isinstance(stop, str):
        raise TypeError("stop must be a list of strings, not a string")
    return _body(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 seed=seed, stop=list(stop) if stop is not None else None, session_id=session_id,
                 adapt_while_generating=adapt_while_generating or None, stream=stream or None)


def generate(prompt: str, **options: Any) -> Call[GenerateResponse]:
    return Call("POST", "/v1/generate", _model(GenerateResponse),
                json=_generate_body(prompt, **options, stream=False), session_id=options.get("session_id"))


def generate_stream(prompt: str, **options: Any) -> Call[None]:
    """The request only: its answer is read event by event (`SSEDecoder`, `parse_generate_event`)."""
    return Call("POST", "/v1/generate", _nothing, json=_generate_body(prompt, **options, stream=True),
                session_id=options.get("session_id"))


def create_session(initial_text: str | None, *, ttl_s: float | None, lr: float | None, decay: float | None,
                   adapter_size: int | None, cache_weight: float | None = None,
                   neural_cache: bool | None = None, copy_model: bool | None = None) -> Call[SessionResponse]:
    adaptation = _body(lr=lr, decay=decay, adapter_size=adapter_size, cache_weight=cache_weight,
                       neural_cache=neural_cache, copy_model=copy_model)
    body = _body(initial_text=initial_text, ttl_s=ttl_s, adaptation=adaptation or None)
    return Call("POST", "/v1/sessions", _model(SessionResponse), json=body)


def get_session(session_id: str) -> Call[SessionResponse]:
    return Call("GET", _session_path(session_id), _model(SessionResponse))


def delete_session(session_id: str) -> Call[None]:
    return Call("DELETE", _session_path(session_id), _nothing)


def reset_session(session_id: str) -> Call[SessionResponse]:
    return Call("POST", _session_path(session_id, "/reset"), _model(SessionResponse))


def observe(session_id: str, text: str, idempotency_key: str | None = None) -> Call[ObserveResponse]:
    """An observe carries a key of its own (a new UUID unless given): a retry after a 503 that came once the
    session was written (the session store's reply lost) is answered as the first was, not observed twice."""
    return Call("POST", _session_path(session_id, "/observe"), _model(ObserveResponse), json={"text": text},
                idempotency_key=idempotency_key if idempotency_key is not None else str(uuid.uuid4()))


def export_state(session_id: str) -> Call[bytes]:
    return Call("GET", _session_path(session_id, "/state"), _bytes)


def import_state(session_id: str, data: bytes) -> Call[SessionResponse]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data must be bytes (a session export), not {type(data).__name__}")
    return Call("PUT", _session_path(session_id, "/state"), _model(SessionResponse), content=bytes(data),
                content_type=STATE_MEDIA_TYPE)


def suggest(session_id: str, context: str, k: int | None, max_chars: int | None,
            n_chars: int | None) -> Call[SuggestResponse]:
    body = _body(context=context, k=k, max_chars=max_chars, n_chars=n_chars)
    return Call("POST", _session_path(session_id, "/suggest"), _model(SuggestResponse), json=body)


# -- server-sent events --------------------------------------------------------------------------------------


class SSEDecoder:
    """Turns the lines of a `text/event-stream` into the data of each event (the WHATWG rules we need: `data:`
    lines joined by newlines, an event ends at a blank line, comments and other fields ignored)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """The data of the event this line completes, if it does."""
        if line == "":
            return self.flush()
        if line.startswith("data:"):
            self._data.append(line[5:].removeprefix(" "))
        elif line == "data":
            self._data.append("")
        return None

    def flush(self) -> str | None:
        """What is pending when the stream ends (a last event without its blank line)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_generate_event(data: str) -> GenerateChunk | GenerateDone:
    """One event of `POST /v1/generate` with `stream: true`; an error event is raised as its exception."""
    try:
        event = json.loads(data)
    except ValueError:
        raise AdaptlmError("unexpected stream event: not JSON") from None
    if not isinstance(event, dict):
        raise AdaptlmError("unexpected stream event: not a JSON object")
    if "error" in event:
        raise error_from_body(event)
    try:
        if "finish_reason" in event:
            return GenerateDone.model_validate(event)
        return GenerateChunk.model_validate(event)
    except ValidationError as e:
        raise AdaptlmError(f"unexpected stream event ({e.error_count()} errors)") from None
