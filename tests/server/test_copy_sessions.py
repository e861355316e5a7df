"""Sessions with a copy model (models/copymodel.py), over HTTP on a real server: a checkpoint whose dyneval.json has
a "copy" section gives every session one; observes score under the mixture and learn it, exports carry it, and
the keyboard offers a word the session has seen once that the network alone would never produce."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.adaptation import evaluate
from models.checkpoint import load_checkpoint
from models.copymodel import CopyModel
from server.settings import Settings
from tests.server.conftest import COPY

TEXT = "Please forward the zqvx ledger to Marguerite Oyelaran-Whitcombe before Tuesday. "


@pytest.fixture(scope="module")
def copy_client(copy_checkpoint: Path, serve_app: Any) -> Iterator[httpx.Client]:
    with serve_app(Settings(checkpoint=copy_checkpoint, suggest_budget_ms=0)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(client: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


def test_a_session_learns_an_exact_repeat_at_once(copy_client: httpx.Client, client: httpx.Client,
                                                  copy_checkpoint: Path) -> None:
    with_copy = post(copy_client, "/v1/sessions")
    without = post(client, "/v1/sessions")  # the same tiny checkpoint, no copy section
    assert with_copy["state_bytes"] > without["state_bytes"] + 2 * COPY.window
    first = post(copy_client, f"/v1/sessions/{with_copy['id']}/observe", text=TEXT)
    again = post(copy_client, f"/v1/sessions/{with_copy['id']}/observe", text=TEXT)
    post(client, f"/v1/sessions/{without['id']}/observe", text=TEXT)
    plain = post(client, f"/v1/sessions/{without['id']}/observe", text=TEXT)
    assert again["bits_per_byte"] < 0.5 * first["bits_per_byte"]  # seen once: copied
    assert again["bits_per_byte"] < 0.5 * plain["bits_per_byte"]  # the adapter alone learns it far more slowly
    # the observe's bits are the offline evaluation's with the same copy model (score, then update; BOS first)
    ckpt = load_checkpoint(copy_checkpoint)
    reference = evaluate(ckpt.model, (TEXT + TEXT).encode(), ckpt.dyneval.session, stats=ckpt.stats,
                         copy=CopyModel(COPY))
    assert first["bits"] + again["bits"] == pytest.approx(reference.bits, rel=1e-4)
    assert again["static_bits"] == pytest.approx(plain["static_bits"], rel=1e-5)  # static: the network alone


def test_export_and_import_carry_the_copy_model(copy_client: httpx.Client) -> None:
    sid = post(copy_client, "/v1/sessions")["id"]
    post(copy_client, f"/v1/sessions/{sid}/observe", text=TEXT)
    blob = copy_client.get(f"/v1/sessions/{sid}/state").content
    r = copy_client.put("/v1/sessions/imported-session-0001/state", content=blob)
    assert r.status_code in (200, 201), r.text
    probe = TEXT[:40]
    a = post(copy_client, "/v1/score", text=probe, session_id=sid)
    b = post(copy_client, "/v1/score", text=probe, session_id="imported-session-0001")
    assert a["bits"] == pytest.approx(b["bits"], rel=1e-6)
    fresh = post(copy_client, "/v1/sessions")["id"]
    c = post(copy_client, "/v1/score", text=probe, session_id=fresh)
    assert a["bits"] < 0.7 * c["bits"]  # what it observed is in the import: the repeat is cheap
    # a tampered copy model is refused with the one error shape, and the server keeps serving
    bad = blob.replace(b'"copy.fill"', b'"copy.fxll"')
    r = copy_client.put("/v1/sessions/tampered-session-0001/state", content=bad)
    assert r.status_code == 422 and "copy" in r.json()["error"]["message"], r.text


def test_a_session_can_turn_its_copy_model_off(copy_client: httpx.Client, client: httpx.Client) -> None:
    # the keyboard page's unadapted twin: lr 0, no word cache, no copy model is the network alone, whose bits are
    # the static ones even on a repeat; its export and import keep it without one
    twin = post(copy_client, "/v1/sessions", adaptation={"lr": 0, "cache_weight": 0, "copy_model": False})
    default = post(copy_client, "/v1/sessions")
    plain = post(client, "/v1/sessions", adaptation={"copy_model": True})  # asked for, but the checkpoint has none
    assert (twin["adaptation"]["copy_model"], default["adaptation"]["copy_model"]) == (False, True)
    assert plain["adaptation"]["copy_model"] is False
    assert twin["state_bytes"] + 2 * COPY.window < default["state_bytes"]
    for sid in (twin["id"], default["id"]):
        post(copy_client, f"/v1/sessions/{sid}/observe", text=TEXT)
    again = post(copy_client, f"/v1/sessions/{twin['id']}/observe", text=TEXT)
    copied = post(copy_client, f"/v1/sessions/{default['id']}/observe", text=TEXT)
    assert again["bits"] == pytest.approx(again["static_bits"], rel=1e-4)
    assert copied["bits"] < 0.5 * copied["static_bits"]
    blob = copy_client.get(f"/v1/sessions/{twin['id']}/state").content
    r = copy_client.put("/v1/sessions/imported-twin-0001/state", content=blob)
    assert r.status_code in (200, 201) and r.json()["adaptation"]["copy_model"] is False, r.text
    probe = TEXT[:40]
    a = post(copy_client, "/v1/score", text=probe, session_id=twin["id"])
    b = post(copy_client, "/v1/score", text=probe, session_id="imported-twin-0001")
    assert a["bits"] == pytest.approx(b["bits"], rel=1e-6)
    r = copy_client.post("/v1/sessions", json={"adaptation": {"copy_model": "no"}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "adaptation.copy_model", r.text


def test_sessions_with_and_without_a_copy_model_batch_together(copy_client: httpx.Client) -> None:
    # a session whose copy model is off (the keyboard page's twin), or that keeps a neural cache instead, is searched
    # and sampled in one batch with sessions that have one: its rows read the network alone, as when it runs alone
    # (its state carries an empty view of a copy model, so the rows' states stack)
    twin = post(copy_client, "/v1/sessions", adaptation={"lr": 0, "cache_weight": 0, "copy_model": False})["id"]
    cached = post(copy_client, "/v1/sessions", adaptation={"neural_cache": True, "cache_weight": 0})["id"]
    full = post(copy_client, "/v1/sessions")["id"]
    for sid in (twin, cached, full):
        post(copy_client, f"/v1/sessions/{sid}/observe", text=TEXT + TEXT)
    context = "Please forward the zq"

    def suggest(sid: str) -> list[str]:
        answer = post(copy_client, f"/v1/sessions/{sid}/suggest", context=context, k=3)
        return [w["text"] for w in answer["completions"]]

    def generate(sid: str) -> str:
        return str(post(copy_client, "/v1/generate", prompt=context, max_tokens=8, temperature=0.0,
                        session_id=sid)["text"])

    alone = {sid: (suggest(sid), generate(sid)) for sid in (twin, cached, full)}
    assert alone[full][0][:1] == ["zqvx"] and "zqvx" not in alone[twin][0]
    with ThreadPoolExecutor(6) as pool:  # all at once, several times: the engine batches what arrives together
        runs = [(sid, pool.submit(suggest, sid), pool.submit(generate, sid)) for _ in range(4)
                for sid in (twin, cached, full)]
        for sid, words, text in runs:
            assert (words.result(), text.result()) == alone[sid], sid


def test_the_keyboard_offers_a_word_seen_once(copy_client: httpx.Client, client: httpx.Client) -> None:
    """'zqvx' is no word the tiny model knows; once the session has seen it (twice: the mixer starts from the
    network alone here, and learns to trust a long match on the second sighting; a checkpoint's learned prior
    trusts it from the start) its search completes it. The word cache is off (cache_weight 0 on the tiny
    checkpoint): the byte-level copy model alone does it."""
    for c, name in ((copy_client, "copy"), (client, "plain")):
        sid = post(c, "/v1/sessions")["id"]
        post(c, f"/v1/sessions/{sid}/observe", text=TEXT + TEXT)
        words = [w["text"] for w in post(c, f"/v1/sessions/{sid}/suggest", context="Please forward the zq",
                                         k=3)["completions"]]
        if name == "copy":
            assert words and words[0] == "zqvx"
        else:
            assert "zqvx" not in words


def test_generation_continues_a_repeat_and_batches_with_static_generations(copy_client: httpx.Client) -> None:
    """Sampling reads the session's copy model too (greedy: the repeat's next bytes), and a generation without a
    session, running in the same batched steps, is the network's alone."""
    sid = post(copy_client, "/v1/sessions")["id"]
    post(copy_client, f"/v1/sessions/{sid}/observe", text=TEXT + TEXT)
    prompt = "Please forward the zq"
    static = post(copy_client, "/v1/generate", prompt=prompt, max_tokens=8, temperature=0.0)["text"]
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(post, copy_client, "/v1/generate", prompt=prompt, max_tokens=8, temperature=0.0,
                            **({"session_id": sid} if i % 2 == 0 else {})) for i in range(4)]
        texts = [r.result()["text"] for r in runs]
    assert texts[0] == texts[2] and texts[0].startswith("vx ledge")
    assert texts[1] == texts[3] == static and not static.startswith("vx")


