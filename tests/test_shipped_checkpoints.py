"""The shipped checkpoints (the default mLSTM, one per transformer family, and the word model): present, within their
size budgets, loadable, real models, and served by a real `adaptlm serve` from the repository as cloned."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from models.adaptation import DynEvalSettings
from models.adaptation._head_memory import HeadSettings
from models.checkpoint import CHECKPOINT_FILES, load_checkpoint
from models.memory import weight_learner
from models.scoring import score_bytes
from models.session import SessionModel
from server.launch import serving

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
# name -> (architecture, size budget in bytes, its adaptation site's statistics key)
SHIPPED = {
    "default": ("mlstm", 20 * 1024 * 1024, "adapter.h"),
    "char-transformer": ("char-transformer", 10 * 1024 * 1024, "adapter.resid"),
    "compressive": ("compressive", 10 * 1024 * 1024, "adapter.resid"),
    "words": ("adaptive-transformer", 10 * 1024 * 1024, "adapter.resid"),
}
ENGLISH = b"The quick brown fox jumps over the lazy dog, and the dog, being lazy, did not mind it at all.\n"


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_is_complete_and_within_its_budget(name: str) -> None:
    path = CHECKPOINTS / name
    for file in CHECKPOINT_FILES:
        assert (path / file).is_file(), file
    assert sum(p.stat().st_size for p in path.iterdir() if p.is_file()) <= SHIPPED[name][1]
    assert json.loads((path / "config.json").read_text())["model"]["arch"] == SHIPPED[name][0]


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_scores_english_well(name: str) -> None:
    ck = load_checkpoint(CHECKPOINTS / name)
    meta = json.loads((CHECKPOINTS / name / "config.json").read_text())
    assert meta["metrics"]["valid_bpb"] <= 2.2
    assert "Validation bits per byte" in ck.card
    # an excerpt none was trained on (Sense and Sensibility was in the training mix: a non-Austen line)
    english = score_bytes(ck.model, ENGLISH, tokenizer=ck.tokenizer).bits_per_byte
    assert english < 3.0
    if ck.tokenizer.kind == "words":  # noise would be <unk> after <unk>; the same words out of order instead
        words = ENGLISH.decode().split()
        order = (7, 2, 11, 0, 15, 4, 19, 9, 13, 1, 18, 6, 3, 16, 10, 5, 12, 8, 17, 14)
        assert sorted(order) == list(range(len(words)))
        shuffled = " ".join(words[i] for i in order)
        assert score_bytes(ck.model, (shuffled + "\n").encode(), tokenizer=ck.tokenizer).bits_per_byte > english + 0.3
    else:
        noise = score_bytes(ck.model, bytes(range(256)) * 2).bits_per_byte
        assert noise > english + 3.0


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_has_gradient_statistics(name: str) -> None:
    ck = load_checkpoint(CHECKPOINTS / name)
    key = SHIPPED[name][2]
    assert key in ck.stats
    assert float(ck.stats[key].min()) >= 0 and float(ck.stats[key].max()) > 0
    params = [k for k in ck.stats if k.startswith("param.")]
    assert params and all(float(ck.stats[k].min()) >= 0 for k in params)
    assert not [k for k in params if k.startswith("param.aux.")]  # training-only heads never adapt


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_dynamic_evaluation_is_tuned(name: str) -> None:
    """`adaptlm eval --mode dynamic|sparse` (and a session without a "session" section) use dyneval.json's "full" and
    "sparse" sections: each must be `adaptlm tune`'s, measured better than static on its validation text, not the
    trainer's untuned starting values (with which the word model lost 25% to static on held-out prose, full mode)."""
    dyneval = json.loads((CHECKPOINTS / name / "dyneval.json").read_text())
    assert dyneval["tuned"] is True and dyneval["tuned_on"]["bytes"] > 0
    for section in ("full", "sparse"):
        entry = dyneval[section]
        assert entry["trials"] >= 1 and entry["valid_bpb"] < entry["valid_static_bpb"], (section, entry)


@pytest.mark.parametrize("name", ["char-transformer", "compressive"])
def test_the_server_searches_the_shipped_transformers_in_the_branch_form(name: str) -> None:
    """The model the engine's suggestions and generations run (the network wrapped for sessions) takes the branch
    form (models/_branches.py) on a CPU: the wrappers once hid it, and only the bare network had it."""
    from models.base import ROOT
    from server.engine import Engine

    engine = Engine(CHECKPOINTS / name, thread_name="engine-under-test")
    engine.start()
    try:
        model = engine.sessions.session_model()
        assert model is not engine.sessions._checkpoint().model  # wrapped, as sessions that adapt have it
        assert ROOT in model.branch(model.init_state(1)).tensors
    finally:
        engine.stop()


@contextmanager
def adaptlm_serve(name: str, log: Path) -> Iterator[str]:
    """`adaptlm serve --checkpoint checkpoints/<name>` as a user starts it, in a process of its own -> its URL."""
    with serving(CHECKPOINTS / name, log, {"ADAPTLM_DEVICE": "cpu", "ADAPTLM_SUGGEST_BUDGET_MS": "5000"}) as served:
        yield served.url


