"""The neural cache as a session option (docs/algorithms.md §4), over HTTP on real servers: a session created
with `neural_cache` scores its observed text under the cache and remembers the pairs between requests; its
suggestions and generations read that memory; exports carry it and imports check it; it takes the copy model's
place in a session of a checkpoint that has one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from models.adaptation import CacheConfig, DynEvalConfig, evaluate
from models.checkpoint import load_checkpoint
from models.copymodel import CopyConfig
from server.engine._export import _header_metadata
from server.settings import Settings

VALID = Path(__file__).resolve().parent.parent / "data" / "valid.txt"
TEXT = VALID.read_text(encoding="utf-8")[:300] + "\n"


def post(client: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


def new(client: httpx.Client, **adaptation: Any) -> str:
    return str(post(client, "/v1/sessions", adaptation=adaptation)["id"])


def put_state(client: httpx.Client, sid: str, blob: bytes) -> httpx.Response:
    return client.put(f"/v1/sessions/{sid}/state", content=blob, headers={"content-type": "application/octet-stream"})


def test_a_word_session_with_the_cache_predicts_its_own_repeats(words_client: httpx.Client,
                                                                word_checkpoint: Path) -> None:
    # lr 0: the adapter never moves, so the difference is the cache alone
    plain, cached = new(words_client, lr=0.0), new(words_client, lr=0.0, neural_cache=True)
    info = words_client.get(f"/v1/sessions/{cached}").json()
    assert info["adaptation"]["neural_cache"] is True
    assert words_client.get(f"/v1/sessions/{plain}").json()["adaptation"]["neural_cache"] is False
    first = {sid: post(words_client, f"/v1/sessions/{sid}/observe", text=TEXT) for sid in (plain, cached)}
    again = {sid: post(words_client, f"/v1/sessions/{sid}/observe", text=TEXT) for sid in (plain, cached)}
    assert again[plain]["bits"] == pytest.approx(first[plain]["bits"], rel=1e-3)  # nothing learnt without it
    assert again[cached]["bits"] < 0.9 * again[plain]["bits"]  # the second reading finds the first in the cache
    assert again[cached]["bits"] < first[cached]["bits"]  # the memory was kept between the two requests
    # the observes are the offline evaluation's with the checkpoint's cache over the two readings at once
    ckpt = load_checkpoint(word_checkpoint)
    cfg = DynEvalConfig(mode="static", cache=ckpt.dyneval.cache)
    offline = evaluate(ckpt.model, (TEXT + TEXT).encode(), cfg, tokenizer=ckpt.tokenizer)
    assert first[cached]["bits"] + again[cached]["bits"] == pytest.approx(offline.bits, rel=1e-3)
    # the memory holds a pair per scored token, each of the model's hidden size
    tensors = load_tensors(words_client.get(f"/v1/sessions/{cached}/state").content)
    assert tensors["cache.keys"].shape[1] == first[cached]["tokens"] + again[cached]["tokens"]
    assert info["state_bytes"] < words_client.get(f"/v1/sessions/{cached}").json()["state_bytes"]


def test_suggestions_and_generation_read_the_memory_and_exports_carry_it(words_client: httpx.Client,
                                                                         assert_error: Any) -> None:
    plain, cached = new(words_client, lr=0.0), new(words_client, lr=0.0, neural_cache=True)
    text = "the man said that the house was old . " * 4
    for sid in (plain, cached):
        post(words_client, f"/v1/sessions/{sid}/observe", text=text)

    def prob(sid: str, word: str) -> float:
        answer = post(words_client, f"/v1/sessions/{sid}/suggest", context="the man said that the ho", k=10)
        return next((w["prob"] for w in answer["completions"] if w["text"] == word), 0.0)

    assert prob(cached, "house") > 2 * prob(plain, "house")  # what followed these words before
    one = post(words_client, "/v1/generate", prompt=" the", session_id=cached, max_tokens=8, seed=3)
    two = post(words_client, "/v1/generate", prompt=" the", session_id=plain, max_tokens=8, seed=3)
    assert one["usage"]["completion_tokens"] == 8 and one["text"] != two["text"]
    # an export carries the memory; its import predicts the same
    blob = words_client.get(f"/v1/sessions/{cached}/state").content
    copy = "n" * 32
    assert put_state(words_client, copy, blob).status_code in (200, 201)
    assert prob(copy, "house") == pytest.approx(prob(cached, "house"), rel=1e-5)
    again = post(words_client, f"/v1/sessions/{copy}/observe", text=text)["bits"]
    assert again == pytest.approx(post(words_client, f"/v1/sessions/{cached}/observe", text=text)["bits"], rel=1e-5)
    # a memory of another model's hidden size, or of tokens outside the vocabulary, is refused
    tensors, header = load_tensors(blob), _header_metadata(blob)
    keys = tensors["cache.keys"]
    for bad in ({"cache.keys": torch.zeros(1, keys.shape[1], keys.shape[2] + 1)},
                {"cache.values": torch.full_like(tensors["cache.values"], 10**6)},
                {"cache.keys": torch.full_like(keys, float("nan"))}):
        r = put_state(words_client, "m" * 32, save_tensors({**tensors, **bad}, metadata=header))
        assert "cache" in assert_error(r, 422, "validation_error")["message"]
    # so is a memory in the export of a session without the cache
    meta = json.loads(header["session"])
    meta["config"]["memories"]["cache"] = None
    r = put_state(words_client, "m" * 32, save_tensors(tensors, metadata={**header, "session": json.dumps(meta)}))
    assert "unexpected" in assert_error(r, 422, "validation_error")["message"]
    # and a setting that is not a boolean
    r = words_client.post("/v1/sessions", json={"adaptation": {"neural_cache": "yes"}})
    assert_error(r, 422, "validation_error", "adaptation.neural_cache")


@pytest.fixture(scope="module")
def copy_client(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
                serve_app: Any) -> Iterator[httpx.Client]:
    """The tiny byte checkpoint with a copy model and a neural cache of its own settings."""
    path = tmp_path_factory.mktemp("ncache") / "tiny"
    shutil.copytree(tiny_checkpoint, path)
    dyneval = json.loads((path / "dyneval.json").read_text())
    cache = CacheConfig(window=300, theta=0.5, lam=0.2)
    (path / "dyneval.json").write_text(json.dumps({**dyneval, "copy": CopyConfig(window=2048).to_dict(),
                                                   "cache": cache.__dict__}))
    with serve_app(Settings(checkpoint=path, suggest_budget_ms=0)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_in_a_byte_session_the_cache_takes_the_copy_models_place(copy_client: httpx.Client) -> None:
    copied, cached = new(copy_client), new(copy_client, neural_cache=True)
    for sid in (copied, cached):
        post(copy_client, f"/v1/sessions/{sid}/observe", text=TEXT * 2)
    with_copy = load_tensors(copy_client.get(f"/v1/sessions/{copied}/state").content)
    with_cache = load_tensors(copy_client.get(f"/v1/sessions/{cached}/state").content)
    assert any(k.startswith("copy.") for k in with_copy) and not any(k.startswith("cache.") for k in with_copy)
    assert not any(k.startswith("copy.") for k in with_cache)
    assert with_cache["cache.keys"].shape[1] == 300  # the checkpoint's window: the oldest pairs are forgotten
    answer = post(copy_client, f"/v1/sessions/{cached}/suggest", context="It was", k=3)
    assert len(answer["completions"]) == 3
