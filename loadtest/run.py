"""`make loadtest`: a headless locust run against a server, its reports, and the service-level objectives.

    python -m loadtest.run                                  # starts a server (checkpoints/default) on a free port
    python -m loadtest.run --url http://host:8000           # an existing server
    python -m loadtest.run --users 16 --run-time 2m Typist  # one user class (names: see loadtest/locustfile.py)

Writes <out>/locust_stats.csv (and locust's other CSVs), <out>/report.html, and for a server it started
<out>/server.log and <out>/server_metrics.txt (its /metrics at the end of the run: what the server counted, gone
with its process otherwise), then checks <out>/locust_stats.csv against the objectives (loadtest/slo.py) and exits
1 when one is missed, 2 when the run itself failed. A server it starts inherits the environment (ADAPTLM_*
settings), with OMP_NUM_THREADS=1 unless it is set.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from loadtest import slo
from server.launch import stop, wait_ready

__all__ = ["main", "run_locust", "save_metrics", "start_server"]

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
USER_CLASSES = ("Scorer", "Generator", "Typist", "OpenAICompletions")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def start_server(checkpoint: str | Path | None = None, log: Path | None = None, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> Iterator[str]:
    """`adaptlm serve` in a subprocess on a free loopback port, until the block ends -> its URL (once ready)."""
    for _ in range(3):  # the port is chosen, then bound by the server: another process may take it between
        port = _free_port()
        command = [sys.executable, "-m", "adaptlm", "serve", "--host", "127.0.0.1", "--port", str(port)]
        if checkpoint is not None:
            command += ["--checkpoint", str(checkpoint)]
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            if wait_ready(url, process, time.monotonic() + timeout_s):
                yield url
                return
            if process.poll() is None:
                raise RuntimeError(f"the server was not ready in {timeout_s} s")
        finally:
            stop(process)
            if log:
                out.close()  # type: ignore[union-attr]
    raise RuntimeError(f"the server did not start (exit status {process.returncode}; see {log or 'its output'})")


def run_locust(url: str, out: Path, users: int, spawn_rate: float, run_time: str, classes: Sequence[str] = (),
               extra: Sequence[str] = ()) -> int:
    """A headless locust run -> its exit status; CSVs under out/locust_*.csv, the HTML report out/report.html.
    Failures do not change the status (the objectives judge them)."""
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
               "-u", str(users), "-r", str(spawn_rate), "-t", run_time, "--csv", str(out / "locust"),
               "--html", str(out / "report.html"), "--exit-code-on-error", "0", "--only-summary",
               "--stop-timeout", "5", *extra, *classes]
    return subprocess.run(command, check=False).returncode


def save_metrics(url: str, path: Path) -> None:
    """The server's /metrics now, into `path`; a failure to read them is said, not fatal (the run is done)."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as e:
        print(f"warning: could not read the server's /metrics: {e}", file=sys.stderr)
        return
    path.write_text(response.text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n")[0])
    parser.add_argument("classes", nargs="*", metavar="CLASS", help=f"user classes ({', '.join(USER_CLASSES)}); "
                                                                    "default: the weighted mix of all")
    parser.add_argument("--url", help="a running server (default: start one on a free loopback port)")
    parser.add_argument("--checkpoint", help="the checkpoint of a server started here (default: the server's)")
    parser.add_argument("--users", type=int, default=8, help="concurrent users (default 8)")
    parser.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second (default 4)")
    parser.add_argument("--run-time", default="60s", help="how long, locust's format: 30s, 2m (default 60s)")
    parser.add_argument("--out", default="var/loadtest", help="folder of the reports (default var/loadtest)")
    parser.add_argument("--slo", default=str(HERE / "slo.toml"), help="objectives (default loadtest/slo.toml)")
    parser.add_argument("--locust-arg", action="append", default=[], metavar="ARG",
                        help="passed to locust as is (repeat: --locust-arg=--keystroke-ms --locust-arg=300)")
    args = parser.parse_args(argv)
    unknown = set(args.classes) - set(USER_CLASSES)
    if unknown:
        parser.error(f"unknown user classes {sorted(unknown)}; choose among {', '.join(USER_CLASSES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("locust_*.csv"):
        old.unlink()

    def run(url: str) -> int:
        print(f"locust: {args.users} users for {args.run_time} against {url}; reports in {out}/", flush=True)
        return run_locust(url, out, args.users, args.spawn_rate, args.run_time, args.classes, args.locust_arg)

    if args.url:
        status = run(args.url.rstrip("/"))
    else:
        (out / "server.log").unlink(missing_ok=True)
        (out / "server_metrics.txt").unlink(missing_ok=True)
        # one thread unless told otherwise, as bench/ measures: torch's default (a thread per core) contends with
        # locust on the same machine and, on a small one, makes every latency several times longer
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with start_server(args.checkpoint, log=out / "server.log", env=threads) as url:
            status = run(url)
            save_metrics(url, out / "server_metrics.txt")
    stats = out / "locust_stats.csv"
    if status != 0 or not stats.exists():
        print(f"error: locust failed (exit status {status})", file=sys.stderr)
        return 2
    slo_args = [str(stats), "--slo", args.slo] + (["--allow-missing"] if args.classes else [])
    return slo.main(slo_args)


if __name__ == "__main__":
    raise SystemExit(main())
