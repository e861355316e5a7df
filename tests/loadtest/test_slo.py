"""The objectives checker (loadtest/slo.py) on crafted locust stats CSVs: objectives met, missed, unmeasured."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import slo

HEADER = ("Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
          "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
          "99.99%,100%")
SHIPPED = Path(slo.__file__).resolve().parent / "slo.toml"


def stats_csv(tmp_path: Path, rows: list[tuple[str, str, int, int, int, int]]) -> Path:
    """rows: (type, name, requests, failures, p50, p99) -> a locust-shaped stats CSV with an Aggregated row."""
    lines = [HEADER]
    for type_, name, count, failures, p50, p99 in rows:
        lines.append(f"{type_},{name},{count},{failures},{p50},{p50},1,{p99},10,1.0,0.0,"
                     f"{p50},{p50},{p50},{p50},{p99},{p99},{p99},{p99},{p99},{p99},{p99}")
    total, failed = sum(r[2] for r in rows), sum(r[3] for r in rows)
    lines.append(f",Aggregated,{total},{failed},50,50,1,900,10,1.0,0.0,50,50,50,50,90,90,90,900,900,900,900")
    path = tmp_path / "locust_stats.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def slo_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "slo.toml"
    path.write_text(text)
    return path


OBJECTIVES = """
min_requests = 5
[total]
max_failure_ratio = 0.01
[entries."POST /v1/score"]
p50_ms = 100
p99_ms = 500
[entries."SSE /v1/generate time to first token"]
p99_ms = 300
max_failure_ratio = 0
"""


def test_all_met(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = stats_csv(tmp_path, [("POST", "/v1/score", 200, 1, 80, 450),
                                 ("SSE", "/v1/generate time to first token", 20, 0, 90, 300)])
    assert slo.main([str(stats), "--slo", str(slo_file(tmp_path, OBJECTIVES))]) == 0
    out = capsys.readouterr().out
    assert "MISS" not in out and "5 of 5 met" in out


@pytest.mark.parametrize(("row", "missed"), [
    (("POST", "/v1/score", 200, 1, 101, 450), "POST /v1/score: p50_ms 101"),
    (("POST", "/v1/score", 200, 1, 80, 510), "POST /v1/score: p99_ms 510"),
    (("POST", "/v1/score", 200, 3, 80, 450), "total: max_failure_ratio"),  # 3 / 220 > 1%
    (("POST", "/v1/score", 4, 0, 80, 450), "POST /v1/score: min_requests 4"),  # too few to measure
])
def test_one_missed(tmp_path: Path, capsys: pytest.CaptureFixture[str], row: tuple[str, str, int, int, int, int],
                    missed: str) -> None:
    stats = stats_csv(tmp_path, [row, ("SSE", "/v1/generate time to first token", 20, 0, 90, 300)])
    assert slo.main([str(stats), "--slo", str(slo_file(tmp_path, OBJECTIVES))]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("MISS")]
    assert len(lines) == 1 and missed in lines[0], lines


def test_entry_failure_ratio(tmp_path: Path) -> None:
    stats = stats_csv(tmp_path, [("POST", "/v1/score", 1000, 0, 80, 450),
                                 ("SSE", "/v1/generate time to first token", 20, 1, 90, 300)])
    results = slo.check(slo.load_slo(slo_file(tmp_path, OBJECTIVES)), slo.read_stats(stats))
    assert [(r.entry, r.objective) for r in results if not r.ok] == [
        ("SSE /v1/generate time to first token", "max_failure_ratio")]


def test_missing_entry(tmp_path: Path) -> None:
    stats = stats_csv(tmp_path, [("POST", "/v1/score", 200, 0, 80, 450)])
    objectives = slo.load_slo(slo_file(tmp_path, OBJECTIVES))
    missed = [r for r in slo.check(objectives, slo.read_stats(stats)) if not r.ok]
    assert [(r.entry, r.measured) for r in missed] == [("SSE /v1/generate time to first token", None)]
    assert all(r.ok for r in slo.check(objectives, slo.read_stats(stats), allow_missing=True))


def test_percentiles_not_available(tmp_path: Path) -> None:
    stats = slo.read_stats(stats_csv(tmp_path, [("POST", "/v1/score", 200, 0, 80, 450)]))
    stats["POST /v1/score"]["99%"] = "N/A"  # what locust writes for an entry without response times
    results = slo.check(slo.load_slo(slo_file(tmp_path, "[entries.\"POST /v1/score\"]\np99_ms = 500\n")), stats)
    assert [(r.objective, r.measured, r.ok) for r in results] == [("p99_ms", None, False)]


@pytest.mark.parametrize("text", ["[entries.\"POST /v1/score\"]\np99ms = 5\n", "[total]\np99_ms = 5\n",
                                  "max_failure = 0.1\n"])
def test_typos_are_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError):
        slo.load_slo(slo_file(tmp_path, text))
    stats = stats_csv(tmp_path, [("POST", "/v1/score", 200, 0, 80, 450)])
    assert slo.main([str(stats), "--slo", str(slo_file(tmp_path, text))]) == 2


def test_shipped_objectives_load() -> None:
    objectives = slo.load_slo(SHIPPED)
    assert objectives["total"]["max_failure_ratio"] <= 0.01
    assert {"POST /v1/score", "POST /v1/sessions/{session_id}/suggest", "SSE /v1/generate time to first token",
            "POST /v1/completions"} <= set(objectives["entries"])
