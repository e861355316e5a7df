"""One session implementation (models/session.py) serves the engine and the in-process keyboard simulator: the
simulator typing a text in this process saves the keystrokes its server's sessions save, for a word model and for
a byte model whose sessions have a copy model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def keyboard_sim(*args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "adaptlm", "keyboard-sim", *args, "--json"], capture_output=True,
                       cwd=ROOT, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr.decode()
    out: dict[str, Any] = json.loads(r.stdout)
    return out


@pytest.mark.parametrize("kind", ["words", "bytes with a copy model"])
def test_a_model_types_the_same_in_process_as_served(serve_app: Any, word_checkpoint: Path, copy_checkpoint: Path,
                                                     tmp_path: Path, kind: str) -> None:
    checkpoint = word_checkpoint if kind == "words" else copy_checkpoint
    text = tmp_path / "text.txt"
    text.write_bytes((ROOT / "tests" / "data" / "valid.txt").read_bytes()[:900])
    common = ["--text", str(text), "--last-bytes", "400", "--warmup-bytes", "300", "--adapt"]
    local = keyboard_sim(*common, "--checkpoint", str(checkpoint))
    with serve_app(Settings(checkpoint=checkpoint, suggest_budget_ms=0)) as server:
        served = keyboard_sim(*common, "--url", server.url)
    assert local["words"] > 30 and local["adaptation"] == "sparse"
    for key in ("chars", "words", "typed", "selections", "top1", "top3"):
        assert local[key] == served[key], key
    assert local["ksr"] == pytest.approx(served["ksr"])
