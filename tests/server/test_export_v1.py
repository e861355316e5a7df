"""A session exported by the server before the session memories (export format 1, tests/data/README.md) imports
into today's server and goes on as it would have there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.engine._export import _header_metadata
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def test_a_version_1_export_of_the_default_checkpoint_imports_and_goes_on(serve_app: Any) -> None:
    blob = (DATA / "session-v1-default.safetensors").read_bytes()
    then = json.loads((DATA / "session-v1-default.json").read_text())
    start, end = then["next_text_bytes"]
    more = (DATA / "valid.txt").read_bytes()[start:end].decode("utf-8")
    with serve_app(Settings(checkpoint=ROOT / "checkpoints" / "default", suggest_budget_ms=0)) as server, \
            httpx.Client(base_url=server.url, timeout=300) as client:
        sid = "v" * 32
        r = client.put(f"/v1/sessions/{sid}/state", content=blob, headers={"content-type": "application/octet-stream"})
        assert r.status_code in (200, 201), r.text
        session = r.json()
        old = then["session"]
        assert session["stats"] == old["stats"] and session["ttl_s"] == old["ttl_s"]
        assert session["state_bytes"] == old["state_bytes"]
        adaptation = session["adaptation"]
        assert {k: adaptation[k] for k in old["adaptation"]} == old["adaptation"]  # the flat settings as they were
        flat = old["adaptation"]
        assert adaptation["memories"] == {"adapter": {"lr": flat["lr"], "decay": flat["decay"],
                                                      "size": flat["adapter_size"]},
                                          "copy": {}, "words": {"weight": 0.5}}
        # it goes on as the old server's session did: the next text scores the same, and the adapter keeps learning
        observed = client.post(f"/v1/sessions/{sid}/observe", json={"text": more}).json()
        assert observed["bits"] == pytest.approx(then["next_observe"]["bits"], rel=1e-3)
        assert observed["static_bits"] == pytest.approx(then["next_observe"]["static_bits"], rel=1e-3)
        assert observed["updates"] == then["next_observe"]["updates"]
        r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "He was recomm", "k": 3})
        assert r.status_code == 200 and r.json()["completions"], r.text
        # exported again, it is a version-2 blob, with the word cache it came with, that imports as itself
        again = client.get(f"/v1/sessions/{sid}/state").content
        meta = _header_metadata(again)
        assert meta["version"] == "2"
        assert "recommended" in json.loads(meta["session"])["memories"]["words"]["words"]
        r = client.put(f"/v1/sessions/{'w' * 32}/state", content=again,
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code in (200, 201) and r.json()["stats"] == client.get(f"/v1/sessions/{sid}").json()["stats"]