@contextmanager
def app_served(name: str) -> Iterator[str]:
    """The same app and engine as `adaptlm serve` (server.app.create_app, which loads the checkpoint at start-up),
    under uvicorn in this process -> its URL."""
    from server.settings import Settings
    from tests.server.conftest import serve

    with serve(Settings(checkpoint=CHECKPOINTS / name, device="cpu", suggest_budget_ms=5000)) as server:
        yield server.url


# The entry point does the same for every family (it hands the checkpoint to the engine): one family runs through
# it in a process of its own, the others through the same app in this process, which spares a Python and a torch
# start-up each.
@pytest.mark.parametrize("name", ["char-transformer", "compressive", "words"])
def test_adaptlm_serve_runs_the_shipped_transformer(name: str, tmp_path: Path) -> None:
    """`adaptlm serve --checkpoint checkpoints/<family>` as a user starts it: scoring, streaming generation, a
    session that adapts and suggests, its state exported (the word model's offers the name it typed, which its
    vocabulary lacks, from the session's word cache). A generous suggestion budget: a loaded machine must not decide
    whether a completion arrives (the 50 ms default cuts a transformer's search short; tests/server test it)."""
    with (adaptlm_serve(name, tmp_path / "serve.log") if name == "words" else app_served(name)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        models = client.get("/v1/models").json()["data"]
        assert models[0]["id"] == name
        score = client.post("/v1/score", json={"text": ENGLISH.decode()}).json()
        assert score["bits_per_byte"] < 3.0
        with client.stream("POST", "/v1/generate", json={"prompt": "It was a ", "max_tokens": 24, "stream": True,
                                                        "temperature": 0}) as stream:
            assert stream.status_code == 200
            body = "".join(stream.iter_text())
        assert "data:" in body
        sid = client.post("/v1/sessions", json={}).json()["id"]
        text = "Dear Mr Zorblax, thank you for the report. " * 6
        first = client.post(f"/v1/sessions/{sid}/observe", json={"text": text}).json()
        assert first["updates"] > 0
        again = client.post(f"/v1/sessions/{sid}/observe", json={"text": text}).json()
        assert again["bits_per_byte"] < first["bits_per_byte"]  # the repeat is predicted better
        suggested = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "Dear Mr Zor"}).json()
        assert suggested["prefix"] == "Zor" and suggested["completions"]
        state = client.get(f"/v1/sessions/{sid}/state")
        assert state.status_code == 200 and len(state.content) > 1000


@pytest.mark.parametrize("name", ["default", "char-transformer", "compressive"])
def test_the_byte_checkpoints_ship_their_lexicon(name: str) -> None:
    """A few hundred KB of the training text's words (models/lexicon.py): the common ones, not the fragments."""
    lexicon = load_checkpoint(CHECKPOINTS / name).lexicon
    assert lexicon is not None and 10_000 < lexicon.listed < 100_000
    assert (CHECKPOINTS / name / "lexicon.txt").stat().st_size < 512 * 1024
    assert all(lexicon.known(w) for w in ("the", "The", "whale", "friend", "world", "don't"))
    assert not any(lexicon.known(w) for w in ("wor", "Frien", "Ims"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_session_has_a_word_cache(name: str) -> None:
    """A keyboard session of any shipped checkpoint mixes in the words it observed (models/wordcache.py): the
    transformers once had no `session` section, so their sessions ran with cache_weight 0 (docs/benchmarks.md,
    "Model families side by side")."""
    assert load_checkpoint(CHECKPOINTS / name).dyneval.cache_weight > 0


@pytest.mark.parametrize("name", SHIPPED)
def test_only_the_default_checkpoint_ships_a_copy_model(name: str) -> None:
    """What DynEvalSettings' comment says: the default checkpoint's sessions mix in a copy model (dyneval.json "copy",
    `python -m bench.copy_defaults`); the transformers and the word model have no such section."""
    dyneval = DynEvalSettings(json.loads((CHECKPOINTS / name / "dyneval.json").read_text()))
    assert (dyneval.copy is not None) == (name == "default")


@pytest.mark.parametrize("name", SHIPPED)
def test_the_default_checkpoints_sessions_learn_the_output_rows_in_place_of_the_adapter(name: str) -> None:
    """checkpoints/default's sessions learn the output rows' delta at its "head" section's settings (chosen on
    held-out text, `python -m bench.head_defaults`), M off unless a session asks for it; the other checkpoints have no
    weight-normalised output layer of their own (the word model's adaptive softmax is tied to its input), so M stays
    their learned part."""
    sm = SessionModel.of(load_checkpoint(CHECKPOINTS / name))
    config = sm.config()
    if name == "default":
        assert weight_learner(sm.memories) == "head" and "adapter" not in config
        assert config.get("head") == HeadSettings(lr=6.912e-5, decay=1e-4)
        assert "adapter" in sm.config({"adapter": {}})
    else:
        assert weight_learner(sm.memories) == "adapter" and "adapter" in config
        assert "head" not in sm.memories
