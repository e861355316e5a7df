"""Wire models of the HTTP API: pydantic only, no torch, so clients and load tests can import them.

Requests forbid unknown fields; responses may gain fields, so clients should ignore ones they do not know.
The OpenAI-compatible models (`Completion*`) use OpenAI's field names and accept its documented fields,
including some this server ignores.

Streams are server-sent events (`text/event-stream`), one JSON object per `data:` line:
- `POST /v1/generate`: `GenerateChunk`s, then one `GenerateDone`; or, on a failure after the stream
  started, a last `ErrorResponse`.
- `POST /v1/completions`: `CompletionResponse` chunks in OpenAI's `text_completion` shape (a choice's last
  chunk has its `finish_reason`; with `stream_options.include_usage`, a final chunk with no choices has the
  usage), then `data: [DONE]`; a failure after the start is an `ErrorResponse` before `[DONE]`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

__all__ = [
    "ERROR_TYPES", "CompletionChoice", "CompletionLogprobs", "CompletionRequest", "CompletionResponse", "ErrorBody",
    "ErrorResponse", "ErrorType", "FinishReason", "GenerateChunk", "GenerateDone", "GenerateRequest",
    "GenerateResponse", "HealthResponse", "ModelCard", "ModelList", "ReadyResponse", "ScoreRequest", "ScoreResponse",
    "StreamOptions", "Timings", "Usage",
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


FinishReason = Literal["length", "stop"]  # length: max_tokens bytes were generated; stop: a stop string appeared
# A stop string: generation ends where it first appears, and the text ends before it.
StopString = Annotated[str, Field(min_length=1, strict=True)]


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(strict=True, description="Text to continue, as its UTF-8 bytes; may be empty.")
    max_tokens: int | None = Field(default=None, ge=1, strict=True,
                                   description="Most bytes to generate (at most the server's limit); "
                                               "default 200, or the server's limit if lower.")
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False, strict=True,
                               description="0: always the most likely byte.")
    top_k: int = Field(default=0, ge=0, strict=True, description="Sample among the k most likely bytes; 0: off.")
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False, strict=True,
                         description="Nucleus sampling: the smallest set of bytes whose probability reaches top_p.")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, strict=True,
                             description="The same seed and parameters give the same text.")
    stop: list[StopString] = Field(default_factory=list, max_length=4,
                                   description="Up to 4 stop strings; the text ends before the first one that appears.")
    stream: bool = Field(default=False, strict=True, description="Send server-sent events as the text is generated.")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Prompt length in bytes (a token is a byte).")
    completion_tokens: int = Field(description="Bytes generated, stop strings included.")
    total_tokens: int


class GenerateResponse(BaseModel):
    text: str
    finish_reason: FinishReason
    usage: Usage


class GenerateChunk(BaseModel):
    """A stream event: the next piece of text (never part of a character: invalid bytes become U+FFFD)."""

    text: str


class Timings(BaseModel):
    first_token_seconds: float = Field(description="From the request's submission to the model to its first byte.")
    total_seconds: float = Field(description="From the request's submission to the model to its end.")


class GenerateDone(BaseModel):
    """The last stream event of a generation that did not fail."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings


def _one_or_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _string_or_list_schema(max_items: int) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [{"type": "string"},
                                     {"type": "array", "items": {"type": "string"}, "maxItems": max_items}]})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = Field(default=None, description="Send a last chunk with the usage and no choices.")
    include_obfuscation: bool | None = Field(default=None, description="Accepted and ignored.")


class CompletionRequest(BaseModel):
    """OpenAI's `POST /v1/completions` request. Accepted and ignored: presence_penalty, frequency_penalty,
    best_of, logit_bias, user (it will name a session)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(strict=True, description="The served model's id (GET /v1/models).")
    prompt: Annotated[list[str], BeforeValidator(_one_or_list), Field(min_length=1, max_length=1),
                      _string_or_list_schema(1)] = Field(description="A string, or a list of one string.")
    suffix: None = Field(default=None, description="Only null: insertion is not supported.")
    max_tokens: int | None = Field(default=16, ge=0, strict=True,
                                   description="0 with echo: score the prompt without generating.")
    temperature: float | None = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    n: int | None = Field(default=1, ge=1, strict=True, description="Choices to generate (choice i uses seed + i).")
    stream: bool | None = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5, strict=True,
                                 description="Per token, its log-probability and those of the most likely tokens.")
    echo: bool | None = Field(default=False, strict=True, description="Prepend the prompt (and its logprobs).")
    stop: Annotated[list[StopString], BeforeValidator(_one_or_list), Field(max_length=4),
                    _string_or_list_schema(4)] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    best_of: int | None = Field(default=None, ge=1, strict=True)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, strict=True)
    user: str | None = Field(default=None, strict=True)


class CompletionLogprobs(BaseModel):
    """One entry per token (a byte, shown decoded with errors="replace": bytes of a multibyte character are
    each U+FFFD). `text_offset` is the index in `text` of the character the byte starts or continues."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (the shapes are the same)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


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
