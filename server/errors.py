"""The one error hierarchy of the API and its one handler.

Every error response, whatever raised it (our code, request validation, routing, a bug), has the shape
`{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}` (protocol.ErrorResponse).
The OpenAI-compatible routes (OPENAI_ROUTES) answer request errors as OpenAI does: a 400 where the others answer
422, or 413 for a text over the limit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, ClassVar

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from server._asgi import HTTPMiddleware
from server.engine import (
    EngineBudgetExceeded,
    EngineOverloaded,
    EngineUnavailable,
    SessionConflict,
    SessionImportError,
    SessionNotFound,
    SessionStoreFull,
    SessionStoreUnavailable,
    SessionsUnavailable,
)
from server.protocol import ErrorBody, ErrorResponse, ErrorType

__all__ = [
    "APIError", "AuthenticationError", "BadRequestError", "ConflictError", "InternalServerError",
    "MethodNotAllowedError", "NotFoundError", "OPENAI_ROUTES", "PayloadTooLargeError", "RateLimitError",
    "ServiceUnavailableError", "UnprocessableEntityError", "UnexpectedErrorMiddleware", "error_response",
    "from_engine_error", "install_error_handler", "openapi_responses", "raw_error_answer", "to_api_error",
]

# What the engine raises; each is translated by `to_api_error`.
_ENGINE_ERRORS = (EngineBudgetExceeded, EngineOverloaded, EngineUnavailable, SessionConflict, SessionImportError,
                  SessionNotFound, SessionStoreFull, SessionStoreUnavailable, SessionsUnavailable)

log = logging.getLogger(__name__)


class APIError(Exception):
    """Base of every error the API reports; each subclass fixes the HTTP status and `error.type`."""

    status: ClassVar[int] = 500
    type: ClassVar[ErrorType] = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))


class BadRequestError(APIError):
    status = 400
    type = "invalid_request_error"


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"


class NotFoundError(APIError):
    status = 404
    type = "not_found_error"


class MethodNotAllowedError(APIError):
    status = 405
    type = "method_not_allowed_error"


class ConflictError(APIError):
    status = 409
    type = "conflict_error"


class RequestTimeoutError(BadRequestError):
    """A client too slow to send its request (its head, or its body stalled): 408, and the connection is closed."""

    status = 408


class PayloadTooLargeError(APIError):
    status = 413
    type = "payload_too_large_error"


class UnprocessableEntityError(APIError):
    status = 422
    type = "validation_error"


class RateLimitError(APIError):
    status = 429
    type = "rate_limit_error"


class InternalServerError(APIError):
    status = 500
    type = "server_error"


class ServiceUnavailableError(APIError):
    status = 503
    type = "service_unavailable_error"


# The routes of the OpenAI-compatible surface, by path template. OpenAI answers an invalid parameter with 400
# `invalid_request_error` (the `openai` client's BadRequestError; a 422 would be its UnprocessableEntityError) and a
# prompt too long for the model with a 400 whose code is `context_length_exceeded`, which applications test for. So
# on these routes a 422 or a 413 is sent as that 400, its message and param kept, its code kept or renamed to
# OpenAI's. A body over ADAPTLM_MAX_BODY_BYTES is refused before routing (app.BodyLimitMiddleware): still a 413.
OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/models", "/v1/models/{model}"})
_OPENAI_CODES = {"text_too_long": "context_length_exceeded"}

_BY_STATUS: dict[int, type[APIError]] = {
    cls.status: cls for cls in (BadRequestError, AuthenticationError, NotFoundError, MethodNotAllowedError,
                                ConflictError, PayloadTooLargeError, UnprocessableEntityError, RateLimitError,
                                ServiceUnavailableError)
}
_LOCATIONS = {"body", "query", "path", "header", "cookie"}
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def openapi_responses(*errors: type[APIError]) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route or router, so /openapi.json shows the real error shape (not FastAPI's 422)."""
    return {cls.status: {"model": ErrorResponse, "description": HTTPStatus(cls.status).phrase} for cls in errors}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)


def raw_error_answer(error: APIError) -> tuple[bytes, bytes]:
    """The error as the HTTP front writes it itself, without the app (a 429 at the door, a 400/431 for a request
    h11 refused) -> (the status line and headers, the error's own and `connection: close` included, without the
    blank line that ends them, so that a request's ID can follow; the body, in the one error shape)."""
    body = JSONResponse(error.body().model_dump()).body  # as the error handler writes it
    lines = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", *(f"{k.lower()}: {v}" for k, v in error.headers.items()),
             "connection: close"]
    return ("\r\n".join(lines) + "\r\n").encode(), bytes(body)


def _param(loc: Sequence[Any]) -> str | None:
    parts = list(loc[1:] if loc and loc[0] in _LOCATIONS else loc)
    return ".".join(str(p) for p in parts) or None


