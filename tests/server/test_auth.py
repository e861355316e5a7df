"""API keys: when configured, /v1 needs `Authorization: Bearer <key>`; probes and metrics do not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import Settings


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint: Path, serve_app: Any) -> Iterator[httpx.Client]:
    settings = Settings(checkpoint=tiny_checkpoint, api_keys="key-one,key-two")  # type: ignore[arg-type]
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def test_probes_and_metrics_need_no_key(keyed: httpx.Client) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert keyed.get(path).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic key-one"},
                                     {"authorization": "Bearer key-one-and-more"}])
def test_missing_or_wrong_key_is_401(keyed: httpx.Client, assert_error: Any, headers: dict[str, str]) -> None:
    for r in (keyed.get("/v1/models", headers=headers), keyed.post("/v1/score", json={"text": "a"}, headers=headers),
              keyed.post("/v1/generate", json={"prompt": "a", "max_tokens": 1}, headers=headers),
              keyed.post("/v1/completions", json={"model": "m", "prompt": "a"}, headers=headers)):
        assert_error(r, 401, "authentication_error")
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", ["key-one", "key-two"])
def test_any_configured_key_is_accepted(keyed: httpx.Client, key: str) -> None:
    headers = {"authorization": f"Bearer {key}"}
    assert keyed.get("/v1/models", headers=headers).status_code == 200
    assert keyed.post("/v1/score", json={"text": "a"}, headers=headers).status_code == 200
    assert keyed.post("/v1/generate", json={"prompt": "a", "max_tokens": 2}, headers=headers).status_code == 200
