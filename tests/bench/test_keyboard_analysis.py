"""`python -m bench.keyboard_losses` and `python -m bench.keyboard_replay` (record, then replay) run end to end on a
tiny slice of tests/data with the tiny checkpoint (their slices and training words replaced: no corpora), and
write what they promise: every typed word's outcome, and the same KSR replayed for the bar the session shows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import bench.keyboard_losses as losses
import bench.keyboard_replay as replay

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def tiny_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    text = (DATA / "valid.txt").read_bytes()[:700]
    text = text[: text.rfind(b"\n") + 1]
    (tmp_path / "tiny.txt").write_bytes(text)
    typed_from = text.rfind(b"\n", 0, len(text) - 1) + 1  # the last line typed, the rest observed first
    slices = {"tiny": {"analysis": ("tiny.txt", 0, typed_from, len(text)),
                       "check": ("tiny.txt", 0, typed_from, len(text))}}
    monkeypatch.setenv("ADAPTLM_DATA", str(tmp_path))
    for module in (losses, replay):
        monkeypatch.setattr(module, "SLICES", slices)
        monkeypatch.setattr(module, "training_words", lambda: {"the", "she", "her", "with"})
    return text[typed_from:].decode()


def test_keyboard_losses_records_every_typed_word(tiny_checkpoint: Path, tiny_slice: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "losses"
    monkeypatch.setattr(sys, "argv", ["keyboard_losses", "--checkpoint", str(tiny_checkpoint), "--texts", "tiny",
                                      "--out", str(out)])
    losses.main()
    summary = json.loads((out / "tiny.analysis.json").read_text())
    words = [json.loads(line) for line in (out / "tiny.analysis.words.jsonl").open()]
    assert summary["words"] == len(words) == len(replay.re.findall(replay.WORD, tiny_slice)) > 0
    assert 0 <= summary["ksr"] <= summary["oracle_ksr"] < 1
    assert all(w["kind"] in losses.CLASSES for w in words)


def test_keyboard_replay_records_and_replays(tiny_checkpoint: Path, tiny_slice: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    out = tmp_path / "replay"
    for what in ("record", "replay"):
        monkeypatch.setattr(sys, "argv", ["keyboard_replay", what, "--checkpoint", str(tiny_checkpoint), "--texts",
                                          "tiny", "--out", str(out), "--grid", "[dict(width=3, fold=False)]"])
        replay.main()
    records = [json.loads(line) for line in (out / "tiny.jsonl").open()]
    assert records and all(len(q["model"]) <= replay.WIDTH for r in records for w in r["words"] for q in w["q"])
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith("| {'width': 3, 'fold': False} |")
    assert 0 <= float(row.split("|")[2]) < 1
