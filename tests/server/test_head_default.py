"""A checkpoint whose sessions learn the output rows' delta ("head") by default in place of the sparse adapter M, as
the shipped default checkpoint's do: over HTTP, the flat `lr` and `decay` name the head, `lr: 0` with `cache_weight: 0`
and `copy_model: false` is still the unadapted model (its static bits exactly), and `updates` count the head's
steps."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import Settings
from tests.server.conftest import COPY

HEAD = {"lr": 2e-3, "decay": 1e-4}  # a rate the tiny model learns at
SEGMENT = 20  # the tiny checkpoint's session segment
TEXT = "the cat sat on the mat, the cat sat on the hat; the rat sat on the cat. " * 2  # 146 bytes: 8 segments


@pytest.fixture(scope="module")
def head_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a "head" section, M off ("session" "adapter": false) and a copy model: the shipped
    default checkpoint's session memories."""
    path = tmp_path_factory.mktemp("head") / "tiny-head"
    shutil.copytree(tiny_checkpoint, path)
    dyneval = json.loads((path / "dyneval.json").read_text())
    dyneval["session"] = {**(dyneval.get("session") or dyneval["sparse"]), "adapter": False}
    (path / "dyneval.json").write_text(json.dumps({**dyneval, "head": HEAD, "copy": COPY.to_dict()}))
    return path


@pytest.fixture(scope="module")
def head_client(head_checkpoint: Path, serve_app: Any) -> Iterator[httpx.Client]:
    with serve_app(Settings(checkpoint=head_checkpoint, suggest_budget_ms=0)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def create(client: httpx.Client, **adaptation: Any) -> dict[str, Any]:
    r = client.post("/v1/sessions", json={"adaptation": adaptation})
    assert r.status_code in (200, 201), r.text
    answer: dict[str, Any] = r.json()
    return answer


def test_a_fresh_session_learns_the_head_and_counts_its_updates(head_client: httpx.Client) -> None:
    session = create(head_client)
    adaptation = session["adaptation"]
    assert set(adaptation["memories"]) == {"head", "copy", "words"}  # not M
    assert adaptation["memories"]["head"] == HEAD
    assert (adaptation["lr"], adaptation["decay"]) == (HEAD["lr"], HEAD["decay"])  # the head's, not M's
    observed = head_client.post(f"/v1/sessions/{session['id']}/observe", json={"text": TEXT}).json()
    segments = -(-len(TEXT) // SEGMENT)
    assert observed["updates"] == segments and not observed["nonfinite_reset"]
    assert observed["bits"] < observed["static_bits"]
    stats = head_client.get(f"/v1/sessions/{session['id']}").json()["stats"]
    assert (stats["updates"], stats["nonfinite_resets"]) == (segments, 0)


def test_the_flat_settings_name_the_head(head_client: httpx.Client, assert_error: Any) -> None:
    faster = create(head_client, lr=5e-3)["adaptation"]
    assert faster["memories"]["head"] == {"lr": 5e-3, "decay": HEAD["decay"]} and "adapter" not in faster["memories"]
    assert create(head_client, decay=0.5)["adaptation"]["memories"]["head"] == {"lr": HEAD["lr"], "decay": 0.5}
    # adapter_size stays M's: it turns M on beside the head, at the checkpoint's settings
    both = create(head_client, adapter_size=4)["adaptation"]
    assert both["memories"]["adapter"]["size"] == 4 and both["memories"]["head"] == HEAD
    assert (both["lr"], both["adapter_size"]) == (HEAD["lr"], 4)
    # a session with M in the head's place reads M's rate and decay
    m_only = create(head_client, memories={"head": None, "adapter": {"lr": 3e-3}})["adaptation"]
    assert (m_only["lr"], m_only["decay"]) == (3e-3, m_only["memories"]["adapter"]["decay"])
    # errors name the field the request used
    for adaptation, param in (({"lr": -1.0}, "adaptation.lr"), ({"decay": 2.0}, "adaptation.decay"),
                              ({"lr": 0.0, "decay": 2.0}, "adaptation.decay"),
                              ({"memories": {"head": {"lr": -1.0}}}, "adaptation.memories.head.lr"),
                              ({"adapter_size": 10**6}, "adaptation.adapter_size")):
        r = head_client.post("/v1/sessions", json={"adaptation": adaptation})
        assert_error(r, 422, "validation_error", param)


def test_lr_0_is_no_weight_learning_and_the_unadapted_recipe_scores_static_bits(head_client: httpx.Client) -> None:
    quiet = create(head_client, lr=0.0)
    assert set(quiet["adaptation"]["memories"]) == {"copy", "words"}  # no head, no M: nothing learns weights
    assert (quiet["adaptation"]["lr"], quiet["adaptation"]["decay"]) == (0.0, 0.0)
    twin = create(head_client, lr=0, cache_weight=0, copy_model=False)
    assert set(twin["adaptation"]["memories"]) <= {"words"}
    default = create(head_client)
    assert twin["state_bytes"] < default["state_bytes"] - 2 * 256 * 16  # at least the delta of a 256-row layer
    for _ in range(2):  # the repeat too: no copy model, no learned weights to find it
        observed = head_client.post(f"/v1/sessions/{twin['id']}/observe", json={"text": TEXT}).json()
        assert observed["bits"] == observed["static_bits"]
        assert (observed["updates"], observed["nonfinite_reset"]) == (0, False)
