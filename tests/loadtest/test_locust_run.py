"""`python -m loadtest.run` (what `make loadtest` runs), for real: a server on a free loopback port with the tiny
checkpoint, locust headless with every user class of the mix, its CSV and HTML reports, the server's metrics at the
end, and the objectives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import slo

ROOT = Path(__file__).resolve().parents[2]
# Every entry of the mix; latency objectives loose enough for a busy CI machine: the test is that the whole
# chain works and no request fails, not this machine's speed (docs/benchmarks.md has the measured figures).
OBJECTIVES = """
min_requests = 1
[total]
max_failure_ratio = 0
[entries."POST /v1/score"]
p99_ms = 20000
[entries."POST /v1/sessions"]
p99_ms = 20000
[entries."POST /v1/sessions/{session_id}/suggest"]
p50_ms = 20000
min_requests = 5
[entries."POST /v1/generate [stream]"]
p99_ms = 20000
[entries."SSE /v1/generate time to first token"]
p99_ms = 20000
[entries."SSE /v1/generate inter-token latency"]
p99_ms = 20000
[entries."POST /v1/completions"]
p99_ms = 20000
[entries."GET /v1/models"]
p99_ms = 20000
"""


@pytest.fixture(scope="module")
def loadtest_run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[
        subprocess.CompletedProcess[str], Path]:
    """One `python -m loadtest.run` that starts its own server -> the finished process and its reports' folder."""
    folder = tmp_path_factory.mktemp("loadtest")
    objectives = folder / "slo.toml"
    objectives.write_text(OBJECTIVES)
    out = folder / "reports"
    # 8 users: the weights (typist 4, scorer 2, generator 1, openai 1) give each class at least one. Each user's
    # first request is sent as it starts (all of them in the first second), the typists' suggestions every 100 ms:
    # a few seconds give every entry its requests; locust lets the requests in flight at the end finish
    run = subprocess.run([sys.executable, "-m", "loadtest.run", "--checkpoint", str(tiny_checkpoint), "--users", "8",
                          "--spawn-rate", "8", "--run-time", "5s", "--out", str(out), "--slo", str(objectives),
                          "--locust-arg=--keystroke-ms", "--locust-arg=100", "--locust-arg=--max-tokens",
                          "--locust-arg=16"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    return run, out


def test_loadtest_run(loadtest_run: tuple[subprocess.CompletedProcess[str], Path], tmp_path: Path) -> None:
    run, out = loadtest_run
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "MISS" not in run.stdout and "service-level objectives:" in run.stdout
    assert (out / "report.html").stat().st_size > 10_000
    assert (out / "server.log").exists()
    stats = slo.read_stats(out / "locust_stats.csv")
    assert int(stats[slo.TOTAL]["Failure Count"]) == 0
    # and the same run against objectives it cannot meet: a miss, reported, exit status 1
    impossible = tmp_path / "impossible.toml"
    impossible.write_text('[entries."POST /v1/score"]\np50_ms = 0\n')
    check = subprocess.run([sys.executable, "-m", "loadtest.slo", str(out / "locust_stats.csv"), "--slo",
                            str(impossible)], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 1 and "MISS  POST /v1/score: p50_ms" in check.stdout, check.stdout


def test_the_stats_count_every_request_to_the_end(loadtest_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    # locust rewrites its stats CSV once a second and not when it stops; the locustfile writes the final figures at
    # exit, so the report counts what the server answered (its /metrics at the end of the run), the last second
    # included
    run, out = loadtest_run
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    metrics = (out / "server_metrics.txt").read_text()
    served = sum(float(m) for m in re.findall(
        r'adaptlm_http_requests_total\{[^}]*route="/v1/score"[^}]*\} ([0-9.e+]+)', metrics))
    stats = slo.read_stats(out / "locust_stats.csv")
    assert served > 0 and int(stats["POST /v1/score"]["Request Count"]) == served, (served, stats["POST /v1/score"])


def test_unknown_user_class_is_refused() -> None:
    run = subprocess.run([sys.executable, "-m", "loadtest.run", "--url", "http://127.0.0.1:9", "Nobody"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "unknown user classes" in run.stderr


def test_make_loadtest_passes_its_variables() -> None:
    # docs/operations.md, "Sizing": write your objectives into a copy of loadtest/slo.toml, then `make loadtest`
    # against them; `make -n` prints the command (`-o install`: without setting up the environment)
    run = subprocess.run(["make", "-n", "-o", "install", "loadtest", "URL=http://10.0.0.5:8000", "USERS=3",
                          "RUN_TIME=5s", "LOADTEST_OUT=var/typist", "SLO=var/mine.toml", "CLASSES=Typist Scorer"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    [command] = [line for line in run.stdout.splitlines() if "loadtest.run" in line]
    args = command.split()
    for flag, value in (("--url", "http://10.0.0.5:8000"), ("--users", "3"), ("--run-time", "5s"),
                        ("--out", "var/typist"), ("--slo", "var/mine.toml")):
        assert args[args.index(flag) + 1] == value, command
    assert args[-2:] == ["Typist", "Scorer"], command
    default = subprocess.run(["make", "-n", "-o", "install", "loadtest"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert "--slo loadtest/slo.toml" in default.stdout, default.stdout
