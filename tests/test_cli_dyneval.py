"""`adaptlm eval` and `adaptlm tune`: their output, files and mistakes (run in the test process, tests/_cli.py)."""

import json
import shutil
from pathlib import Path

import pytest

from tests._cli import run_cli as run

DATA = Path(__file__).resolve().parent / "data"


def test_eval_json_modes_csv_and_plot(tiny_checkpoint: Path, tmp_path: Path) -> None:
    r = run("eval", "--checkpoint", str(tiny_checkpoint), str(DATA / "valid.txt"), "--limit", "2000",
            "--mode", "static,sparse,cache", "--json", "--csv", str(tmp_path / "c.csv"),
            "--plot", str(tmp_path / "p.png"), "--window", "500")
    assert r.returncode == 0, r.stderr
    records = json.loads(r.stdout)
    assert [rec["mode"] for rec in records] == ["static", "sparse", "cache"]
    static, sparse, cache = records
    assert static["bytes"] == 2000 and static["params_adapted"] == 0 and static["state_bytes"] == 0
    assert sparse["params_adapted"] == 64 * 64 and sparse["state_bytes"] == 64 * 64 * 4
    assert {"lr", "decay", "eps", "segment", "adapter_units", "seconds"} <= set(sparse)
    assert {"cache_window", "cache_theta", "cache_lambda"} <= set(cache)
    rows = (tmp_path / "c.csv").read_text().splitlines()
    assert rows[0] == "position,static_bits_per_byte,sparse_bits_per_byte,cache_bits_per_byte"
    assert len(rows) == 1 + 4
    mean_static = sum(float(r.split(",")[1]) for r in rows[1:]) / 4
    assert mean_static == pytest.approx(static["bits_per_byte"], rel=1e-4)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_overrides_and_errors(tiny_checkpoint: Path) -> None:
    base = ("eval", "--checkpoint", str(tiny_checkpoint), str(DATA / "valid.txt"), "--limit", "1000", "--json")
    zero = json.loads(run(*base, "--mode", "sparse", "--lr", "0").stdout)
    static = json.loads(run(*base, "--mode", "static").stdout)
    assert zero["lr"] == 0 and zero["bits"] == pytest.approx(static["bits"], rel=1e-9)  # eta = 0 is static
    r = run(*base, "--mode", "magic")
    assert r.returncode == 2 and "unknown mode 'magic'" in r.stderr
    r = run(*base, "--mode", "dynamic", "--segment", "0")
    assert r.returncode == 2 and "segment" in r.stderr and "Traceback" not in r.stderr


