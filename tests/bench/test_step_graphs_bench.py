"""bench.step_graphs (the model step with the bucketed runner against the model's own path) runs and prints its
table: every case, a ratio each, nothing left to the model's path."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bench import step_graphs


def test_prints_every_case_side_by_side(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["step_graphs", "--checkpoint", str(tiny_checkpoint), "--rows", "3",
                                      "--search-rows", "5", "--static-steps", "9", "--repeat", "1"])
    step_graphs.main()
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", out, flags=re.MULTILINE)
    assert [r[0] for r in rows] == ["score 3 rows x 20 steps", "static score 3 rows x 9 steps",
                                    "peek 3 rows x 20 steps, per-row adapters", "search step 5 rows of 1 sessions"]
    assert all(float(own) > 0 and float(ratio) > 0 for _, own, _, ratio in rows)
    assert "0 graphs captured, 0 calls left to the model's own path" in out  # on the CPU: eager, every call taken
