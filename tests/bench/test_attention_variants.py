"""`python -m bench.attention_variants --smoke`: the script a GPU session runs to check the attention kernel's settings
compiled and time them. Here it runs in the Triton interpreter at tiny shapes, where every setting is correct, so it
must report every check passed and time each setting. The smoke runs call its `main` in this process (the Triton
interpreter is on here, as for tests/kernels): a subprocess would only add an interpreter and torch's import; the
entry point and its exit status are the subprocess test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _smoke(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`main` with these arguments in this process -> what it printed. Needs the interpreter on a CPU."""
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in the Triton interpreter, on a CPU")
    from bench import attention_variants
    from kernels import attention

    monkeypatch.setattr(attention, "TUNING", attention.TUNING)  # main sets it per setting: the same after the test
    monkeypatch.setattr(sys, "argv", ["python -m bench.attention_variants", *args])
    attention_variants.main()
    return capsys.readouterr().out


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "bench.attention_variants", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


@pytest.mark.interpreter
def test_smoke_run_checks_and_times_every_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = _smoke(monkeypatch, capsys, "--smoke", "--json", str(tmp_path / "v.json"))
    got = json.loads((tmp_path / "v.json").read_text())
    from bench.attention_variants import SDPA_ROWS, SETTINGS

    assert [c["setting"] for c in got["checks"]] == SETTINGS  # float16 only: the interpreter mis-handles bf16 dots
    assert all(c["ok"] and 0 <= c["ratio"] <= 1 for c in got["checks"]), got["checks"]
    timed = {t["setting"] for t in got["times"] if t["ms"] and t["ms"] > 0}
    assert timed == set(SETTINGS) | set(SDPA_ROWS)
    assert "| splits=0 | float16 | yes |" in out
    assert got["fastest"] in SETTINGS and f"fastest: {got['fastest']} (" in out


@pytest.mark.interpreter
def test_settings_named_are_the_ones_checked_and_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # a second GPU call narrows the list to the candidates: only those are checked, timed (in turns) and may win
    named = ["shipped", "splits=2"]
    _smoke(monkeypatch, capsys, "--smoke", "--settings", ";".join(named), "--json", str(tmp_path / "v.json"))
    got = json.loads((tmp_path / "v.json").read_text())
    from bench.attention_variants import SDPA_ROWS

    assert [c["setting"] for c in got["checks"]] == named
    timed = [t["setting"] for t in got["times"] if t["ms"] and t["ms"] > 0]
    assert set(timed) == set(named) | set(SDPA_ROWS) and len(timed) == 3 * len(set(timed))  # 3 cases each
    assert got["fastest"] in named


def test_fastest_is_the_smallest_geometric_mean_of_the_fully_timed() -> None:
    from bench.attention_variants import fastest

    def t(setting: str, case: str, ms: float | None) -> dict[str, object]:
        return {"setting": setting, "mode": "fwd", "case": case, "ms": ms}
    times = [t("a", "x", 1.0), t("a", "y", 4.0), t("b", "x", 0.5), t("b", "y", 4.0), t("c", "x", 0.1),
             t("c", "y", None), t("d", "x", 0.1)]  # c failed a case, d missed one: neither can win
    best, ratio = fastest(times, ["a", "b", "c", "d"])  # type: ignore[misc]
    assert best == "b" and abs(ratio - 0.5**0.5) < 1e-9
    assert fastest([t("c", "x", None)], ["c"]) is None


def test_without_cuda_it_needs_smoke() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = _run()
    assert r.returncode == 2 and "no CUDA device" in r.stderr
