"""One session implementation (models/session.py) serves the engine and the in-process keyboard simulator: the
simulator typing a text in this process saves the keystrokes its server's sessions save, for a word model and for
a byte model whose sessions have a copy model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaptlm.cli import main
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def keyboard_sim(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """`adaptlm keyboard-sim ... --json`, called in this process (the command's process is tested in
    tests/test_cli_keysim.py and tests/clients/test_keysim.py; here the sessions are)."""
    capsys.readouterr()
    assert main(["keyboard-sim", *args, "--json"]) == 0, capsys.readouterr().err
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


@pytest.mark.parametrize("kind", ["words", "bytes with a copy model"])
def test_a_model_types_the_same_in_process_as_served(serve_app: Any, word_checkpoint: Path, copy_checkpoint: Path,
                                                     tmp_path: Path, kind: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = word_checkpoint if kind == "words" else copy_checkpoint
    text = tmp_path / "text.txt"
    text.write_bytes((ROOT / "tests" / "data" / "valid.txt").read_bytes()[:900])
    # the last 230 bytes from a line start: 203 characters, 40 words typed (each keystroke a search, in each run)
    common = ["--text", str(text), "--last-bytes", "230", "--warmup-bytes", "300", "--adapt"]
    local = keyboard_sim(capsys, *common, "--checkpoint", str(checkpoint))
    with serve_app(Settings(checkpoint=checkpoint, suggest_budget_ms=0)) as server:
        served = keyboard_sim(capsys, *common, "--url", server.url)
    assert local["words"] > 30 and local["adaptation"] == "sparse"
    for key in ("chars", "words", "typed", "selections", "top1", "top3"):
        assert local[key] == served[key], key
    assert local["ksr"] == pytest.approx(served["ksr"])
