"""Load at which the service-level objectives stop holding, per locust user class (issue "Operate it").

For each class alone, users double (1, 2, 4, ...) against one `adaptlm serve` (default checkpoint, one torch
thread) until `loadtest/slo.toml` is missed; each level is a headless locust run of `--run-time` through
`python -m loadtest.run --url URL` (the same runner and checker as `make loadtest`). Prints, per class, the
highest level that met every objective with its requests/s, and the first that missed with what it missed.

    python -m bench.capacity [--classes Scorer,Typist,Generator,OpenAICompletions] [--max-users 128] [--run-time 30s]
                             [--levels 10,25,50,100] [--workers N] [--replicas N] [--p99-ms 30]

--workers N serves with ADAPTLM_WORKERS=N: the engine in its own process, N HTTP worker processes in front.

--replicas N serves with N replicas (each with --workers) sharing one Redis session store, run with compose's Redis
settings, behind the project's nginx balancer (deploy/nginx: a session's requests keep to one replica), all on this
machine (bench/_replicas.py, as tests/deploy/test_replicas.py runs them); locust loads the balancer. `--replicas 1`
is the same topology with one replica, the baseline to compare two with. Each level then also prints the Redis bytes
read and written per request of the class's own (per keystroke for Typist): Redis's own counters (INFO
total_net_output_bytes and total_net_input_bytes, as bench.redis_bytes reads them) over the level, divided by the
number of those requests, so a Typist's observes and session creations are in its keystrokes' share
(bench.redis_bytes splits them by kind, one typist at a time).

After each class: the most users held with its own request's p99 within --p99-ms (the keyboard's target for Typist),
the last level before the first that missed it.

With --levels, each class runs exactly those numbers of users (none skipped after a miss): the latency of its own
request at each (p50 and p99 ms, locust's) is then comparable between two commits.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from bench._common import DEFAULT_CHECKPOINT, machine_line, server_on_loopback
from bench._replicas import replicas_on_loopback

CLASSES = ["Scorer", "Typist", "Generator", "OpenAICompletions"]
# the request a class is about: its rate is the class's sustained rate (the aggregate also counts the
# generator's time-to-first-token and inter-token entries, one each per stream)
PRIMARY = {"Scorer": "/v1/score", "Typist": "/v1/sessions/{session_id}/suggest", "Generator": "/v1/generate [stream]",
           "OpenAICompletions": "/v1/completions"}


def aggregate(stats: Path) -> dict[str, dict[str, str]]:
    with stats.open(newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def level(url: str, cls: str, users: int, run_time: str, out: Path, processes: int = 1
          ) -> tuple[int, dict[str, dict[str, str]], str]:
    """One run -> (checker's exit status: 0 met, 1 missed), the stats rows by entry, the checker's output.
    `processes` > 1: locust's own workers (`--processes`), for more users than one process drives."""
    spread = ["--locust-arg=--processes", f"--locust-arg={processes}"] if processes > 1 else []
    r = subprocess.run([sys.executable, "-m", "loadtest.run", "--url", url, "--users", str(users),
                        "--spawn-rate", str(users), "--run-time", run_time, "--out", str(out), *spread, cls],
                       capture_output=True, text=True, timeout=600)
    rows = aggregate(out / "locust_stats.csv") if (out / "locust_stats.csv").exists() else {}
    return r.returncode, rows, r.stdout + r.stderr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--classes", type=lambda s: s.split(","), default=CLASSES)
    ap.add_argument("--max-users", type=int, default=128)
    ap.add_argument("--start-users", type=int, default=1)
    ap.add_argument("--run-time", default="30s")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                    help="run these numbers of users, all of them, instead of doubling until a miss")
    ap.add_argument("--workers", type=int, default=0, help="ADAPTLM_WORKERS (0: one process)")
    ap.add_argument("--url", help="a running server to load (default: start one here)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="N replicas on one Redis behind the nginx balancer (0: one server, its memory store)")
    ap.add_argument("--p99-ms", type=float, default=30.0, help="the p99 target of the users-held line")
    ap.add_argument("--locust-processes", type=int, default=1, help="locust processes (its --processes)")
    args = ap.parse_args(argv)
    if args.replicas < 0 or (args.replicas and args.url):
        ap.error("--replicas is a number of replicas to start here (not with --url)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = {"ADAPTLM_WORKERS": str(args.workers)}
    served = args.url or f"adaptlm serve (default checkpoint, one torch thread, ADAPTLM_WORKERS={args.workers})"
    if args.replicas:
        served = f"{args.replicas} x {served} on one Redis (compose's settings) behind nginx (deploy/nginx)"
    print(f"# {machine_line()}, {served} and locust ({args.locust_processes} process(es)) on the same machine")
    print(f"## objectives loadtest/slo.toml; each level {args.run_time}; "
          + (f"users {args.levels}" if args.levels else "users double until one is missed"))
    redis_column = " Redis B read / written per own request |" if args.replicas else ""
    print(f"| class | users | requests/s (all entries) | of its own request | its p50 / p99 ms | failures | met "
          f"| missed |{redis_column}")
    print(f"| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |{' ---: |' if args.replicas else ''}")
    if args.url:
        run_levels(args, args.url.rstrip("/"))
        return
    if args.replicas:
        with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp, \
                replicas_on_loopback(args.checkpoint, args.replicas, Path(tmp),
                                     {"OMP_NUM_THREADS": "1", "ADAPTLM_LOG_LEVEL": "warning", **env}) as (url, store):
            run_levels(args, url, store)
        return
    with server_on_loopback(args.checkpoint, env) as url:
        run_levels(args, url)


def redis_bytes(store: str) -> tuple[int, int]:
    """Redis's counters: bytes it sent (what the servers read) and received (what they wrote)."""
    with redis.Redis.from_url(store) as client:
        stats = client.info("stats")
    return int(stats["total_net_output_bytes"]), int(stats["total_net_input_bytes"])


def held(levels: list[tuple[int, float]], p99_ms: float) -> int:
    """The most users held within `p99_ms` of the levels run (users, own request's p99 ms): the last level before the
    first, by users, whose p99 was over it (0: none held). A level that met it above one that missed is noise, not
    capacity."""
    most = 0
    for users, p99 in sorted(levels):
        if p99 > p99_ms:
            break
        most = users
    return most


def run_levels(args: argparse.Namespace, url: str, store: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for cls in args.classes:
            levels = iter(args.levels or [])
            users = next(levels, None) if args.levels else args.start_users
            p99s: list[tuple[int, float]] = []
            while users is not None and (args.levels or users <= args.max_users):
                before = redis_bytes(store) if store else (0, 0)
                status, rows, output = level(url, cls, users, args.run_time, Path(tmp) / f"{cls}-{users}",
                                             args.locust_processes)
                total = rows.get("Aggregated", {})
                own = rows.get(PRIMARY.get(cls, ""), {})
                misses = [line[4:].strip() for line in output.splitlines() if line.startswith("MISS ")]
                # too few requests of an entry in the run is "not measured", not a missed objective
                missed = [m for m in misses if "min_requests" not in m]
                met = "yes" if status == 0 else ("not measured" if not missed else "no")
                p99 = float(own.get("99%") or "nan")
                if p99 == p99:  # not NaN: the entry had requests
                    p99s.append((users, p99))
                traffic = ""
                if store:
                    after = redis_bytes(store)
                    count = int(own.get("Request Count") or 0)
                    traffic = (f" {(after[0] - before[0]) / count:,.0f} / {(after[1] - before[1]) / count:,.0f} |"
                               if count else " - |")
                print(f"| {cls} | {users} | {float(total.get('Requests/s', 'nan')):.2f} | "
                      f"{float(own.get('Requests/s', 'nan')):.2f} | "
                      f"{own.get('50%', '?')} / {own.get('99%', '?')} | "
                      f"{total.get('Failure Count', '?')} | {met} | {'; '.join(misses)[:300]} |{traffic}", flush=True)
                if args.levels:
                    users = next(levels, None)
                    continue
                if missed or (status != 0 and status != 1):
                    break
                users *= 2
            print(f"{cls}: {held(p99s, args.p99_ms)} users held at p99 <= {args.p99_ms:g} ms of its own request "
                  f"(of the levels run: {', '.join(str(u) for u, _ in p99s) or 'none'})", flush=True)


if __name__ == "__main__":
    main()
