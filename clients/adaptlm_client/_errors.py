"""The SDK's one exception hierarchy, mapped from the server's `error.type` (`adaptlm_client.protocol.ErrorType`).

Every failure a call can have is an `AdaptlmError`: an error response (a subclass chosen by `type`, falling
back on the HTTP status), an error event at the end of a stream (the same classes, with the status that
`type` stands for), a server that cannot be reached or answers too slowly (`APIConnectionError`,
`APITimeoutError`), and an answer that is not what the API promises (`AdaptlmError` itself).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx

__all__ = [
    "APIConnectionError", "APITimeoutError", "AdaptlmError", "AuthenticationError", "BadRequestError",
    "ConflictError", "InternalServerError", "MethodNotAllowedError", "NotFoundError", "PayloadTooLargeError",
    "RateLimitError", "ServiceUnavailableError", "UnprocessableEntityError", "error_from_body", "error_from_transport",
    "error_from_response",
]


class AdaptlmError(Exception):
    """Base of every error the SDK raises.

    `status` is the HTTP status (for an error event inside a stream, the status its `type` stands for;
    None when no answer came), `type`, `param` and `code` are the server's `error` fields,
    `retry_after` the seconds of a `Retry-After` header (429, 503, 409 session_conflict), if any, and
    `request_id` the answer's `X-Request-ID` (what the server's log lines of that request carry: quote it when
    reporting a failure).

        try:
            client.get_session("gone-0123456789abcdef")
        except NotFoundError as e:
            print(e.status, e.type, e.param)  # 404 not_found_error session_id
    """

    default_status: ClassVar[int | None] = None
    error_type: ClassVar[str | None] = None

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: str | None = None, retry_after: float | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status if status is not None else self.default_status
        self.type = type if type is not None else self.error_type
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.request_id = request_id

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.message!r}, status={self.status!r}, type={self.type!r}, "
                f"param={self.param!r}, code={self.code!r}, request_id={self.request_id!r})")


class APIConnectionError(AdaptlmError):
    """No answer: the server could not be reached, or the connection broke (a request may have been done)."""


class APITimeoutError(APIConnectionError):
    """No answer within the client's timeout."""


class BadRequestError(AdaptlmError):
    """400: the body is not JSON or otherwise unusable."""

    default_status = 400
    error_type = "invalid_request_error"


class AuthenticationError(AdaptlmError):
    """401: the API key is missing or wrong."""

    default_status = 401
    error_type = "authentication_error"


class NotFoundError(AdaptlmError):
    """404: no such route or resource; a session of another API key is not found either (`param`: session_id)."""

    default_status = 404
    error_type = "not_found_error"


class MethodNotAllowedError(AdaptlmError):
    default_status = 405
    error_type = "method_not_allowed_error"


class ConflictError(AdaptlmError):
    """409: a session export made with another checkpoint's weights (`code` checkpoint_mismatch), or a session
    changed by another request while this one worked on it (`code` session_conflict: nothing was applied; retried
    by `RetryPolicy`)."""

    default_status = 409
    error_type = "conflict_error"


class PayloadTooLargeError(AdaptlmError):
    """413: the body, or the text in `param`, is over the server's limit."""

    default_status = 413
    error_type = "payload_too_large_error"


class UnprocessableEntityError(AdaptlmError):
    """422: the request does not match the schema (or the server's limits); `param` names the field."""

    default_status = 422
    error_type = "validation_error"


class RateLimitError(AdaptlmError):
    """429: the server's work queue is full; `retry_after` says when to try again."""

    default_status = 429
    error_type = "rate_limit_error"


class InternalServerError(AdaptlmError):
    """500 (or another 5xx without a class of its own): a failure on the server's side."""

    default_status = 500
    error_type = "server_error"


class ServiceUnavailableError(AdaptlmError):
    """503: the model is not loaded, the engine has stopped, or the session store is full (`retry_after`)."""

    default_status = 503
    error_type = "service_unavailable_error"


_STATUS_ERRORS: tuple[type[AdaptlmError], ...] = (
    BadRequestError, AuthenticationError, NotFoundError, MethodNotAllowedError, ConflictError, PayloadTooLargeError,
    UnprocessableEntityError, RateLimitError, InternalServerError, ServiceUnavailableError,
)
_BY_TYPE: dict[str, type[AdaptlmError]] = {cls.error_type: cls for cls in _STATUS_ERRORS if cls.error_type}
_BY_STATUS: dict[int, type[AdaptlmError]] = {cls.default_status: cls for cls in _STATUS_ERRORS if cls.default_status}


def _class_for(type_: str | None, status: int | None) -> type[AdaptlmError]:
    if type_ in _BY_TYPE:
        return _BY_TYPE[type_]
    # An answer not in the one shape (a proxy's page, a newer server's type): go by the status.
    if status is None:
        return AdaptlmError
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return BadRequestError if 400 <= status < 500 else InternalServerError if status >= 500 else AdaptlmError


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def error_from_body(body: Any, *, status: int | None = None, retry_after: float | None = None,
                    request_id: str | None = None) -> AdaptlmError:
    """The exception for `{"error": {...}}` (a parsed JSON body or stream event); lenient about its contents."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        reason = f"HTTP {status}" if status is not None else "an error"
        return _class_for(None, status)(f"{reason} without an error body", status=status, retry_after=retry_after,
                                        request_id=request_id)
    type_ = _str_or_none(error.get("type"))
    message = _str_or_none(error.get("message")) or (type_ or "error")
    return _class_for(type_, status)(message, status=status, type=type_, param=_str_or_none(error.get("param")),
                                     code=_str_or_none(error.get("code")), retry_after=retry_after,
                                     request_id=request_id)


def error_from_response(response: httpx.Response, retry_after: float | None = None) -> AdaptlmError:
    """The exception for an error response (its body must have been read)."""
    request_id = response.headers.get("X-Request-ID")
    try:
        body: Any = json.loads(response.content)
    except ValueError:
        body = None
    if body is None or not isinstance(body, Mapping) or "error" not in body:
        # Not ours (a proxy, a load balancer): a short excerpt of whatever it said.
        excerpt = response.text[:200].strip() if response.content else ""
        phrase = response.reason_phrase or "error"
        message = f"HTTP {response.status_code} {phrase}" + (f": {excerpt}" if excerpt else "")
        return _class_for(None, response.status_code)(message, status=response.status_code, retry_after=retry_after,
                                                      request_id=request_id)
    return error_from_body(body, status=response.status_code, retry_after=retry_after, request_id=request_id)


def error_from_transport(exc: httpx.RequestError) -> AdaptlmError:
    """The exception for an httpx failure without an answer (connect, read, timeout, a broken stream)."""
    try:
        where = f"{exc.request.method} {exc.request.url}"
    except RuntimeError:  # httpx raised it before a request existed
        where = "the request"
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"no answer in time from {where} ({detail})")
    if isinstance(exc, httpx.TransportError):
        return APIConnectionError(f"no answer from {where}: {detail}")
    return AdaptlmError(f"{where}: {detail}")
