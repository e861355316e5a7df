"""Server settings: the only module that reads the environment (`ADAPTLM_*`), validated at start.

    ADAPTLM_CHECKPOINT       checkpoint directory (default: <repo>/checkpoints/default)
    ADAPTLM_HOST, _PORT      where to listen (127.0.0.1:8000)
    ADAPTLM_MAX_TEXT_BYTES   longest text or prompt, in UTF-8 bytes, one request may send
    ADAPTLM_MAX_TOKENS       most bytes one request may generate (per choice)
    ADAPTLM_MAX_N            most choices (`n`) one completion request may ask for
    ADAPTLM_MAX_BODY_BYTES   largest request body; larger bodies are refused with 413 before parsing
    ADAPTLM_LOG_LEVEL        critical | error | warning | info | debug | trace
    ADAPTLM_LOG_FORMAT       text (default) | json: one JSON object a line (time, level, logger, message, request_id;
                             an access line also client, method, path, status), for log collectors
    ADAPTLM_API_KEYS         comma-separated keys; when set, /v1 routes need `Authorization: Bearer <key>`
    ADAPTLM_CORS_ORIGINS     comma-separated origins (`https://app.example.com`) whose pages may call the API from a
                             browser (CORS); unset: none but the server's own (its /keyboard page)
    ADAPTLM_RATE_LIMIT_PER_S requests a second each API key may make to /v1 routes (a token bucket; 0: no limit,
                             the default); beyond it, 429 with Retry-After. Without keys, all clients share one
    ADAPTLM_RATE_LIMIT_BURST requests a key may make at once after being idle (the bucket's size; default 2 s' worth)
    ADAPTLM_MAX_BATCH        rows per batched model call (a session observe takes two: adapted and static)
    ADAPTLM_MAX_WAIT_MS      coming from idle, how long the engine waits for more work to fill a batch
    ADAPTLM_MAX_QUEUE        requests for model work a server holds at once (waiting or running; each HTTP worker its
                             share), and work items the engine lets wait; beyond it, 429 with Retry-After
    ADAPTLM_RETRY_AFTER_S    the Retry-After of a 429 (and of a 503 for a full session store)
    ADAPTLM_MAX_SESSIONS     sessions kept in memory; the least recently used idle one (of a key over its share,
                             below) makes room
    ADAPTLM_SESSION_MEMORY_BYTES   tensor bytes all sessions may hold (state, static state, adapter)
    ADAPTLM_MAX_SESSIONS_PER_KEY, ADAPTLM_SESSION_MEMORY_BYTES_PER_KEY   one API key's share of the two limits above
                             (default: the limit divided by the number of keys): when the store is full, only keys
                             over their share give up idle sessions, so that no key can push out another's within
                             its share (not a quota: a key may hold more while the store has room)
    ADAPTLM_SESSION_TTL_S    a session's default time to live after its last use
    ADAPTLM_MAX_SESSION_TTL_S      the longest `ttl_s` a client may ask for
    ADAPTLM_KERNELS          auto (default: Triton on CUDA when it is installed) | triton | reference
    ADAPTLM_ATTENTION_TUNING how the Triton attention kernels run on a GPU, never what they compute
                             (kernels.attention.Tuning: `shipped` (default) or `splits=N`, the forward's key splits,
                             0 by the GPU's SM count); the kernels' implementation itself is ADAPTLM_KERNELS
    ADAPTLM_SESSION_STORE    where sessions live: `memory` (this process; lost when it ends) or a Redis URL
                             `redis://[:password@]host:port/db` (`rediss://` for TLS): shared by every server
                             using it, kept across restarts; the session limits above are then the shared store's
    ADAPTLM_SESSION_SNAPSHOT the memory store's file: written at shutdown, read back at start (unset: sessions end
                             with the process)
    ADAPTLM_KEEP_ALIVE_S     how long an idle keep-alive connection stays open (75)
    ADAPTLM_CLIENT_TIMEOUT_S how long a request's head may take to arrive, and its body may stall between two reads
                             (30); then 408 and the connection is closed (slow clients, slowloris)
    ADAPTLM_SUGGEST_BUDGET_MS  a keyboard suggestion's time budget from its arrival at the engine (50; 0: none)
    ADAPTLM_MAX_REQUEST_ENGINE_S   the engine time (its share of model calls) one request may take (60; 0: none);
                             beyond it, its work stops and it answers 422 `engine_budget_exceeded` (OpenAI routes: 400)
    ADAPTLM_READY_STALL_S    /readyz answers 503 `engine_stalled` while the engine has made no progress for this
                             long with work waiting or running (30; 0: never)
    ADAPTLM_PRECISION        auto (default) | float32 | bfloat16: the model work's precision
    ADAPTLM_DEVICE           auto (default: CUDA when present, else the CPU) | cpu | cuda | cuda:N
    ADAPTLM_CUDA_GRAPHS      auto (default: on a CUDA device) | on | off: the mLSTM's inference step in bucketed
                             static shapes, captured once per shape as a CUDA graph and replayed (models/step_graphs.py;
                             `on` on a CPU runs the same padded path eagerly, which only costs there)
    ADAPTLM_SESSION_SLOTS    observed sessions kept on the model's device between requests, gathered by index into
                             each batched step (server/engine/_slots.py): a count (0: off); unset: 4096 on a CUDA
                             device, off on a CPU (no gain measured there: docs/operations.md)
    ADAPTLM_SUGGEST_ON_DEVICE  auto (default: on a CUDA device) | on | off: the keyboard's word searches as tensors
                             on the model's device, with no host read a round (models/device_search.py)
    ADAPTLM_WORKERS          HTTP worker processes (0, the default: the HTTP server and the engine share one process);
                             N >= 1: `adaptlm serve` runs the engine in its own process and N uvicorn processes that
                             parse, check and answer requests and send the work to it (server/engine/_remote.py)
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, RedisDsn, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from models.device import DEVICE_PATTERN
from models.precision import Precision

__all__ = ["DEFAULT_CHECKPOINT", "TOOLS_VARIABLES", "LogLevel", "Settings", "ignored_variables"]

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "default"

_ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|\*")  # a browser's Origin header, or * (any)
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
    # Idle keep-alive connections are closed after this long (uvicorn's timeout_keep_alive, 5 s by default). It
    # must outlast clients' own expiry (httpx: 5 s; nginx upstreams: 60 s), or a client may send a request on a
    # connection the server is closing at that moment and read a reset (`httpx.ReadError`).
    keep_alive_s: int = Field(default=75, ge=1, le=3600)
    # A request's head must arrive within it, and its body not stall longer between two reads (nginx's
    # client_header_timeout and client_body_timeout): uvicorn alone waits forever.
    client_timeout_s: float = Field(default=30.0, gt=0, le=3600, allow_inf_nan=False)
    log_level: LogLevel = "info"
    log_format: Literal["text", "json"] = "text"
    # NoDecode: the environment holds a comma list, not JSON.
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = ()
    # Browser pages of these origins may call the API (CORS); an origin is scheme://host[:port], no path.
    cors_origins: Annotated[tuple[str, ...], NoDecode] = ()
    rate_limit_per_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    rate_limit_burst: int | None = Field(default=None, ge=1)  # None: twice the rate (at least 1)
    # rows per batched text step; an observe takes two (the session and its static shadow): 64 runs 32 sessions
    # at once (throughput is flat beyond: compute-bound; docs/notes/2026-11-benchmarks-history.md)
    max_batch: int = Field(default=64, ge=1)
    max_wait_ms: float = Field(default=2.0, ge=0, le=1000, allow_inf_nan=False)
    max_queue: int = Field(default=256, ge=1)
    retry_after_s: int = Field(default=1, ge=1)
    max_sessions: int = Field(default=10_000, ge=1)
    session_memory_bytes: int = Field(default=1 << 30, ge=1)
    # None: an equal share of the store for each API key (all of it without keys): see `session_share`
    max_sessions_per_key: int | None = Field(default=None, ge=1)
    session_memory_bytes_per_key: int | None = Field(default=None, ge=1)
    session_ttl_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    max_session_ttl_s: float = Field(default=7 * 86400.0, gt=0, allow_inf_nan=False)
    # A keyboard suggestion's word search stops this long after the request reached the engine and answers with
    # the best completions found so far (0: no budget, always the exact top k).
    suggest_budget_ms: float = Field(default=50.0, ge=0, le=60_000, allow_inf_nan=False)
    # The engine time one request may take: its share of the model calls its work took part in (its text, its
    # prompts' reading, its tokens; a batched call divided among its rows); then it stops, and answers 422 (0: no
    # limit). It bounds what one request can take from the others (a client that waits forever for a huge prompt).
    max_request_engine_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    # /readyz fails while the engine has had work waiting or running and made no progress for this long (a worker
    # round takes one text segment, prompt chunk or token: well under a second on the CPU); 0: never.
    ready_stall_s: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    # The model work's precision (models/precision.py): "bfloat16" runs the recurrent matmuls in bf16 (about 2x
    # faster at 8-64 rows where the CPU has AVX-512 BF16 or AMX; bits within about 1e-4 relative on the default
    # model), "float32" is exact, "auto" is bfloat16 where the hardware multiplies it natively, else float32.
    precision: Precision = "auto"
    # torch's intra-op threads in the process that runs the model (None: 1, unless OMP_NUM_THREADS is set, then
    # torch's own default from it). One by default: OpenMP threads spin at every barrier, and on a host where
    # anything else runs (the HTTP event loop, a balancer, another replica) one descheduled thread stalls the
    # others: 32 observes took over 240 s with 2 threads on 2 busy cores against 40-47 s with 1, where on idle cores
    # 2 were 1.1-1.3x faster (docs/benchmarks.md, "Latency and throughput"). Raise it on a host where nothing else runs.
    threads: int | None = Field(default=None, ge=1, le=1024)
    # Where the model runs (models/device.py): auto (CUDA when present, else the CPU), cpu, cuda or cuda:N.
    device: str = Field(default="auto", pattern=DEVICE_PATTERN)
    # The mLSTM's inference step in bucketed static shapes, replayed as CUDA graphs (models/step_graphs.py): auto
    # (on a CUDA device only), on (a CPU runs the padded path eagerly) or off.
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    # Observed sessions' tensors kept on the device between requests (server/engine/_slots.py): how many sessions
    # (0: off; None: the device's default, server.engine._slots.SLOTS_CUDA on CUDA, SLOTS_CPU on a CPU).
    session_slots: int | None = Field(default=None, ge=0, le=1 << 20)
    # The keyboard's word searches on the model's device (models/device_search.py): auto is on with CUDA only (on a
    # CPU the host's search is faster: docs/notes/2026-11-30-device-search.md).
    suggest_on_device: Literal["auto", "on", "off"] = "auto"
    # How the Triton attention kernels run (kernels.attention.Tuning; "": the shipped, GPU-verified kernel).
    attention_tuning: str = ""
    # Which kernels run on CUDA (kernels/_dispatch.py, which reads the same variable): auto, triton or reference.
    kernels: str = "auto"
    # repr=False: a Redis URL may carry a password
    session_store: Literal["memory"] | RedisDsn = Field(default="memory", repr=False)
    # The memory store's file: written at shutdown, read back at start-up (None: sessions end with the process).
    session_snapshot: Path | None = None
    # With Redis: bytes of session blobs a server keeps of the sessions it serves (at most max_sessions of them), so
    # that a read whose record has not changed since costs its revision, not its blob (0: keep none).
    session_cache_bytes: int = Field(default=256 << 20, ge=0)
    # HTTP worker processes in front of an engine process of their own (0: one process serves both).
    workers: int = Field(default=0, ge=0, le=64)

    def session_share(self) -> tuple[int, int]:
        """The sessions and bytes of one API key that another key's new sessions never evict. By default an equal
        share, so that the shares add up to no more than the store: a key creating sessions in a loop evicts only
        its own, never another key's within its share (the store's LRU eviction alone would let one key push out
        everyone's)."""
        keys = max(1, len(self.api_keys))
        return (self.max_sessions_per_key or max(1, self.max_sessions // keys),
                self.session_memory_bytes_per_key or max(1, self.session_memory_bytes // keys))

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

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = tuple(origin.strip() for origin in value.split(",") if origin.strip())
        for origin in value:
            if not isinstance(origin, str) or not _ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], no path or trailing slash)")
        return value

    @field_validator("attention_tuning")
    @classmethod
    def _attention_tuning(cls, value: str) -> str:
        from kernels.attention import Tuning

        Tuning.parse(value)  # its ValueError names the bad part
        return value

    @field_validator("kernels")
    @classmethod
    def _kernels(cls, value: str) -> str:
        from kernels._dispatch import choose_implementation

        choose_implementation(value)  # "triton" where it cannot run is refused here, not at the model's load
        return value

    @field_validator("session_store")
    @classmethod
    def _redis_database(cls, value: Literal["memory"] | RedisDsn) -> Literal["memory"] | RedisDsn:
        if isinstance(value, RedisDsn) and not (value.path or "/0").removeprefix("/").isdigit():
            raise ValueError("the Redis URL's path must be a database number, e.g. redis://localhost:6379/0")
        return value

    @model_validator(mode="after")
    def _check_limits(self) -> Self:
        if self.max_body_bytes < self.max_text_bytes:
            raise ValueError(f"max_body_bytes ({self.max_body_bytes}) must be at least max_text_bytes "
                             f"({self.max_text_bytes}), or the text limit could never be reached")
        if self.session_snapshot is not None and self.session_store != "memory":
            raise ValueError("session_snapshot is for the memory store; a Redis store keeps its sessions itself")
        if self.session_ttl_s > self.max_session_ttl_s:
            raise ValueError(f"session_ttl_s ({self.session_ttl_s}) must be at most max_session_ttl_s "
                             f"({self.max_session_ttl_s})")
        return self


# ADAPTLM_* variables of the tools beside the server (the client CLI's key, the load and soak tests', the tests'),
# and the prefixes of their families as the docs name them (ADAPTLM_LOADTEST_*)
TOOLS_VARIABLES = re.compile(r"ADAPTLM_(API_KEY|LOADTEST(_\w+)?|SOAK(_\w+)?|TEST_\w+|CRASH_\w+|DATA)")


def ignored_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """One message for each ADAPTLM_* variable in `environ` that is no setting of the server (nor a tool's), so
    that a misspelt one (ADAPTLM_MAX_SESSION=...) is said at start-up instead of silently not applying."""
    names = [f"ADAPTLM_{field.upper()}" for field in Settings.model_fields]
    messages = []
    for name in sorted(environ):
        if name.startswith("ADAPTLM_") and name not in names and not TOOLS_VARIABLES.fullmatch(name):
            close = difflib.get_close_matches(name[8:], [n[8:] for n in names], n=1, cutoff=0.7)  # past the prefix
            messages.append(f"{name} is not a setting of the server and is ignored"
                            + (f" (did you mean ADAPTLM_{close[0]}?)" if close else ""))
    return messages
