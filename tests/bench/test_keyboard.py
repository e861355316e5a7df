"""`python -m bench.keyboard` with a checkpoint other than the default: which systems a word model runs, where its
results go (beside the default's, not over them), and a word checkpoint measured end to end through its server on
a tiny text (tests/data, copied into a corpora directory of the test's own; no Presage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench._common import DEFAULT_CHECKPOINT
from bench.keyboard import (
    SYSTEMS,
    CheckpointInfo,
    choose_systems,
    default_learned,
    inspect_checkpoint,
    result_path,
    row_label,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"

BYTES = CheckpointInfo(DEFAULT_CHECKPOINT, None, "bytes", True, ("head",))
WORDS = CheckpointInfo(Path("/x/words"), "words", "words", False, ("adapter",))


def test_a_byte_checkpoint_runs_every_system_and_keeps_the_default_file_names(tmp_path: Path) -> None:
    assert choose_systems(None, BYTES) == (list(SYSTEMS), {})
    assert choose_systems("full,sparse-nocopy", BYTES) == (["full", "sparse-nocopy"], {})
    assert result_path(tmp_path, "emails", "sparse", None) == tmp_path / "emails.sparse.json"
    assert result_path(tmp_path, "emails", "sparse", "words") == tmp_path / "emails.sparse@words.json"
    assert result_path(tmp_path, "sms", "presage-learn", "words") == tmp_path / "sms.presage-learn.json"
    with pytest.raises(ValueError, match="unknown system"):
        choose_systems("static,nope", BYTES)


def test_a_word_checkpoint_runs_its_server_systems_and_presage() -> None:
    systems, skipped = choose_systems(None, WORDS)
    assert systems == ["presage", "presage-learn", "static", "sparse-nocache", "sparse", "sparse-noneural"]
    assert set(skipped) == {"sparse-nocopy", "full", "full-cache", "full-copy"}
    assert all(reason for reason in skipped.values())
    assert choose_systems("presage,static,sparse", WORDS) == (["presage", "static", "sparse"], {})
    for asked in ("full", "static,full-copy", "sparse-nocopy"):
        with pytest.raises(ValueError, match="cannot measure words"):
            choose_systems(asked, WORDS)


def test_the_checkpoint_is_read_from_its_json_files(word_checkpoint: Path) -> None:
    # the default's sessions learn the output rows' delta in M's place (dyneval.json: "head", "adapter": false)
    assert inspect_checkpoint(DEFAULT_CHECKPOINT) == \
        CheckpointInfo(DEFAULT_CHECKPOINT.resolve(), None, "bytes", True, ("head",))
    words = inspect_checkpoint(word_checkpoint)
    assert (words.tag, words.tokenizer, words.copy) == (word_checkpoint.name, "words", False)
    assert words.learned == ("adapter",)  # a checkpoint without a "head" section: M
    assert words.name == word_checkpoint.name


def test_the_weights_a_session_learns_by_default_are_read_as_the_memories_read_them() -> None:
    head = {"lr": 6.912e-5, "decay": 1e-4}
    assert default_learned({}) == ("adapter",)  # M is on unless the session section turns it off
    assert default_learned({"session": {"lr": 1e-4}, "head": head}) == ("adapter", "head")
    assert default_learned({"session": {"adapter": False}, "head": head}) == ("head",)
    assert default_learned({"session": {"adapter": False}, "head": {}}) == ()


def test_a_row_names_what_ran_not_what_its_system_would_run_on_the_default() -> None:
    # the default checkpoint's session: the output rows' delta, copy model, word cache, as its record says
    served = {"tokenizer": "bytes", "learned": ["head"], "copy": True, "neural_cache": False, "cache_weight": 0.5,
              "lr": 6.912e-5}
    assert row_label("sparse", served, None) == \
        "ours, session as served: head + copy model + word cache (HTTP) (lr 6.912e-05, cache 0.5)"
    assert row_label("sparse-nocache", {**served, "cache_weight": 0.0}, None) == \
        "ours, session without the word cache: head + copy model (HTTP) (lr 6.912e-05, cache 0)"
    assert row_label("sparse-nocopy", {**served, "copy": False}, None) == \
        "ours, session without the copy model: head + word cache (HTTP) (lr 6.912e-05, cache 0.5)"
    # a session that learns M (a request's, or another checkpoint's default)
    assert row_label("sparse", {**served, "learned": ["adapter"], "lr": 1e-4}, None) == \
        "ours, session as served: adapter + copy model + word cache (HTTP) (lr 0.0001, cache 0.5)"
    # a record from before records kept "learned": what its checkpoint's sessions learn by default (here the default)
    older = {k: v for k, v in served.items() if k != "learned"}
    assert row_label("sparse", older, None) == row_label("sparse", served, None)
    # a byte checkpoint without a copy section (the transformers): its session has none, and the row says so
    transformer = {**served, "learned": ["adapter"], "copy": False, "lr": 8e-5}
    assert row_label("sparse", transformer, "compressive") == \
        "ours (compressive), session as served: adapter + word cache (HTTP) (lr 8e-05, cache 0.5)"
    assert row_label("full-copy", {"tokenizer": "bytes", "copy": False, "cache_weight": 0.5, "lr": 2e-5}, None) == \
        "ours, full dynamic evaluation + word cache (in-process) (lr 2e-05, cache 0.5)"
    assert row_label("full", {"tokenizer": "bytes", "copy": False, "cache_weight": 0.0, "lr": 2e-5}, None) == \
        f"{SYSTEMS['full']} (lr 2e-05, cache 0)"
    # a record written before records kept "copy": the system's name
    assert row_label("sparse", {"tokenizer": "bytes", "cache_weight": 0.5, "lr": 1e-4}, None) == \
        f"{SYSTEMS['sparse']} (lr 0.0001, cache 0.5)"


def keyboard(corpora: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"OMP_NUM_THREADS": "1", "ADAPTLM_DATA": str(corpora)}
    return subprocess.run([sys.executable, "-m", "bench.keyboard", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


def keyboard_here(corpora: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                  *args: str) -> str:
    """`python -m bench.keyboard ARGS`'s main in this process (its servers are processes of their own, as always)
    -> its standard output."""
    from bench.keyboard import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the servers' threads, as `make bench` runs them
    monkeypatch.setenv("ADAPTLM_DATA", str(corpora))
    monkeypatch.setattr(sys, "argv", ["bench.keyboard", *args])
    capsys.readouterr()
    main()
    return capsys.readouterr().out


def test_a_word_checkpoint_is_measured_through_its_server(word_checkpoint: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # the "emails" text: over 40 KB (the part measured is its last 40 KB), of the held-out book
    corpora = tmp_path / "corpora"
    (corpora / "messages").mkdir(parents=True)
    (corpora / "messages" / "enron-farmer-d.first2672.txt").write_bytes((DATA / "valid.txt").read_bytes() * 3)
    out = tmp_path / "out"
    out.mkdir()
    # a result of the default checkpoint already there: kept, and its row named in the table beside the word model's
    default = {"text": "emails", "system": "static", "measured_bytes": 1000, "warmup_bytes": 300, "ksr": 0.25,
               "top1_accuracy": 0.1, "top3_accuracy": 0.2, "suggest_ms_p50": 1.0, "suggest_ms_p99": 2.0, "lr": 0.0}
    (out / "emails.static.json").write_text(json.dumps(default))
    base = ["--checkpoint", str(word_checkpoint), "--texts", "emails", "--out", str(out)]

    stdout = keyboard_here(corpora, monkeypatch, capsys, *base, "--systems", "static,sparse", "--limit-bytes", "400",
                           "--warmup-bytes", "300")
    assert json.loads((out / "emails.static.json").read_text()) == default
    tag = word_checkpoint.name
    records = {s: json.loads((out / f"emails.{s}@{tag}.json").read_text()) for s in ("static", "sparse")}
    for system, rec in records.items():
        assert rec["system"] == system and rec["checkpoint"] == tag and rec["tokenizer"] == "words"
        assert rec["checkpoint_path"] == str(word_checkpoint.resolve())
        assert rec["copy"] is False and rec["neural_cache"] is False  # the tiny checkpoint has neither
        assert 300 <= rec["measured_bytes"] <= 400 and 200 <= rec["warmup_bytes"] <= 300
        assert rec["chars"] == rec["measured_bytes"] and rec["words"] > 40  # ASCII text
        assert rec["observed_chars"] == rec["measured_bytes"] + rec["warmup_bytes"]
        assert rec["typed"] + rec["selections"] <= rec["chars"] and rec["suggest_calls"] >= rec["words"]
        assert 0 < rec["ksr"] < 1  # its commonest words are offered
        assert rec["ksr"] == pytest.approx(1 - (rec["typed"] + rec["selections"]) / rec["chars"])
        assert 0 <= rec["top1_accuracy"] <= rec["top3_accuracy"] <= 1
        # exact searches unless asked (KSR must not depend on the machine's load), and the share cut recorded
        assert rec["suggest_budget_ms"] == 0 and rec["suggest_cut"] == 0
    assert records["static"]["lr"] == 0 and records["sparse"]["lr"] > 0
    assert records["sparse"]["learned"] == ["adapter"]  # the tiny checkpoint has no "head" section: M learns
    table = stdout.splitlines()
    assert table[0].startswith(f"# keyboard suggestions, k=3, {tag}: ")
    rows = [line.split(" | ")[1] for line in table if line.startswith("| e-mails")]
    assert rows == ["ours (default), static (HTTP)", f"ours ({tag}, word model), static (HTTP)",
                    f"ours ({tag}, word model), session as served: adapter (HTTP) (lr {records['sparse']['lr']:g})"]

    # asked for by name, an in-process system is refused before anything runs (exit 2, argparse's one line): the
    # command's own process
    r = keyboard(corpora, *base, "--systems", "static,full")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--systems full cannot measure {tag} (tokenizer 'words')" in r.stderr
    assert sorted(p.name for p in out.glob("*.json")) == sorted(
        ["emails.static.json", f"emails.static@{tag}.json", f"emails.sparse@{tag}.json"])
