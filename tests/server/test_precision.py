"""A server with `precision=bfloat16` (the default "auto" on a CPU with AVX-512 BF16): its scores, observes and
suggestions stay close to the float32 library's, and /metrics says which precision runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.checkpoint import load_checkpoint
from models.scoring import BOS, score_bytes
from models.suggest import advance, suggest
from server.settings import Settings

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."


def test_a_bf16_server_stays_close_to_float32(tiny_checkpoint: Path, serve_app: Any) -> None:
    model = load_checkpoint(tiny_checkpoint).model.eval()
    exact = score_bytes(model, TEXT.encode())
    with serve_app(Settings(checkpoint=tiny_checkpoint, precision="bfloat16", suggest_budget_ms=0)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as c:
        scored = c.post("/v1/score", json={"text": TEXT}).json()
        assert scored["bits"] != exact.bits
        assert scored["bits"] == pytest.approx(exact.bits, rel=2e-3)
        sid = c.post("/v1/sessions", json={"adaptation": {"lr": 0}}).json()["id"]
        observed = c.post(f"/v1/sessions/{sid}/observe", json={"text": TEXT}).json()
        assert observed["bits"] == pytest.approx(exact.bits, rel=2e-3)
        # a fresh session's suggestions against the library's in float32 (the same state: lr 0, nothing observed)
        context = "It is a truth univ"
        got = c.post(f"/v1/sessions/{c.post('/v1/sessions', json={}).json()['id']}/suggest",
                     json={"context": context, "k": 3}).json()
        cursor = advance(model, model.init_state(1), bytes([BOS]) + context.encode())
        want = {w.text: w.prob for w in suggest(model, cursor, context, k=5, n_chars=0).completions}
        assert got["completions"] and all(w["text"] in want for w in got["completions"])
        assert [w["prob"] for w in got["completions"]] == pytest.approx([want[w["text"]] for w in got["completions"]],
                                                                        rel=0.05)
        metrics = c.get("/metrics").text
    rows = re.findall(r'^adaptlm_batch_rows_count\{([^}]*)\}', metrics, re.M)
    assert rows and all('precision="bfloat16"' in labels for labels in rows)
