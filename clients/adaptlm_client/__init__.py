"""Python SDK for the adaptlm HTTP API: the `adaptlm-client` distribution, httpx and pydantic only (never torch).

    from adaptlm_client import Client, NotFoundError

    with Client("http://127.0.0.1:8000", api_key=None) as client:
        client.score("It is a truth universally acknowledged").bits_per_byte
        client.generate("It was a dark", max_tokens=50, seed=1).text
        with client.generate_stream("It was a dark", max_tokens=50) as stream:
            for chunk in stream:
                print(chunk, end="", flush=True)
        print(stream.result.finish_reason, stream.result.usage, stream.result.timings)

        session = client.create_session(initial_text="Dear Sir,")
        session.observe("I write to you about the house.")      # scored, then adapted on
        session.score("The house is", adapt=False).bits_per_byte
        blob = session.export()                                  # bytes; import_state(id, blob) restores it
        try:
            client.get_session("no-such-session-0000")
        except NotFoundError as e:
            print(e.status, e.type, e.param)                     # 404 not_found_error session_id

`AsyncClient` and `AsyncSession` are the same API for async code. Answers are the pydantic models of
`adaptlm_client.protocol` (re-exported here), the wire models the server itself answers with; failures are
`AdaptlmError` subclasses chosen by the server's `error.type`; 429 and 503 answers, and a 409 session_conflict, are
retried as `RetryPolicy` says.
"""

from adaptlm_client._async_client import AsyncClient, AsyncSession
from adaptlm_client._calls import DEFAULT_BASE_URL, DEFAULT_TIMEOUT
from adaptlm_client._client import Client, Session
from adaptlm_client._errors import (
    AdaptlmError,
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from adaptlm_client._retry import DEFAULT_RETRY, RetryPolicy
from adaptlm_client._streaming import AsyncGenerateStream, GenerateStream
from adaptlm_client.protocol import (
    AdaptationSettings,
    GenerateDone,
    GenerateResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ObserveResponse,
    ReadyResponse,
    ScoreResponse,
    SessionResponse,
    SessionStatsBody,
    SuggestedChar,
    SuggestedWord,
    SuggestResponse,
    Timings,
    Usage,
)

__all__ = [
    "DEFAULT_BASE_URL", "DEFAULT_RETRY", "DEFAULT_TIMEOUT", "APIConnectionError", "APITimeoutError",
    "AdaptationSettings", "AdaptlmError", "AsyncClient", "AsyncGenerateStream", "AsyncSession", "AuthenticationError",
    "BadRequestError", "Client", "ConflictError", "GenerateDone", "GenerateResponse", "GenerateStream",
    "HealthResponse", "InternalServerError", "MethodNotAllowedError", "ModelCard", "ModelList", "NotFoundError",
    "ObserveResponse", "PayloadTooLargeError", "RateLimitError", "ReadyResponse", "RetryPolicy", "ScoreResponse",
    "ServiceUnavailableError", "Session", "SessionResponse", "SessionStatsBody", "SuggestResponse",
    "SuggestedChar", "SuggestedWord", "Timings", "UnprocessableEntityError", "Usage",
]
