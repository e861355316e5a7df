"""Wire models of the HTTP API: pydantic only, no torch, so clients and load tests can import them.

Requests forbid unknown fields; responses may gain fields, so clients should ignore ones they do not know.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ERROR_TYPES", "ErrorBody", "ErrorResponse", "ErrorType", "HealthResponse", "ModelCard", "ModelList",
    "ReadyResponse", "ScoreRequest", "ScoreResponse",
]

# Every `error.type` the server sends; a client maps each to one exception class.
ErrorType = Literal[
    "invalid_request_error",  # 400: the body is not JSON, or otherwise unusable
    "authentication_error",  # 401: missing or wrong API key
    "not_found_error",  # 404: no such route or resource
    "method_not_allowed_error",  # 405
    "payload_too_large_error",  # 413: the body or the text is over the server's limit
    "validation_error",  # 422: the JSON does not match the schema; `param` names the field
    "server_error",  # 500: a bug; the message says nothing more
    "service_unavailable_error",  # 503: the model is not loaded or the engine has stopped
]
ERROR_TYPES: tuple[ErrorType, ...] = get_args(ErrorType)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # pydantic refuses a lone surrogate (`"\ud800"`) here, so the text always has UTF-8 bytes.
    text: str = Field(min_length=1, strict=True, description="Text to score, as its UTF-8 bytes.")
    logprobs: bool = Field(default=False, strict=True, description="Also return each byte's natural-log probability.")


class ScoreResponse(BaseModel):
    model: str = Field(description="The checkpoint that scored the text.")
    bits: float = Field(description="Total information content of the text, in bits.")
    bytes: int = Field(description="Length of the text in UTF-8 bytes.")
    bits_per_byte: float = Field(description="bits / bytes.")
    logprobs: list[float] | None = Field(default=None, description="Natural-log probability of each byte, if asked.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the weights were written.")
    owned_by: str = "adaptlm"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready"] = "ready"
    model: str


class ErrorBody(BaseModel):
    message: str
    type: ErrorType
    param: str | None = Field(default=None, description="The request field at fault, dotted for nested fields.")
    code: str | None = Field(default=None, description="A machine-readable reason, finer than `type`.")


class ErrorResponse(BaseModel):
    error: ErrorBody
