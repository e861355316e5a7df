"""The `adaptlm` command line: exit codes, stdout/stderr. Commands run in the test process (tests/_cli.py); the
entry point, a closed standard output and Ctrl-C run as a user runs them, in a process of their own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models.checkpoint import load_checkpoint
from models.scoring import score_bytes
from tests._cli import run_cli as run

DATA = Path(__file__).resolve().parent / "data"


def test_score_json(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`python -m adaptlm score FILE --json` end to end, in a process of its own: the entry point."""
    data = (DATA / "valid.txt").read_bytes()[:4000]
    (tmp_path / "text.txt").write_bytes(data)
    r = subprocess.run([sys.executable, "-m", "adaptlm", "score", "--checkpoint", str(tiny_checkpoint),
                        str(tmp_path / "text.txt"), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"bits_per_byte", "bytes", "bits"}
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


def test_generate_prompt_is_the_bytes_given(tiny_checkpoint: Path) -> None:
    """A prompt that is not UTF-8 on the command line (`--prompt $'ab\\xff'`): a byte model continues those bytes
    (was a UnicodeEncodeError traceback)."""
    r = run("generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "ab\udcff", "--max-tokens", "5")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_generate_with_a_word_model_continues_the_prompt_as_typed(word_checkpoint: Path) -> None:
    """`adaptlm generate` samples through models.sampling.generate, token healing included: after "It was the " the
    first word comes without a second space, the same text as the library's."""
    from models.sampling import SamplingParams, generate

    r = run("generate", "--checkpoint", str(word_checkpoint), "--prompt", "It was the ", "--max-tokens", "6",
            "--temperature", "0")
    assert r.returncode == 0, r.stderr
    ck = load_checkpoint(word_checkpoint)
    expected = "".join(generate(ck.model, b"It was the ", SamplingParams(max_tokens=6, temperature=0),
                                tokenizer=ck.tokenizer))
    assert r.stdout == expected + "\n" and not r.stdout.startswith(" ") and "<unk>" not in r.stdout


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
        (("train", "--data", "{dir}", "--out", "{tmp}"), "a directory, not a text file"),
        (("train", "--data", "{valid}", "--valid", "{one}", "--out", "{tmp}", "--max-steps", "2"),
         "too short to validate on"),
        (("train", "--data", "{valid}", "--out", "{file}/ck"), "not a writable directory"),
        (("train", "--data", "{valid}", "--out", "{ck}"), "already holds a checkpoint"),
        (("train", "--data", "{valid}", "--out", "{ck}", "--resume", "--overwrite"), "not both"),
        (("train", "--data", "{valid}", "--out", "{tmp}", "--lr", "nan"), "lr must be a finite number"),
        (("train", "--data", "{valid}", "--out", "{tmp}", "--max-minutes", "-1"), "max_minutes must be >= 0"),
        (("train", "--data", "{valid}", "--out", "{tmp}", "--threads", "-2"), "threads must be >= 0"),
        (("generate", "{ck}", "--prompt", "x", "--top-p", "2"), "top_p"),
        (("generate", "{ck}", "--prompt", "x", "--seed", "99999999999999999999999"), "--seed must be between 0 and"),
        (("generate", "{ck}", "--prompt", "x", "--seed", "-1"), "--seed must be between 0 and"),
        (("score", "{ck}", "{valid}", "--bogus"), "unrecognized arguments"),
        (("score", "{ck}", "{valid}", "--device", "tpu"), "device must be auto, cpu, cuda or cuda:N"),
        (("eval", "{ck}", "{valid}", "--device", "cuda:99"), "cuda:99"),
        (("serve", "--checkpoint", "{dir}", "--port", "1"), "config.json: missing"),
        (("serve", "{ck}", "--device", "cuda:99", "--port", "1"), "cuda:99"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(tiny_checkpoint: Path, tmp_path: Path, args: tuple[str, ...],
                                             message: str) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "bad.json").write_text('{"learning_rate": 3}')
    (tmp_path / "one.txt").write_bytes(b"a")
    subst = {"{ck}": f"--checkpoint={tiny_checkpoint}", "{empty}": str(tmp_path / "empty.txt"),
             "{valid}": str(DATA / "valid.txt"), "{tmp}": str(tmp_path / "out"), "{badcfg}": str(tmp_path / "bad.json"),
             "{dir}": str(tmp_path), "{one}": str(tmp_path / "one.txt"), "{file}": str(tmp_path / "one.txt")}
    if args[0] == "train":
        subst["{ck}"] = str(tiny_checkpoint)  # an existing checkpoint as --out: refused, never touched
    before = {p.name: p.stat().st_mtime_ns for p in tiny_checkpoint.iterdir()}
    r = run(*[a.replace("{file}", subst["{file}"]) if a.startswith("{file}") else subst.get(a, a) for a in args])
    assert {p.name: p.stat().st_mtime_ns for p in tiny_checkpoint.iterdir()} == before
    assert not (tmp_path / "out").exists()  # nothing written for a refused run
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


def test_stdout_closed_early_is_no_traceback(tiny_checkpoint: Path) -> None:
    """`adaptlm generate ... | head -c 10`: the reader goes away; the command stops quietly, with the status of a
    process that SIGPIPE ended (141), not a BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "adaptlm", "generate", "--checkpoint", str(tiny_checkpoint),
                          "--prompt", "The ", "--max-tokens", "100000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    assert len(p.stdout.read(10)) == 10
    p.stdout.close()
    stderr = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, stderr
    assert stderr == ""


def test_ctrl_c_while_the_command_line_is_read_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT before the command starts (the parser builds, which imports the trainer's flags): 130, no traceback."""
    from adaptlm import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["score", "-"]) == 130


def test_broken_checkpoint_files_are_one_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint whose files are there but wrong (a model card that is not UTF-8, a config field of the wrong
    type): one line naming the file, status 2."""
    import shutil

    card, field = tmp_path / "card", tmp_path / "field"
    shutil.copytree(tiny_checkpoint, card)
    (card / "MODEL_CARD.md").write_bytes(b"\xff\xfe model card")
    shutil.copytree(tiny_checkpoint, field)
    cfg = json.loads((field / "config.json").read_text())
    cfg["model"]["hidden"] = "wide"
    (field / "config.json").write_text(json.dumps(cfg))
    for ck, message in ((card, "MODEL_CARD.md: not UTF-8"), (field, "config.json: ")):
        r = run("score", "--checkpoint", str(ck), str(DATA / "valid.txt"))
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_train_cli_writes_a_checkpoint(tmp_path: Path) -> None:
    r = run("train", "--preset", "tiny", "--data", str(DATA / "train.txt"), "--valid", str(DATA / "valid.txt"),
            "--out", str(tmp_path / "ck"), "--max-steps", "4", "--quiet")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["steps"] == 4 and summary["best_valid_bpb"] is not None
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.meta["training_config"]["max_steps"] == 4


def test_train_without_validation_prints_null_and_is_not_overwritten_by_mistake(tmp_path: Path) -> None:
    args = ("train", "--preset", "tiny", "--data", str(DATA / "valid.txt"), "--out", str(tmp_path / "ck"),
            "--max-steps", "3", "--quiet")
    r = run(*args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))["best_valid_bpb"] is None
    again = run(*args)
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    replaced = run(*args, "--overwrite", "--max-steps", "4")
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads(replaced.stdout)["steps"] == 4
    assert '"step": 3' not in (tmp_path / "ck" / "train.jsonl").read_text()  # a new run, a new log


def test_train_ctrl_c_saves_the_state_and_resume_finishes_the_run(tmp_path: Path) -> None:
    """SIGINT in the middle of `adaptlm train`: one line on stderr, status 130, the state after the last whole step in
    OUT/last; --resume goes on from that step."""
    import signal
    import time

    out = tmp_path / "ck"
    args = ("train", "--preset", "tiny", "--data", str(DATA / "valid.txt"), "--out", str(out), "--quiet")
    p = subprocess.Popen([sys.executable, "-m", "adaptlm", *args, "--max-steps", "100000"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "train.jsonl").is_file() or '"train_bpb"' not in (out / "train.jsonl").read_text():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert "stopped by SIGINT at step" in stderr and "--resume" in stderr
    step = int(stderr.split("at step ")[1].split(":")[0])
    assert step >= 20 and stdout == ""
    r = run(*args, "--resume", "--max-steps", str(step + 2))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == step + 2
