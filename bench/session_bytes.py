"""Bytes of one served session, in the memory store and in Redis, through the HTTP API only (so that the same
script measures any commit): `adaptlm serve` (bench.server.serve), a fresh session, then one after it observes
`--observe` characters of the e-mails (the same text each run). Figures: GET /v1/sessions/{id} `state_bytes` (the
session's own count), /metrics `adaptlm_session_store_bytes` (memory store: its tensors; Redis: its export blob),
and for Redis the blob's length and `MEMORY USAGE` of the session's hash key (a redis-server of its own on a free
loopback port).

    ADAPTLM_DATA=corpora python -m bench.session_bytes [--checkpoint checkpoints/default] [--observe 4096]
                                                       [--sessions 2] [--stores memory,redis]
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis

from bench._common import data_file
from bench.server import MESSAGES, serve


@contextmanager
def redis_server(tmp: str) -> Iterator[str]:
    """A redis-server of our own on a free loopback TCP port (the server takes redis:// URLs only)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(150):
            try:
                with redis.Redis.from_url(url) as r:
                    r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def store_bytes(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    found = re.search(r"^adaptlm_session_store_bytes(?:\{[^}]*\})? (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else -1


def redis_figures(rurl: str, sid: str) -> tuple[int, int]:
    """(the stored export's length: its parts, less their layout, or the one `blob` of an older record; MEMORY USAGE
    of the hash key) of session `sid`."""
    with redis.Redis.from_url(rurl) as r:
        keys = [k for k in r.scan_iter(match=f"*:s:{sid}")]
        if len(keys) != 1:
            return -1, -1
        state = [k for k in r.hkeys(keys[0]) if k in (b"blob", b"hdr") or k.startswith(b"c:")]
        return sum(int(r.hstrlen(keys[0], k)) for k in state), int(r.memory_usage(keys[0], samples=0) or -1)


def run(checkpoint: str, kind: str, rurl: str | None, text: str, sessions: int, log: Path) -> None:
    settings = {"session_store": rurl} if rurl else {}
    with serve(checkpoint, log, **settings) as url, httpx.Client(base_url=url, timeout=600) as http:
        for stage in ("fresh", f"after observing {len(text):,} chars"):
            rows = []
            for _ in range(sessions):
                before = store_bytes(url)
                sid = http.post("/v1/sessions", json={}).raise_for_status().json()["id"]
                if stage != "fresh":
                    http.post(f"/v1/sessions/{sid}/observe", json={"text": text}).raise_for_status()
                info = http.get(f"/v1/sessions/{sid}").raise_for_status().json()
                delta = store_bytes(url) - before
                blob, usage = redis_figures(rurl, sid) if rurl else (-1, -1)
                rows.append((info["state_bytes"], delta, blob, usage))
                http.delete(f"/v1/sessions/{sid}").raise_for_status()
            distinct = sorted(set(rows))
            for state_bytes, delta, blob, usage in distinct:
                n = rows.count((state_bytes, delta, blob, usage))
                print(f"| {kind} | {stage} | {n} | {state_bytes:,} | {delta:,} | "
                      f"{'' if blob < 0 else f'{blob:,}'} | {'' if usage < 0 else f'{usage:,}'} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--observe", type=int, default=4096, help="characters of e-mails each session observes")
    ap.add_argument("--sessions", type=int, default=2, help="sessions measured per stage")
    ap.add_argument("--stores", default="memory,redis")
    args = ap.parse_args()
    text = data_file(MESSAGES).read_text(encoding="utf-8")[: args.observe]
    print(f"# session bytes, checkpoint {args.checkpoint}")
    print("| store | session | sessions | state_bytes (GET) | adaptlm_session_store_bytes delta "
          "| Redis blob bytes | Redis MEMORY USAGE |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="session-bytes-") as tmp:
        log = Path(tmp) / "server.log"
        try:
            if "memory" in args.stores:
                run(args.checkpoint, "memory", None, text, args.sessions, log)
            if "redis" in args.stores:
                with redis_server(tmp) as rurl:
                    run(args.checkpoint, "redis", rurl, text, args.sessions, log)
        except Exception:
            print(log.read_text()[-3000:] if log.exists() else "(no server log)")
            raise


if __name__ == "__main__":
    main()