def _from_validation(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    if not errors:
        return UnprocessableEntityError("the request is not valid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error") or "decode error"
        return BadRequestError(f"the request body is not valid JSON ({reason})", code="invalid_json")
    if first.get("type") == "model_attributes_type" and tuple(first.get("loc", ())) == ("body",):
        # Also what a body without `Content-Type: application/json` gets (e.g. `curl -d` sends a form).
        return UnprocessableEntityError("the request body must be a JSON object, sent with "
                                        "`Content-Type: application/json`", code="model_attributes_type")
    # `msg` never quotes the input, so user text is not echoed back.
    message = "; ".join(f"{_param(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errors)
    return UnprocessableEntityError(message, param=_param(first.get("loc", ())), code=first.get("type"))


def to_api_error(exc: Exception, request: Request) -> APIError:
    """Translate anything a request can raise into the hierarchy, as the request's route answers it (OpenAI's 400 on
    OPENAI_ROUTES); unknown exceptions become a bare 500."""
    error = _translate(exc, request)
    route = request.scope.get("route")
    if error.status in (413, 422) and getattr(route, "path", None) in OPENAI_ROUTES:
        code = _OPENAI_CODES.get(error.code, error.code) if error.code is not None else None
        return BadRequestError(error.message, param=error.param, code=code, headers=error.headers)
    return error


def _translate(exc: Exception, request: Request) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _from_validation(exc)
    if isinstance(exc, StarletteHTTPException):
        headers = dict(exc.headers or {})
        path, method = _bounded(request.url.path), _bounded(request.method, 20)  # a method may be 16 KB long too
        if exc.status_code == 404:
            return NotFoundError(f"no route for {method} {path}", headers=headers)
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route that matched the path; a path has several
            headers["Allow"] = ", ".join(_allowed_methods(request))
            return MethodNotAllowedError(f"{method} is not allowed on {path}", headers=headers)
        cls = _BY_STATUS.get(exc.status_code, BadRequestError if exc.status_code < 500 else InternalServerError)
        return cls(str(exc.detail), headers=headers)
    if isinstance(exc, _ENGINE_ERRORS):
        return from_engine_error(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        # the device could not hold the batch this request was in (PyTorch's allocator had already freed its cache
        # and retried). Sessions are written back only after a whole step, so nothing was lost; a retry may fit
        return ServiceUnavailableError("the model's device is out of memory; retry shortly",
                                       code="device_out_of_memory", headers={"Retry-After": "1"})
    return InternalServerError("internal server error")


def _bounded(text: str, limit: int = 200) -> str:
    """At most `limit` characters of something the client sent, for a message (never a 100 KB echo)."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route answers on the request's path (asked of each route, included routers too)."""
    routes = request.app.router.routes
    return [method for method in _METHODS
            if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)]


def from_engine_error(exc: Exception) -> APIError:
    """What the engine raised (one of _ENGINE_ERRORS), as the API answers it."""
    if isinstance(exc, EngineOverloaded):
        return RateLimitError(str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, SessionNotFound):
        return NotFoundError(str(exc), param="session_id", code="session_not_found")
    if isinstance(exc, EngineBudgetExceeded):
        # the request itself needs more than one may take (a retry needs as long again): the client's to change,
        # as a text over the size limit is (a 4xx, which clients do not retry; not a 503 or 504, which they may)
        return UnprocessableEntityError(str(exc), code="engine_budget_exceeded")
    if isinstance(exc, SessionConflict):
        # nothing of the request was applied (the store refused its write): safe to send again, and the SDK does
        return ConflictError(str(exc), param="session_id", code="session_conflict",
                             headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, SessionStoreFull):
        return ServiceUnavailableError(str(exc), code="session_store_full",
                                       headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, SessionStoreUnavailable):
        return ServiceUnavailableError(str(exc), code="session_store_unavailable",
                                       headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, SessionImportError):
        if exc.conflict:
            return ConflictError(str(exc), code="checkpoint_mismatch")
        return UnprocessableEntityError(str(exc), param=exc.param, code="invalid_session_export")
    if isinstance(exc, SessionsUnavailable):
        return ServiceUnavailableError(f"sessions are unavailable: {exc}", code="sessions_unavailable")
    return ServiceUnavailableError(str(exc), code="engine_unavailable")


async def handle_error(request: Request, exc: Exception) -> JSONResponse:
    """The one handler: every exception a request raises becomes an error response in the one shape."""
    if isinstance(exc, EngineUnavailable | SessionStoreUnavailable):
        # the cause (e.g. the Redis address) is for the operator's log, never for the client
        log.warning("%s %s: %s (%s)", request.method, request.url.path, exc, exc.__cause__)
    error = to_api_error(exc, request)
    metrics = getattr(request.app.state, "metrics", None)
    # why refused: capacity, a key's rate, an outage, or two replicas' work on one session at once
    if (error.status in (429, 503) or error.code == "session_conflict") and metrics is not None:
        metrics.observe_refusal(error.code or error.type)
    return error_response(error)


def install_error_handler(app: FastAPI) -> None:
    for exc_class in (APIError, RequestValidationError, StarletteHTTPException, *_ENGINE_ERRORS, Exception):
        app.add_exception_handler(exc_class, handle_error)


class UnexpectedErrorMiddleware(HTTPMiddleware):
    """Answers an unexpected exception with a 500 in the one shape and logs its traceback here.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then drops the
    connection, so a client that reuses it (keep-alive) would fail its next request. An exception
    after the response has started is re-raised: the connection must be closed mid-response.
    """

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            if started:
                raise
            if isinstance(exc, torch.OutOfMemoryError):  # answered with a 503; the engine logged where it ran out
                log.warning("%s %s: the device is out of memory", scope["method"], scope["path"])
            else:
                log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            response = await handle_error(Request(scope, receive), exc)
            await response(scope, receive, send)
