"""Wire models of the HTTP API: pydantic only, no torch. The one source of them: the server validates requests and
answers with these (`server.protocol` re-exports them), and the SDK reads answers into them.

Requests forbid unknown fields; responses may gain fields, so clients should ignore ones they do not know.
The OpenAI-compatible models (`Completion*`) use OpenAI's field names and accept its documented fields; those
this server does not implement only with the value that changes nothing (any other is a 422, never ignored).

Streams are server-sent events (`text/event-stream`), one JSON object per `data:` line:
- `POST /v1/generate`: `GenerateChunk`s, then one `GenerateDone`; or, on a failure after the stream
  started, a last `ErrorResponse`.
- `POST /v1/completions`: `CompletionResponse` chunks in OpenAI's `text_completion` shape (a choice's last
  chunk has its `finish_reason`; with `stream_options.include_usage`, a final chunk with no choices has the
  usage), then `data: [DONE]`; a failure after the start is an `ErrorResponse` before `[DONE]`.

`GET /v1/sessions/{id}/state` answers, and `PUT` takes, `application/octet-stream`: a session export
(safetensors bytes with JSON metadata), not JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "ERROR_TYPES", "MAX_SEED", "SESSION_ID_MAX_LENGTH", "SESSION_ID_PATTERN", "AdaptationParams",
    "AdaptationSettings", "CompletionChoice",
    "CompletionLogprobs", "CompletionRequest", "CompletionResponse", "ErrorBody", "ErrorResponse", "ErrorType",
    "FinishReason", "GenerateChunk", "GenerateDone", "GenerateRequest", "GenerateResponse", "HealthResponse",
    "ModelCard", "ModelList", "ObserveRequest", "ObserveResponse", "ReadyResponse", "RequestModel",
    "ScoreRequest", "ScoreResponse",
    "SUGGEST_MAX_CONTEXT", "SessionCreateRequest", "SessionResponse", "SessionStatsBody", "StreamOptions",
    "SuggestRequest", "SuggestResponse", "SuggestedChar", "SuggestedWord", "Timings", "Usage",
]

# Every `error.type` the server sends; a client maps each to one exception class.
ErrorType = Literal[
    "invalid_request_error",  # 400: the body is not JSON, or otherwise unusable; on the OpenAI routes also what
    #                           is a 422 or a text's 413 elsewhere (errors.OPENAI_ROUTES); 400 malformed_http and
    #                           431 header_too_large for what the HTTP parser refuses, 408 for a client too slow
    "authentication_error",  # 401: missing or wrong API key
    "not_found_error",  # 404: no such route or resource (a session of another API key included)
    "method_not_allowed_error",  # 405
    "conflict_error",  # 409: a session export from another checkpoint, or (code session_conflict) a session changed by
    #                    another request while this one worked on it: nothing applied, retry after Retry-After
    "payload_too_large_error",  # 413: the body or the text is over the server's limit
    "validation_error",  # 422: the JSON does not match the schema; `param` names the field
    "rate_limit_error",  # 429: the work queue is full; retry after the Retry-After header's seconds
    "server_error",  # 500: a bug; the message says nothing more
    "service_unavailable_error",  # 503: the model is not loaded, the engine has stopped, or the session store is full
]
# What session ids look like (the server makes 32 characters; an import may name its own). A longer id is a 422
# wherever it is sent (path or body), so no answer ever echoes more than this many characters of one.
SESSION_ID_MAX_LENGTH = 128
SESSION_ID_PATTERN = rf"^[A-Za-z0-9_-]{{16,{SESSION_ID_MAX_LENGTH}}}$"
SessionId = Annotated[str, Field(min_length=1, max_length=SESSION_ID_MAX_LENGTH, strict=True,
                                 description="A session (POST /v1/sessions) of the same API key.")]
ERROR_TYPES: tuple[ErrorType, ...] = get_args(ErrorType)
# The largest seed (and, negated, the smallest a completion takes): 2**53 - 1, the largest integer a JSON number
# holds exactly in every client (JavaScript's Number.MAX_SAFE_INTEGER) and in the schema's `maximum`, which
# validators read as a float; 2**63 - 1 read as a float is 2**63, a seed the server would refuse.
MAX_SEED = 2**53 - 1


def _utf8(value: Any) -> None:
    """Raise pydantic's own `string_unicode` error for a string with no UTF-8 bytes (a lone surrogate, which JSON
    can spell `"\\ud800"`), anywhere in a field's value. pydantic refuses one only in fields with constraints."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError("string_unicode", "Input should be a valid string, unable to parse raw data "
                                                        "as a unicode string") from None
    elif isinstance(value, list | tuple):
        for item in value:
            _utf8(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _utf8(key)
            _utf8(item)


class RequestModel(BaseModel):
    """Base of our requests: unknown fields are refused, and every string (nested ones included) has UTF-8 bytes,
    so the serving layer's `.encode("utf-8")` cannot fail."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _text_is_utf8(cls, value: Any) -> Any:
        _utf8(value)
        return value


def _absent(value: object) -> bool:
    """An optional response field that is left out, not sent as null, when it has no value."""
    return value is None


class ScoreRequest(RequestModel):
    text: str = Field(min_length=1, strict=True, description="Text to score, as its UTF-8 bytes.")
    logprobs: bool = Field(default=False, strict=True, description="Also return each token's natural-log probability "
                                                                   "(a byte; a word model's word: GET /v1/models).")
    session_id: SessionId | None = Field(default=None, description="Score the text as the continuation of this "
                                                                   "session's stream, under its adapter.")
    adapt: bool = Field(default=False, strict=True,
                        description="With a session: score each segment, then adapt on it (the session keeps "
                                    "the adaptation). Without: the session is not changed.")


class ScoreResponse(BaseModel):
    model: str = Field(description="The checkpoint that scored the text.")
    bits: float = Field(description="Total information content of the text, in bits.")
    bytes: int = Field(description="Length of the text in UTF-8 bytes.")
    bits_per_byte: float | None = Field(description="bits / bytes; null when nothing was scored (a word session's "
                                                "`adapt` whose text only grew its pending word, as its observe).")
    logprobs: list[float] | None = Field(default=None, description=(
        "Natural-log probability of each token, if asked: one entry per token of the model's tokenizer (GET "
        "/v1/models `tokenizer`): a byte for a byte-level model, in the order of the text's UTF-8 bytes; for a "
        "word-level model a word, a punctuation character, an end of line or a run of other whitespace, with its "
        "one leading space (`token_texts` gives each one's text)."))
    session_id: str | None = Field(default=None, description="The session it was scored under, if any.")
    nonfinite_reset: bool = Field(default=False, description="The non-finite guard refused a weight update (or "
                                                             "reset the learned weights): the session kept its last "
                                                             "good values.")
    # a word-level model only: absent for a byte-level one (whose tokens are the bytes), whose answer stays as it was
    tokens: int | None = Field(default=None, exclude_if=_absent, description=(
        "Word-level model only: the text's tokens (words, punctuation, ends of line), the words of bits_per_word."))
    token_texts: list[str] | None = Field(default=None, exclude_if=_absent, description=(
        "Word-level model only, with `logprobs`: the text of each token those are of, as written in the text "
        "scored (its leading space included), so that joined they give that text: with a session, its pending text "
        "and then this text (`adapt`: up to the last word, which stays pending). A word the vocabulary lacks keeps "
        "its own letters; its log-probability is that of the unknown word, `<unk>` (as /v1/completions lists it)."))
    bits_per_word: float | None = Field(default=None, exclude_if=_absent,
                                        description="Word-level model only: bits / tokens.")
    perplexity: float | None = Field(default=None, exclude_if=_absent,
                                     description="Word-level model only: 2 ** bits_per_word.")


FinishReason = Literal["length", "stop"]  # length: max_tokens tokens were generated; stop: a stop string appeared
# A stop string: generation ends where it first appears, and the text ends before it.
StopString = Annotated[str, Field(min_length=1, strict=True)]


class GenerateRequest(RequestModel):
    prompt: str = Field(strict=True, description="Text to continue, as its UTF-8 bytes; may be empty.")
    max_tokens: int | None = Field(default=None, ge=1, strict=True,
                                   description="Most tokens to generate (bytes; a word model's words: GET "
                                               "/v1/models `tokenizer`), at most the server's limit; default 200, "
                                               "or the server's limit if lower.")
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False, strict=True,
                               description="0: always the most likely token.")
    top_k: int = Field(default=0, ge=0, strict=True, description="Sample among the k most likely tokens; 0: off.")
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False, strict=True,
                         description="Nucleus sampling: the smallest set of tokens whose probability reaches "
                                     "top_p.")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, strict=True,
                             description="The same seed and parameters give the same text.")
    stop: list[StopString] = Field(default_factory=list, max_length=4,
                                   description="Up to 4 stop strings; the text ends before the first one that appears.")
    stream: bool = Field(default=False, strict=True, description="Send server-sent events as the text is generated.")
    session_id: SessionId | None = Field(default=None, description="Continue this session's stream, with its "
                                                                   "adapter; the session is not changed unless "
                                                                   "`adapt_while_generating`.")
    adapt_while_generating: bool = Field(default=False, strict=True,
                                         description="With a session: once generated, the session observes the "
                                                     "prompt and the text of the answer, as sent (a stop string "
                                                     "left out; thesis sec. 4.3).")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Prompt length in the model's tokens (GET /v1/models `tokenizer`: bytes, "
                                           "or a word model's words).")
    completion_tokens: int = Field(description="Tokens generated, stop strings included.")
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


def _text_prompts(value: Any) -> Any:
    """A string or a list of strings; OpenAI's token arrays are refused by name (their ids are another model's
    tokens, and this server's are bytes or its own words: text is the one unambiguous form)."""
    value = _one_or_list(value)
    if isinstance(value, list) and any(isinstance(item, int | list) for item in value):
        raise PydanticCustomError("token_prompt_unsupported", "token arrays are not supported; send the prompt as "
                                                              "text (a string or a list of strings)")
    return value


def _string_or_list_schema(*, min_items: int = 0, max_items: int | None = None) -> WithJsonSchema:
    array: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
    if min_items:
        array["minItems"] = min_items
    if max_items is not None:
        array["maxItems"] = max_items
    return WithJsonSchema({"anyOf": [{"type": "string"}, array]})


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(default=None, description="Send a last chunk with the usage and no choices.")
    include_obfuscation: bool | None = Field(default=None, description="Accepted and ignored.")


def _unsupported(field: str, allowed: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", f"{field} is not supported by this server; send {allowed} "
                                                    "or leave it out")


class CompletionRequest(RequestModel):
    """OpenAI's `POST /v1/completions` request. Fields this server does not implement are accepted only with the
    value that changes nothing (presence_penalty and frequency_penalty 0, logit_bias empty, best_of equal to n);
    any other value is a 422 `unsupported_value`, never silently ignored. `user` may name a session (see its
    description)."""

    model: str = Field(strict=True, description="The served model's id (GET /v1/models).")
    prompt: Annotated[list[str], BeforeValidator(_text_prompts), Field(min_length=1),
                      _string_or_list_schema(min_items=1)] = Field(description=(
        "A string, or a list of strings: `n` choices of each, prompt p's choice j at index p * n + j (at "
        "most the server's max_n choices in all). Token arrays are refused: send text."))
    suffix: None = Field(default=None, description="Only null: insertion is not supported.")
    max_tokens: int | None = Field(default=16, ge=0, strict=True,
                                   description="0 with echo: score the prompt without generating.")
    temperature: float | None = Field(default=1.0, ge=0, le=2, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(default=1.0, ge=0, le=1, allow_inf_nan=False, strict=True,
                                description="0 (OpenAI allows it): only the most likely token, as temperature 0.")
    n: int | None = Field(default=1, ge=1, strict=True,
                         description="Choices to generate of each prompt (choice i of the response uses seed + i).")
    stream: bool | None = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5, strict=True,
                                 description="Per token, its log-probability and those of the most likely tokens.")
    echo: bool | None = Field(default=False, strict=True, description="Prepend the prompt (and its logprobs).")
    stop: Annotated[list[StopString], BeforeValidator(_one_or_list), Field(max_length=4),
                    _string_or_list_schema(max_items=4)] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False, strict=True,
                                           description="Only 0 (or null): penalties are not implemented.")
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False, strict=True,
                                            description="Only 0 (or null): penalties are not implemented.")
    best_of: int | None = Field(default=None, ge=1, strict=True,
                                description="Only n (or null): no candidates are generated beyond the n returned.")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False, strict=True)]] | None = Field(
        default=None, description="Only empty (or null): biases are not implemented.")
    seed: int | None = Field(default=None, ge=-MAX_SEED, le=MAX_SEED, strict=True,
                             description="The same request and seed give the same choices: choice i (prompt p's "
                                         "choice j is i = p * n + j) samples from seed + i.")
    user: str | None = Field(default=None, strict=True,
                             description="The id of one of your sessions (POST /v1/sessions): the prompt then "
                                         "continues that session's text under its adapter, and the session is left "
                                         "unchanged (echo + logprobs score the prompt as the adapted session "
                                         "does). Any other value is an end-user identifier, accepted and ignored.")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value:
            raise _unsupported(str(info.field_name), "0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias", "an empty object")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # as OpenAI answers: options of nothing
            raise PydanticCustomError("stream_options_without_stream", "stream_options is only allowed with stream: "
                                      "true")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1  # `n` is validated first (declared before); absent if it was invalid
        if value is not None and "n" in info.data and value != n:
            if value < n:
                raise PydanticCustomError("best_of_below_n", "best_of must be at least n")
            raise _unsupported("best_of above n", "best_of equal to n")
        return value