def test_tune_writes_tuned_settings(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    r = run("tune", "--checkpoint", str(ck), "--valid", str(DATA / "valid.txt"), "--bytes", "1500",
            "--mode", "sparse", "--max-trials", "8")
    assert r.returncode == 0, r.stderr
    dyneval = json.loads((ck / "dyneval.json").read_text())
    assert dyneval["tuned"] is True and dyneval["tuned_on"] == {"file": "valid.txt", "bytes": 1500}
    sparse = dyneval["sparse"]
    assert sparse["trials"] <= 8
    assert sparse["valid_bpb"] <= sparse["valid_static_bpb"]
    # eval now defaults to the tuned values
    rec = json.loads(run("eval", "--checkpoint", str(ck), str(DATA / "valid.txt"), "--limit", "1500",
                         "--mode", "sparse", "--json").stdout)
    assert rec["lr"] == pytest.approx(sparse["lr"]) and rec["bits_per_byte"] == pytest.approx(sparse["valid_bpb"])


def test_tune_cache_writes_the_neural_cache_settings(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`adaptlm tune --mode cache`: a grid of theta and lambda at the window; the best is written as the "cache"
    section (with what it measured), and `eval --mode cache` then scores with it: the tuned figure, no worse than
    static (lambda 0 is on the grid)."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    r = run("tune", "--checkpoint", str(ck), "--valid", str(DATA / "valid.txt"), "--bytes", "1200",
            "--mode", "cache", "--cache-window", "300")
    assert r.returncode == 0, r.stderr
    dyneval = json.loads((ck / "dyneval.json").read_text())
    cache = dyneval["cache"]
    assert cache["window"] == 300 and cache["trials"] == 21
    # the cache says what it was tuned on; the full and sparse sections are still the trainer's, and not called tuned
    assert cache["tuned_on"] == {"file": "valid.txt", "bytes": 1200}
    assert dyneval["tuned"] is False and "tuned_on" not in dyneval
    assert cache["valid_bpb"] <= cache["valid_static_bpb"]
    rec = json.loads(run("eval", "--checkpoint", str(ck), str(DATA / "valid.txt"), "--limit", "1200",
                         "--mode", "cache", "--json").stdout)
    assert (rec["cache_window"], rec["cache_theta"], rec["cache_lambda"]) == (300, cache["theta"], cache["lam"])
    assert rec["bits_per_byte"] == pytest.approx(cache["valid_bpb"])
    r = run("tune", "--checkpoint", str(ck), "--valid", str(DATA / "valid.txt"), "--mode", "cache",
            "--cache-window", "0")
    assert r.returncode == 2 and "--cache-window must be positive" in r.stderr


def test_eval_outputs_are_checked_first_and_written_whole(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """--plot and --csv are checked before the evaluation (a format matplotlib cannot write, a directory), so a
    mistake costs no minutes and leaves nothing behind; a plot is written at exactly the path given (matplotlib
    alone adds .png to a name without a suffix, and writes `DIR.png` for `DIR/`)."""
    base = ("eval", "--checkpoint", str(tiny_checkpoint), str(DATA / "valid.txt"), "--limit", "500")
    for flags, message in ((("--plot", str(tmp_path / "p.txt")), "cannot write a plot as 'txt'"),
                           (("--csv", str(tmp_path)), "is a directory"),
                           (("--plot", str(tmp_path) + "/"), "is a directory")):
        r = run(*base, *flags)
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert list(tmp_path.iterdir()) == []
        assert not Path(str(tmp_path) + ".png").exists()
    r = run(*base, "--plot", str(tmp_path / "curve"), "--csv", str(tmp_path / "c.csv"), "--window", "100")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.csv", "curve"]
    assert (tmp_path / "curve").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_outputs_are_replaced_whole(tmp_path: Path) -> None:
    """Outputs (tune's dyneval.json, eval's CSV and plot, a session export) are written to a temporary file beside
    them and renamed: a write that stops half-way (a full disk, Ctrl-C) leaves the old file as it was and no
    temporary file behind; a write that fails is one line (UsageError)."""
    from adaptlm.cli._common import UsageError, write_whole

    target = tmp_path / "dyneval.json"
    target.write_text('{"old": true}')

    def half_then_interrupted(path: Path) -> None:
        path.write_text('{"new": tr')
        raise KeyboardInterrupt

    def half_then_disk_full(path: Path) -> None:
        path.write_text('{"new": tr')
        raise OSError(28, "No space left on device")

    with pytest.raises(KeyboardInterrupt):
        write_whole(target, half_then_interrupted)
    with pytest.raises(UsageError, match="dyneval.json: cannot write \\(No space left on device\\)"):
        write_whole(target, half_then_disk_full)
    assert target.read_text() == '{"old": true}' and [p.name for p in tmp_path.iterdir()] == ["dyneval.json"]
    write_whole(target, lambda path: path.write_text('{"new": true}'))
    assert target.read_text() == '{"new": true}' and [p.name for p in tmp_path.iterdir()] == ["dyneval.json"]


@pytest.mark.parametrize("args, message", [
    (("eval", "--window", "0"), "--window must be positive"),
    (("eval", "--limit", "-5"), "--limit must not be negative"),
    (("eval", "--csv", "/nonexistent-dir/c.csv"), "/nonexistent-dir/c.csv: cannot write"),
    (("eval", "--plot", "/nonexistent-dir/p.png"), "/nonexistent-dir/p.png: cannot write"),
    (("tune", "--bytes", "0"), "--bytes must be positive"),
    (("tune", "--bytes", "-5"), "--bytes must be positive"),
    (("tune", "--max-trials", "0"), "--max-trials must be positive"),
    (("tune", "--lr-start", "-1"), "--lr-start must be a finite positive number"),
    (("tune", "--lr-start", "inf"), "--lr-start must be a finite positive number"),
    (("eval", "--mode", ""), "--mode: give at least one of static"),
    (("eval", "--mode", ",,"), "--mode: give at least one of static"),
    (("eval", "--mode", "static", "--lr", "0.1"), "--lr applies to the modes dynamic, sparse"),
    (("eval", "--mode", "static,cache", "--segment", "10"), "--segment applies to the modes dynamic, sparse"),
    (("eval", "--mode", "dynamic", "--adapter-size", "4"), "--adapter-size applies to the modes sparse"),
    (("eval", "--mode", "sparse", "--layers-from", "1"), "--layers-from applies to the modes dynamic"),
    (("eval", "--mode", "sparse,cache", "--sites", "w_x"), "--sites applies to the modes dynamic"),
])
def test_eval_and_tune_refuse_bad_numbers_in_one_line(tiny_checkpoint: Path, tmp_path: Path,
                                                      args: tuple[str, ...], message: str) -> None:
    """A bad number or an output file that cannot be written is a usage error (status 2, one line), not a
    traceback, and a negative --limit or --bytes does not silently cut the text from its end."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    command, *flags = args
    where = ["--valid", str(DATA / "valid.txt")] if command == "tune" else [str(DATA / "valid.txt")]
    r = run(command, "--checkpoint", str(ck), *where, *flags)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (ck / "dyneval.json").read_bytes() == (tiny_checkpoint / "dyneval.json").read_bytes()
