"""`python -m bench.host_overhead`: the launchers' host time per call. Without CUDA every Triton launch is stubbed, so
the figures are the Python around the launches: microseconds, never an interpreted kernel's milliseconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_case_is_timed_with_no_kernel_run(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "bench.host_overhead", "--calls", "3", "--json", str(tmp_path / "h.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "h.json").read_text())
    assert "launches stubbed" in got["how"]
    names = [row["case"] for row in got["rows"]]
    assert any(n.startswith("memory_attention decode") for n in names)
    assert any(n.startswith("compress_memory") for n in names) and any(n.startswith("batched_adapter") for n in names)
    # an interpreted launch takes milliseconds at these shapes; the host code alone, microseconds
    assert all(0 < row["us"] < 3000 for row in got["rows"]), got["rows"]


def test_refuses_a_bad_count(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # in this process: the count is refused before anything is stubbed or timed (the entry point and its exit status
    # are the subprocess test above)
    from bench.host_overhead import main

    monkeypatch.setattr(sys, "argv", ["python -m bench.host_overhead", "--calls", "0"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2 and "--calls" in capsys.readouterr().err
