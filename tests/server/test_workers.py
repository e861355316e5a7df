"""`adaptlm serve` with ADAPTLM_WORKERS=2, as a process tree: the engine's process and two uvicorn workers on one
port. Requests spread over both workers and one scrape counts them all; a worker that dies is replaced while the
other serves; SIGTERM drains (the observe in flight is answered), the sessions are kept, every process ends and the
parent exits 0. The wire and each answer are tests/server/test_engine_process.py's."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from server.launch import serving

LONG = "However little known the feelings or views of such a man may be on his first entering a neighbourhood. " * 20


def children(pid: int) -> set[int]:
    return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def workers(pid: int) -> set[int]:
    """The uvicorn workers among the children (multiprocessing also starts its resource tracker)."""
    return {c for c in children(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()}


def scores_counted(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(n) for n in re.findall(r'adaptlm_http_requests_total\{[^}]*route="/v1/score",status="200"\} (\S+)',
                                            metrics))


def test_two_workers_share_the_engine_survive_a_worker_and_drain(tiny_checkpoint: Path, tmp_path: Path) -> None:
    snapshot, log = tmp_path / "sessions.zip", tmp_path / "server.log"
    env = {"ADAPTLM_WORKERS": "2", "ADAPTLM_SESSION_SNAPSHOT": str(snapshot), "OMP_NUM_THREADS": "1"}
    with serving(tiny_checkpoint, log, env) as served:
        url, proc = served.url, served.process
        deadline = time.monotonic() + 60
        while len(workers(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        first = workers(proc.pid)
        assert len(first) == 2
        # each request on a connection of its own: the kernel hands them to either worker
        for _ in range(16):
            assert httpx.post(f"{url}/v1/score", json={"text": "abc"}, timeout=30).status_code == 200
        assert scores_counted(url) == 16  # both workers' counts, in whichever worker answered the scrape
        sid = httpx.post(f"{url}/v1/sessions", json={"initial_text": "Dear Sir, "}, timeout=30).json()["id"]

        os.kill(min(first), signal.SIGKILL)  # the supervisor starts another; the other worker serves meanwhile
        for _ in range(4):
            assert httpx.post(f"{url}/v1/score", json={"text": "abc"}, timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        while (len(workers(proc.pid)) < 2 or min(first) in workers(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        now = workers(proc.pid)
        assert len(now) == 2 and min(first) not in now

        answers: dict[str, Any] = {}

        def observe() -> None:  # in flight when the signal comes
            answers["observe"] = httpx.post(f"{url}/v1/sessions/{sid}/observe", json={"text": LONG}, timeout=120)

        thread = threading.Thread(target=observe)
        thread.start()
        time.sleep(0.3)
        tree = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(240) == 0, log.read_text()[-3000:]
        thread.join(60)
        assert answers["observe"].status_code == 200, answers["observe"].text
        assert answers["observe"].json()["bytes"] == len(LONG)
        assert snapshot.exists()
        deadline = time.monotonic() + 10  # (multiprocessing's resource tracker ends once it sees the parent go)
        while (left := [pid for pid in tree if Path(f"/proc/{pid}").exists()
                        and "zombie" not in Path(f"/proc/{pid}/status").read_text()]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]