class CompletionLogprobs(BaseModel):
    """One entry per token of the model (GET /v1/models `tokenizer`): a byte, shown decoded with errors="replace"
    (bytes of a multibyte character are each U+FFFD); or a word model's word, punctuation character, end of line or
    whitespace run, shown as its vocabulary entry with its leading space (an unknown prompt word: "<unk>").
    `text_offset` is the index in `text` of the character the token starts or continues."""

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


class AdaptationParams(RequestModel):
    """A session's memories and their settings; what is left out comes from the checkpoint. The settings' ranges are
    the memories' own (models/memory.py), checked when the session is made (a 422 naming the field)."""

    memories: dict[str, dict[str, Any] | None] | None = Field(
        default=None, description="Settings of the session's memories by name (the model's are listed in a "
                                  "session's `adaptation.memories`): an object of settings to change, or null to "
                                  "turn the memory off. The fields below are shorthands for the shipped memories'.")
    lr: float | None = Field(default=None, strict=True, description=(
        "Learning rate eta, in [0, 1e4], of the weights the session learns: the checkpoint's default weight-learning "
        "memory (memories.head.lr, the output rows' delta, where it takes the sparse adapter's place; else "
        "memories.adapter.lr). 0: no weight learning (the output rows' delta is then off; M stays at rate 0)."))
    decay: float | None = Field(default=None, strict=True, description=(
        "Decay lambda, in [0, 1], of those weights towards the unadapted model (memories.head.decay or "
        "memories.adapter.decay, as lr)."))
    adapter_size: int | None = Field(default=None, strict=True,
                                     description="k >= 1: M is k x k on the first k units of the adaptation site "
                                                 "(at most the site's units; memories.adapter.size).")
    cache_weight: float | None = Field(default=None, strict=True,
                                       description="Weight in [0, 1] of the session's word cache (the words it "
                                                   "observed) mixed into keyboard suggestions; 0 turns it off "
                                                   "(memories.words.weight).")
    neural_cache: bool | None = Field(default=None, strict=True,
                                      description="Mix the neural cache (Grave et al. 2017: the session's recent "
                                                  "hidden states and the tokens that followed them) into every "
                                                  "prediction of the session, with the checkpoint's window, theta "
                                                  "and lambda; it takes the copy model's place (memories.cache).")
    copy_model: bool | None = Field(default=None, strict=True,
                                    description="Mix the session's copy model (what it observed that repeats) into "
                                                "its predictions, where the checkpoint has one (the default). False: "
                                                "the network alone; with lr 0 and cache_weight 0, the unadapted "
                                                "model, scoring its static bits exactly (memories.copy).")


