"""`adaptlm keyboard-sim` with a checkpoint in the process (run in the test process, tests/_cli.py): its JSON and its
mistakes (exit 2, one line). The run against a server (--url) is in tests/clients/test_keysim.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests._cli import CliResult, run_cli

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def keyboard_sim(*args: str) -> CliResult:
    return run_cli("keyboard-sim", *args)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keysim") / "text.txt"
    path.write_bytes((DATA / "valid.txt").read_bytes()[:1200])
    return path


@pytest.mark.parametrize("adapt", [["--no-adapt"], ["--adapt"], ["--adapt", "--adapt-mode", "full"]])
def test_checkpoint_mode(tiny_checkpoint: Path, text: Path, adapt: list[str]) -> None:
    r = keyboard_sim("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--last-bytes", "500",
                     "--warmup-bytes", "400", "--suggestions", "3", *adapt, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["adaptation"] == {"--no-adapt": "static", "--adapt": "sparse"}.get(adapt[-1], "full")
    assert out["checkpoint"] == str(tiny_checkpoint) and out["suggestions"] == 3
    assert 400 <= out["measured_bytes"] <= 500 and 300 <= out["warmup_bytes"] <= 400
    assert out["observed_chars"] == out["measured_bytes"] + out["warmup_bytes"]  # ASCII text
    assert out["chars"] == out["measured_bytes"] and out["words"] > 50
    assert 0 <= out["ksr"] < 1
    assert out["ksr"] == pytest.approx(1 - (out["typed"] + out["selections"]) / out["chars"])
    assert 0 <= out["top1_accuracy"] <= out["top3_accuracy"] <= 1
    assert out["suggest_calls"] >= out["words"]
    assert out["suggest_ms_p99"] >= out["suggest_ms_p50"] > 0
    if adapt != ["--no-adapt"]:
        assert out["lr"] > 0 and out["segment"] >= 1
    # a word cache only with the sessions' settings (sparse), unless asked for
    assert out["cache_weight"] == (0.0 if adapt[-1] != "--adapt" else
                                   json.loads((tiny_checkpoint / "dyneval.json").read_text()).get(
                                       "session", {}).get("cache_weight", 0.0))
    # the human-readable line
    r = keyboard_sim("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--last-bytes", "200", *adapt)
    assert r.returncode == 0 and r.stdout.startswith("KSR "), r.stderr


def test_mistakes_exit_2(tiny_checkpoint: Path, text: Path, tmp_path: Path) -> None:
    cases = [
        ("--text", str(tmp_path / "missing.txt"), "--checkpoint", str(tiny_checkpoint)),
        ("--text", str(text)),  # neither --url nor --checkpoint
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--url", "http://127.0.0.1:1"),  # both
        ("--text", str(text), "--url", "http://127.0.0.1:1", "--adapt", "--adapt-mode", "full"),  # full: in-process
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--suggestions", "0"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--last-bytes", "0"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--cache-weight", "2"),
        ("--text", str(text), "--checkpoint", str(tmp_path)),  # not a checkpoint
        ("--checkpoint", str(tiny_checkpoint)),  # no --text
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--adapt", "--lr", "nan"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--adapt", "--adapt-mode", "full", "--decay", "-1"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--lr", "0.1"),  # --lr without --adapt
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--max-chars", "0"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--max-chars", "-3"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--max-chars", "65"),
        ("--text", str(text), "--checkpoint", str(tiny_checkpoint), "--progress", "-1"),
        ("--text", str(text), "--url", "http://127.0.0.1:1", "--device", "cpu"),  # --device: in-process only
    ]
    for args in cases:
        r = keyboard_sim(*args)
        err = r.stderr
        assert r.returncode == 2, (args, r.returncode, err)
        assert err.startswith("adaptlm: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert keyboard_sim("--text", str(empty), "--checkpoint", str(tiny_checkpoint)).returncode == 2


def test_unreachable_server_is_one_line_and_status_1(text: Path) -> None:
    """No server at --url: one line as `adaptlm client` prints it (no "(None, None)" for the missing status and
    type), exit status 1 (the server could not be reached: not the user's mistake)."""
    r = keyboard_sim("--text", str(text), "--url", "http://127.0.0.1:1")
    err = r.stderr
    assert r.returncode == 1, err
    assert err.startswith("adaptlm: error: no answer from ") and err.count("\n") == 1, err
    assert "None" not in err, err


def test_a_text_without_words_is_valid_json(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Lines with no word to type: the accuracies and latencies are undefined, null in the JSON (was NaN, which is
    not JSON)."""
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b"\n \n\n")
    r = keyboard_sim("--text", str(blank), "--checkpoint", str(tiny_checkpoint), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert out["words"] == 0 and out["top1_accuracy"] is None and out["suggest_ms_p50"] is None


def test_lr_names_the_memory_the_sessions_learn(tiny_checkpoint: Path, text: Path, tmp_path: Path) -> None:
    """With --adapt the in-process sessions are the server's: on a checkpoint whose sessions learn the output rows in
    place of M (as the default checkpoint's do), --lr and --decay set the rows' memory, M stays off, and --lr 0 is
    no weight learning, as the server's flat lr and decay."""
    path = tmp_path / "tiny-head"
    shutil.copytree(tiny_checkpoint, path)
    dyneval = json.loads((path / "dyneval.json").read_text())
    dyneval["session"] = {**(dyneval.get("session") or dyneval["sparse"]), "adapter": False}
    (path / "dyneval.json").write_text(json.dumps({**dyneval, "head": {"lr": 2e-3, "decay": 1e-4}}))
    for lr, memories in (("3e-3", ["head", "words"]), ("0", ["words"])):
        r = keyboard_sim("--text", str(text), "--checkpoint", str(path), "--last-bytes", "200", "--warmup-bytes",
                         "100", "--adapt", "--lr", lr, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["memories"] == memories
        assert (out["lr"], out["decay"]) == ((3e-3, 1e-4) if memories[0] == "head" else (0.0, 0.0))
