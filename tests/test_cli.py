"""The `adaptlm` command line, run as a user runs it: a subprocess, exit codes, stdout/stderr."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.checkpoint import load_checkpoint
from models.scoring import score_bytes

DATA = Path(__file__).resolve().parent / "data"


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptlm", *args], capture_output=True, text=True,
                          input=stdin.decode() if stdin is not None else None, timeout=300)


def test_score_json(tiny_checkpoint: Path) -> None:
    r = run("score", "--checkpoint", str(tiny_checkpoint), str(DATA / "valid.txt"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"bits_per_byte", "bytes", "bits"}
    data = (DATA / "valid.txt").read_bytes()
    assert out["bytes"] == len(data)
    assert out["bits_per_byte"] == pytest.approx(out["bits"] / out["bytes"])
    expected = score_bytes(load_checkpoint(tiny_checkpoint).model, data)
    assert out["bits"] == pytest.approx(expected.bits, rel=1e-6)
    assert 1.0 < out["bits_per_byte"] < 8.0


def test_score_stdin_and_plain(tiny_checkpoint: Path) -> None:
    r = run("score", "--checkpoint", str(tiny_checkpoint), "-", stdin=b"It is a truth universally acknowledged")
    assert r.returncode == 0, r.stderr
    assert "bits per byte" in r.stdout


def test_generate_is_seeded(tiny_checkpoint: Path) -> None:
    args = ("generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "The ", "--max-tokens", "30", "--seed", "3")
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and len(a.stdout) > 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("score", "{ck}", "{empty}"), "empty text"),
        (("score", "{ck}", "/no/such/file.txt"), "cannot read"),
        (("score", "--checkpoint", "/no/such/dir", "{valid}"), "not a checkpoint directory"),
        (("train", "--preset", "huge", "--data", "{valid}", "--out", "{tmp}"), "invalid choice"),
        (("train", "--data", "/no/such/file", "--out", "{tmp}"), "no such file"),
        (("train", "--preset", "tiny", "--data", "{valid}", "--out", "{tmp}", "--resume"), "nothing to resume"),
        (("train", "--config", "{badcfg}", "--data", "{valid}", "--out", "{tmp}"), "unknown training setting"),
        (("generate", "{ck}", "--prompt", "x", "--top-p", "2"), "top_p"),
        (("score", "{ck}", "{valid}", "--bogus"), "unrecognized arguments"),
        (("score", "{ck}", "{valid}", "--device", "tpu"), "device must be auto, cpu, cuda or cuda:N"),
        (("eval", "{ck}", "{valid}", "--device", "cuda:99"), "cuda:99"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(tiny_checkpoint: Path, tmp_path: Path, args: tuple[str, ...],
                                             message: str) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "bad.json").write_text('{"learning_rate": 3}')
    subst = {"{ck}": f"--checkpoint={tiny_checkpoint}", "{empty}": str(tmp_path / "empty.txt"),
             "{valid}": str(DATA / "valid.txt"), "{tmp}": str(tmp_path / "out"), "{badcfg}": str(tmp_path / "bad.json")}
    r = run(*[subst.get(a, a) for a in args])
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_checkpoint_of_another_architecture(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    ck = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model"]["arch"] = "compressive_transformer"
    (ck / "config.json").write_text(json.dumps(cfg))
    r = run("score", "--checkpoint", str(ck), str(DATA / "valid.txt"))
    assert r.returncode == 2 and "unknown architecture 'compressive_transformer'" in r.stderr


def test_train_cli_writes_a_checkpoint(tmp_path: Path) -> None:
    r = run("train", "--preset", "tiny", "--data", str(DATA / "train.txt"), "--valid", str(DATA / "valid.txt"),
            "--out", str(tmp_path / "ck"), "--max-steps", "10", "--quiet")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["steps"] == 10
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.meta["training_config"]["max_steps"] == 10