class AdaptationSettings(BaseModel):
    memories: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                description="The session's memories that are on, with their settings.")
    lr: float = Field(description="The learning rate of the weights the session learns: of the memory the request's "
                                  "`lr` sets (head or adapter), else of M where the session has M instead; 0 with "
                                  "neither.")
    decay: float = Field(description="Their decay (as lr).")
    adapter_size: int = Field(description="k of the sparse adapter M (0 where M is off).")
    rule: str = Field(description="The checkpoint's update rule (sgd, sgd_decay, rms, rms_decay).")
    eps: float
    segment: int = Field(description="Tokens scored per update (bytes; a word model's words: GET /v1/models "
                                     "`tokenizer`).")
    cache_weight: float = Field(default=0.0, description="Weight of the word cache in keyboard suggestions.")
    neural_cache: bool = Field(default=False, description="Whether the session mixes in the neural cache.")
    copy_model: bool = Field(default=False, description="Whether the session mixes in a copy model (the checkpoint "
                                                        "has one, the session did not turn it off, and it keeps no "
                                                        "neural cache).")


class SessionCreateRequest(RequestModel):
    initial_text: str | None = Field(default=None, min_length=1, strict=True,
                                     description="Text for the new session to observe first.")
    ttl_s: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True,
                                description="Seconds the session lives after its last use (server default and "
                                            "maximum apply).")
    adaptation: AdaptationParams | None = None


