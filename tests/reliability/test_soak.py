"""Soak (`make soak`; marked slow): the locust mix of loadtest/ (scorers, streaming generators, typists with a
session each, OpenAI-format clients) against one server process for 10 minutes. No request fails, and the server's
resident memory after the warm-up grows by less than 10% (the median of the last minute against the median of the
first minute after the warm-up). The memory curve is written to soak_memory.csv and soak_memory.png.

    ADAPTLM_SOAK_S            how long (default 600 s)
    ADAPTLM_SOAK_WARMUP_S     not judged (default 60 s: the sessions are made, the allocator settles)
    ADAPTLM_SOAK_USERS        locust users (default 8: each class of the mix at least once)
    ADAPTLM_SOAK_OUT          where the curve goes (default docs/img)
    ADAPTLM_SOAK_CHECKPOINT   the server's checkpoint (default: the tests' tiny one)
"""

from __future__ import annotations

import csv
import os
import statistics
import threading
import time
from pathlib import Path

import pytest

from loadtest import slo
from loadtest.run import run_locust
from tests.reliability.conftest import run_server

ROOT = Path(__file__).resolve().parents[2]
# read here, not in the test: pytest-timeout's limit (600 s in pyproject.toml) must outlast the run
SOAK_S = float(os.environ.get("ADAPTLM_SOAK_S", "600"))
SAMPLE_S = 5.0
JUDGED_S = 60.0  # the first and the last minute after the warm-up are compared


def plot(samples: list[tuple[float, int]], warmup_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([t / 60 for t, _ in samples], [rss / 2**20 for _, rss in samples], lw=1.5)
    ax.axvline(warmup_s / 60, color="grey", ls="--", lw=1, label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("server resident memory (MiB)")
    ax.set_ylim(0, 1.15 * max(rss for _, rss in samples) / 2**20)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 300)
def test_soak(tiny_checkpoint: Path, tmp_path: Path) -> None:
    duration = SOAK_S
    warmup = float(os.environ.get("ADAPTLM_SOAK_WARMUP_S", "60"))
    users = int(os.environ.get("ADAPTLM_SOAK_USERS", "8"))
    out = Path(os.environ.get("ADAPTLM_SOAK_OUT", str(ROOT / "docs" / "img")))
    checkpoint = Path(os.environ.get("ADAPTLM_SOAK_CHECKPOINT", str(tiny_checkpoint)))
    assert duration >= warmup + 2 * JUDGED_S, "ADAPTLM_SOAK_S must leave two minutes after the warm-up"
    out.mkdir(parents=True, exist_ok=True)
    reports = tmp_path / "locust"
    reports.mkdir()

    samples: list[tuple[float, int]] = []
    with run_server(checkpoint, tmp_path / "server.log") as server:
        status: list[int] = []
        locust = threading.Thread(target=lambda: status.append(run_locust(
            server.url, reports, users=users, spawn_rate=users, run_time=f"{int(duration)}s")), daemon=True)
        start = time.monotonic()
        locust.start()
        while locust.is_alive():
            samples.append((time.monotonic() - start, server.rss_bytes()))
            locust.join(SAMPLE_S)
        samples.append((time.monotonic() - start, server.rss_bytes()))
        assert server.process.poll() is None, server.tail()
    assert status == [0], server.tail()

    with (out / "soak_memory.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "rss_bytes"])
        writer.writerows((f"{t:.1f}", rss) for t, rss in samples)
    first = [rss for t, rss in samples if warmup <= t < warmup + JUDGED_S]
    last = [rss for t, rss in samples if t >= samples[-1][0] - JUDGED_S]
    growth = statistics.median(last) / statistics.median(first) - 1
    stats = slo.read_stats(reports / "locust_stats.csv")
    total = stats[slo.TOTAL]
    requests, failures = int(total["Request Count"]), int(total["Failure Count"])
    peak = max(rss for t, rss in samples if t >= warmup)
    title = (f"soak ({checkpoint.name}): {users} locust users (the mix), {duration / 60:g} min, {requests} requests, "
             f"{failures} failed; RSS after warm-up {growth * 100:+.1f}%")
    plot(samples, warmup, out / "soak_memory.png", title)
    print(f"\n{title}; first minute after warm-up {statistics.median(first) / 2**20:.1f} MiB, last minute "
          f"{statistics.median(last) / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB; curve in {out}/soak_memory.*")
    for name, row in sorted(stats.items()):
        print(f"  {name}: {row['Request Count']} requests, {row['Failure Count']} failures, p50 "
              f"{row.get('50%', '?')} ms, p99 {row.get('99%', '?')} ms")
    assert requests > 10 * duration / 60 and failures == 0, (requests, failures)
    assert growth < 0.10, f"resident memory grew {growth * 100:.1f}% after the warm-up"
