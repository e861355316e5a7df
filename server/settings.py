"""Server settings: the only module that reads the environment (`ADAPTLM_*`), validated at start.

    ADAPTLM_CHECKPOINT       checkpoint directory (default: <repo>/checkpoints/default)
    ADAPTLM_HOST, _PORT      where to listen (127.0.0.1:8000)
    ADAPTLM_MAX_TEXT_BYTES   longest text or prompt, in UTF-8 bytes, one request may send
    ADAPTLM_MAX_TOKENS       most bytes one request may generate (per choice)
    ADAPTLM_MAX_N            most choices (`n`) one completion request may ask for
    ADAPTLM_MAX_BODY_BYTES   largest request body; larger bodies are refused with 413 before parsing
    ADAPTLM_LOG_LEVEL        critical | error | warning | info | debug | trace
    ADAPTLM_API_KEYS         comma-separated keys; when set, /v1 routes need `Authorization: Bearer <key>`
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["DEFAULT_CHECKPOINT", "LogLevel", "Settings"]

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "default"

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ADAPTLM_", extra="forbid", frozen=True)

    checkpoint: Path = DEFAULT_CHECKPOINT
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=1, le=65535)
    max_text_bytes: int = Field(default=1_000_000, ge=1)
    max_tokens: int = Field(default=4096, ge=1)
    max_n: int = Field(default=8, ge=1)
    # JSON escapes can make a text's body several times its UTF-8 size (`\u00e9` is 6 bytes for 2).
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    log_level: LogLevel = "info"
    # NoDecode: the environment holds a comma list, not JSON.
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = ()

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> Self:
        if self.max_body_bytes < self.max_text_bytes:
            raise ValueError(f"max_body_bytes ({self.max_body_bytes}) must be at least max_text_bytes "
                             f"({self.max_text_bytes}), or the text limit could never be reached")
        return self