class ObserveRequest(RequestModel):
    text: str = Field(min_length=1, strict=True, description="Text the session reads next, as its UTF-8 bytes.")


class ObserveResponse(BaseModel):
    """A text's cost under the session, each segment scored before the session adapted on it. A word model's
    session scores the words whose tokens are settled: the session's pending text and this text, up to the last
    word, which may go on and stays pending (with the gap before it); `bits`, `bytes` and `tokens` are of what this
    call scored. A byte model's session scores the text as sent."""

    bits: float = Field(description="Bits of the text scored in this call (a word session: its pending text and "
                                    "this one, but for the new pending tail).")
    bytes: int = Field(description="UTF-8 bytes scored in this call (0: a word session's text only grew its "
                                   "pending word).")
    bits_per_byte: float | None = Field(description="bits / bytes; null when nothing was scored.")
    static_bits: float = Field(description="The same text's bits under the unadapted model (same context).")
    static_bits_per_byte: float | None = Field(description="static_bits / bytes; null when nothing was scored.")
    tokens: int = Field(default=0, description="Tokens scored: bytes, or a word model's words.")
    pending_bytes: int = Field(default=0, description="Bytes the session holds pending after this call (a word "
                                                      "model's unfinished last word; always 0 for bytes).")
    updates: int = Field(description="Weight updates applied: one per segment by each memory that learns "
                                     "weights (the output rows' delta, the sparse adapter M).")
    nonfinite_reset: bool = Field(description="The non-finite guard refused a weight update (or reset the learned "
                                              "weights); the session kept its last good values.")


