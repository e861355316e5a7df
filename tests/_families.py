"""Checks and session helpers shared by the tests of each model family (tests/models/test_<family>.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient


def assert_greedy_generation_equals_recomputation(model: Any, prompt: bytes = b"It is a ", n: int = 30) -> None:
    """Greedy generation of n bytes after `prompt` (one byte a call, through the model's state) equals the argmax of
    a fresh forward over the whole text (BOS, prompt, bytes so far) at each step."""
    import torch

    from models.sampling import SamplingParams, generate
    from models.scoring import BOS

    greedy = "".join(generate(model, prompt, SamplingParams(max_tokens=n, temperature=0)))
    ctx, expected = [BOS, *prompt], []
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ctx]), model.init_state(1)).logits[0, -1].argmax())
        expected.append(nxt)
        ctx.append(nxt)
    assert greedy == bytes(expected).decode("utf-8", errors="replace")


@contextmanager
def served(checkpoint: Path, **settings: Any) -> Iterator[TestClient]:
    """An in-process server of `checkpoint` (float32, max_wait_ms=100 unless `settings` say otherwise)."""
    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(**{"checkpoint": checkpoint, "precision": "float32", "max_wait_ms": 100, **settings}))
    with TestClient(app) as c:
        yield c


def create_session(client: TestClient, **body: Any) -> dict[str, Any]:
    """POST /v1/sessions with `body`: -> the created session (status 201 asserted)."""
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def observe_text(client: TestClient, sid: str, text: str) -> dict[str, Any]:
    """POST /v1/sessions/{sid}/observe with `text`: -> the response body (status 200 asserted)."""
    r = client.post(f"/v1/sessions/{sid}/observe", json={"text": text})
    assert r.status_code == 200, r.text
    return dict(r.json())
