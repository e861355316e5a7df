"""Size limits: the text limit (bytes, after UTF-8 encoding) and the body limit (before parsing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import Settings

MAX_TEXT = 16
MAX_BODY = 256


@pytest.fixture(scope="module")
def small(tiny_checkpoint: Path, serve_app: Any) -> Iterator[httpx.Client]:
    settings = Settings(checkpoint=tiny_checkpoint, max_text_bytes=MAX_TEXT, max_body_bytes=MAX_BODY)
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def test_text_at_the_limit_is_scored(small: httpx.Client) -> None:
    r = small.post("/v1/score", json={"text": "x" * MAX_TEXT})
    assert r.status_code == 200
    assert r.json()["bytes"] == MAX_TEXT


def test_text_over_the_limit_in_bytes_is_413(small: httpx.Client, assert_error: Any) -> None:
    text = "é" * (MAX_TEXT // 2 + 1)  # fewer characters than the limit, more bytes
    assert len(text) < MAX_TEXT < len(text.encode())
    error = assert_error(small.post("/v1/score", json={"text": text}), 413, "payload_too_large_error", "text")
    assert error["code"] == "text_too_long"


@pytest.mark.parametrize(("path", "status", "type_", "code"), [
    ("/v1/generate", 413, "payload_too_large_error", "text_too_long"),
    ("/v1/completions", 400, "invalid_request_error", "context_length_exceeded"),  # OpenAI's answer
])
def test_prompt_over_the_limit_in_bytes_is_refused(small: httpx.Client, assert_error: Any, path: str, status: int,
                                                   type_: str, code: str) -> None:
    fields: dict[str, Any] = {"max_tokens": 1}
    if path == "/v1/completions":
        fields["model"] = small.get("/v1/models").json()["data"][0]["id"]
    assert small.post(path, json={"prompt": "é" * (MAX_TEXT // 2), **fields}).status_code == 200
    r = small.post(path, json={"prompt": "é" * (MAX_TEXT // 2 + 1), **fields})
    error = assert_error(r, status, type_, "prompt")
    assert error["code"] == code and f"at most {MAX_TEXT}" in error["message"]


def test_body_over_the_limit_is_413(small: httpx.Client, assert_error: Any) -> None:
    body = json.dumps({"text": "x" * MAX_BODY}).encode()
    r = small.post("/v1/score", content=body, headers={"content-type": "application/json"})
    assert assert_error(r, 413, "payload_too_large_error")["code"] == "body_too_large"


def test_body_over_the_limit_is_413_on_the_openai_route_too(small: httpx.Client, assert_error: Any) -> None:
    """A body over ADAPTLM_MAX_BODY_BYTES is refused before routing, whatever the route: a 413 there too."""
    body = json.dumps({"model": "m", "prompt": "x" * MAX_BODY}).encode()
    r = small.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert assert_error(r, 413, "payload_too_large_error")["code"] == "body_too_large"


def test_chunked_body_over_the_limit_is_413(small: httpx.Client, assert_error: Any) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(MAX_BODY // 8):
            yield b"xxxxxxxx"
        yield b'"}'

    r = small.post("/v1/score", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert assert_error(r, 413, "payload_too_large_error")["code"] == "body_too_large"


def test_chunked_body_under_the_limit_is_scored(small: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"text": '
        yield b'"hello"}'

    r = small.post("/v1/score", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == 5


def test_serves_after_refusals(small: httpx.Client) -> None:
    assert small.get("/readyz").status_code == 200
    assert small.post("/v1/score", json={"text": "ok"}).status_code == 200