class SessionStatsBody(BaseModel):
    bytes_observed: int
    updates: int = Field(description="Weight updates applied (`ObserveResponse.updates`, summed).")
    nonfinite_resets: int = Field(description="Weight updates the non-finite guard refused, and resets of the "
                                              "learned weights by the divergence guard.")
    bits: float = Field(description="Bits of everything observed, each segment scored before adapting on it.")
    bits_per_byte: float | None = Field(description="bits / bytes_observed; null before any text.")
    static_bits: float = Field(description="Bits of the same text under the unadapted model.")
    static_bits_per_byte: float | None
    gain_over_static: float | None = Field(description="1 - bits / static_bits: the running gain of adaptation.")
    pending_bytes: int = Field(default=0, description=(
        "Bytes read but not yet scored (a word session's last word, which may go on; 0 for a byte model): "
        "bytes_observed + pending_bytes is every UTF-8 byte the session has read, which tells a client whose observe "
        "got no answer whether it was read."))


class SessionResponse(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    created: float = Field(description="Unix time.")
    last_used: float = Field(description="Unix time.")
    expires_at: float = Field(description="Unix time, unless it is used again before.")
    ttl_s: float
    adaptation: AdaptationSettings
    state_bytes: int = Field(description="Bytes of tensors the session holds (states and adapter).")
    stats: SessionStatsBody
    observed: ObserveResponse | None = Field(default=None, description="Creation: what `initial_text` cost.")


# Characters of `context` a suggestion takes: the message being typed, not a document (the session holds the
# history); the first keystroke of a context feeds all of it, later ones only what they add. Of a longer message
# the model reads only about the last 256 bytes (server/engine/_suggest.py, SUGGEST_FEED_BYTES).
SUGGEST_MAX_CONTEXT = 2048


class SuggestRequest(RequestModel):
    """Keyboard suggestions for a session: what the user has typed so far in the current message."""

    context: str = Field(default="", max_length=SUGGEST_MAX_CONTEXT, strict=True,
                         description="The text typed so far in the current message (may be empty); it continues the "
                                     "session's text and does not change the session (of a long one, only about the "
                                     "last 256 UTF-8 bytes are read). The word being completed is its end after the "
                                     "last space or punctuation (empty after one: the next word; after punctuation "
                                     "or a symbol, also after a space the keyboard inserts: `space_before`).")
    k: int = Field(default=3, ge=1, le=10, strict=True, description="Word completions to return.")
    max_chars: int = Field(default=24, ge=1, le=64, strict=True,
                           description="The most characters a completion may add to the typed part of the word.")
    n_chars: int = Field(default=5, ge=0, le=32, strict=True, description="Most likely next characters to return.")


class SuggestedWord(BaseModel):
    text: str = Field(description="The whole word: the typed part and its completion (no space or punctuation).")
    prob: float = Field(description="Probability that the word continues so and then ends (a space or ASCII "
                                    "punctuation follows), given the session and the context (the session's word "
                                    "cache mixed in); with `space_before`, that a space, then the word, follows. "
                                    "Only the ranking applies a byte model's lexicon prior: this number is not scaled "
                                    "by it.")
    space_before: bool = Field(default=False, description=(
        "Insert a space before `text`: the word begins after a space the user has not typed. Offered only where "
        "nothing of the word is typed and `context` ends in a character that is neither a letter, digit or apostrophe "
        "nor whitespace (\"Hi,\" \"Done.\" an emoji): there the next word may follow directly (after \"(\") or "
        "after a space (after \"Hi,\": \" there\"), and both kinds compete on `prob`. False: `text` continues "
        "`context` as it is."))


class SuggestedChar(BaseModel):
    char: str = Field(description="A whole character (a UTF-8 lead byte's most likely character, for non-ASCII).")
    prob: float = Field(description="Its probability as the next character.")


class SuggestResponse(BaseModel):
    prefix: str = Field(description="The typed part of the word the completions continue (may be empty).")
    completions: list[SuggestedWord] = Field(description=(
        "The k best completions, best first; fewer when fewer have probability >= 0.001. Best: most probable, but "
        "with a byte model whose checkpoint has a lexicon (lexicon.txt) a word neither in it nor typed by the "
        "session ranks as if 0.1 times as probable, so `prob` need not decrease down the list."))
    next_chars: list[SuggestedChar] = Field(description="The most likely next characters, most likely first.")
    exact: bool = Field(default=True, description="False when the server's time budget (ADAPTLM_SUGGEST_BUDGET_MS) "
                                                  "stopped the word search: the completions are then the best found "
                                                  "in time, possibly fewer or not the most probable.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time the weights were written.")
    owned_by: str = "adaptlm"
    tokenizer: str = Field(default="bytes", description=(
        "What a token is: `bytes` (token ids are byte values) or `words` (a vocabulary of words, punctuation and "
        "ends of line, each with its one leading space). Token counts (`max_tokens`, usage, logprobs) count these."))
    vocab_size: int = Field(default=256, description="Tokens in the model's vocabulary.")


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