def test_a_session_s_copy_model_lives_in_redis_across_servers(copy_checkpoint: Path, serve_app: Any,
                                                               redis_url: str) -> None:
    """Two servers on one Redis: a session observed on one scores the repeat as cheaply on the other (its copy
    model travels in the stored blob), and after both restart."""
    settings = Settings(checkpoint=copy_checkpoint, session_store=redis_url, suggest_budget_ms=0)
    with serve_app(settings) as a, httpx.Client(base_url=a.url, timeout=60) as ca:
        sid = post(ca, "/v1/sessions")["id"]
        post(ca, f"/v1/sessions/{sid}/observe", text=TEXT)
        here = post(ca, "/v1/score", text=TEXT, session_id=sid)["bits"]
        with serve_app(settings) as b, httpx.Client(base_url=b.url, timeout=60) as cb:
            assert post(cb, "/v1/score", text=TEXT, session_id=sid)["bits"] == pytest.approx(here, rel=1e-6)
            fresh = post(cb, "/v1/sessions")["id"]
            assert here < 0.6 * post(cb, "/v1/score", text=TEXT, session_id=fresh)["bits"]
    with serve_app(settings) as c, httpx.Client(base_url=c.url, timeout=60) as cc:
        assert post(cc, "/v1/score", text=TEXT, session_id=sid)["bits"] == pytest.approx(here, rel=1e-6)


def test_reset_forgets_the_copy_model(copy_client: httpx.Client) -> None:
    sid = post(copy_client, "/v1/sessions")["id"]
    fresh = post(copy_client, "/v1/score", text=TEXT, session_id=sid)["bits"]
    post(copy_client, f"/v1/sessions/{sid}/observe", text=TEXT)
    assert post(copy_client, "/v1/score", text=TEXT, session_id=sid)["bits"] < 0.6 * fresh
    post(copy_client, f"/v1/sessions/{sid}/reset")
    assert post(copy_client, "/v1/score", text=TEXT, session_id=sid)["bits"] == pytest.approx(fresh, rel=1e-6)
