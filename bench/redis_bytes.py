"""Bytes a keystroke and an observe read from Redis, and written to it, through the server (in this process, on a
redis-server of its own): with the server's session cache (`ADAPTLM_SESSION_CACHE_BYTES`, the default) and without
it (0: every read fetches the whole session, as before the cache). One typist types messages a character at a time,
asking for suggestions at each keystroke, and observes each message when it is typed, as the load test's typist does
(loadtest/messages.txt). A second server on the same Redis (another replica) asks for one suggestion after each
observe: its copy of the session is then one observe old ("stale read"). Redis's own counters measure it (INFO:
`total_net_output_bytes` read by the server, `total_net_input_bytes` written), less what the INFO calls themselves
take. Also checks that both runs suggested the same completions at every keystroke as the memory store (the
reference: sessions never leave the process).

    python -m bench.redis_bytes [--checkpoint DIR] [--messages 3]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import redis
from starlette.testclient import TestClient

from bench._common import DEFAULT_CHECKPOINT, ROOT, machine_line, redis_on_loopback
from server.app import create_app
from server.settings import Settings

MESSAGES = ROOT / "loadtest" / "messages.txt"


def run(checkpoint: Path, url: str | None, cache_bytes: int, messages: list[str],
        ) -> tuple[list[Any], dict[str, list[int]]]:
    """-> every keystroke's suggestions, and per kind ("suggest", "observe", "stale read": the other replica's
    suggest) each request's (read, written) bytes (url None: the memory store, nothing measured, no other replica)."""
    info = redis.Redis.from_url(url or "redis://127.0.0.1:1/0")

    def counters() -> tuple[int, int]:
        if url is None:
            return 0, 0
        stats = info.info("stats")
        return int(stats["total_net_output_bytes"]), int(stats["total_net_input_bytes"])

    def measure(call: Callable[[], Any]) -> tuple[Any, int, int]:
        out0, in0 = counters()
        result = call()
        out1, in1 = counters()
        return result, out1 - out0 - idle[0], in1 - in0 - idle[1]

    idle = (0, 0)
    calibration = [measure(lambda: None) for _ in range(5)]
    idle = (min(c[1] for c in calibration), min(c[2] for c in calibration))
    settings = Settings(checkpoint=checkpoint, session_store=url or "memory",  # type: ignore[arg-type]
                        session_cache_bytes=cache_bytes, suggest_budget_ms=0)
    answers: list[Any] = []
    seen: dict[str, list[int]] = {"suggest read": [], "suggest written": [], "observe read": [],
                                  "observe written": [], "stale read": []}
    with TestClient(create_app(settings)) as client, \
            TestClient(create_app(settings)) if url is not None else nullcontext() as other:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        for message in messages:
            for n in range(1, len(message) + 1):
                body = {"context": message[:n], "k": 3}
                answer, read, written = measure(partial(client.post, f"/v1/sessions/{sid}/suggest", json=body))
                answer = answer.json()
                answers.append(answer)
                seen["suggest read"].append(read)
                seen["suggest written"].append(written)
            response, read, written = measure(partial(client.post, f"/v1/sessions/{sid}/observe",
                                                      json={"text": message + "\n"}))
            assert response.status_code == 200, response.text
            seen["observe read"].append(read)
            seen["observe written"].append(written)
            if other is not None:  # the other replica's copy (from its last read, one observe ago) is stale
                body = {"context": "", "k": 3}
                response, read, _ = measure(partial(other.post, f"/v1/sessions/{sid}/suggest", json=body))
                assert response.status_code == 200, response.text
                seen["stale read"].append(read)
        size = len(client.get(f"/v1/sessions/{sid}/state").content)
    info.close()
    seen["blob"] = [size]
    return answers, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    ap.add_argument("--messages", type=int, default=3, help="messages typed (from loadtest/messages.txt)")
    args = ap.parse_args()
    messages = [m for m in MESSAGES.read_text(encoding="utf-8").splitlines()
                if m.strip() and not m.startswith("#")][: args.messages]
    print(machine_line())
    print(f"{args.checkpoint}: {args.messages} messages, {sum(map(len, messages))} keystrokes")
    results = {}
    for name, cache_bytes in (("without the cache", 0), ("with the cache", Settings().session_cache_bytes)):
        with redis_on_loopback() as url:
            results[name] = run(args.checkpoint, url, cache_bytes, messages)
        _, seen = results[name]
        print(f"{name}: session blob {seen['blob'][0]} bytes at the end")
        for kind in ("suggest read", "suggest written", "observe read", "observe written", "stale read"):
            # the first keystroke creates the session, the other replica's first read is its first copy
            values = seen[kind][1:] if kind.startswith(("suggest", "stale")) else seen[kind]
            print(f"  {kind:16} median {statistics.median(values):>9.0f} B   max {max(values):>9} B")
    memory, _ = run(args.checkpoint, None, 0, messages)
    for name, (answers, _) in results.items():
        differ = [i for i, (a, b) in enumerate(zip(answers, memory, strict=True)) if a != b]
        print(f"suggestions {name} as the memory store's at every keystroke: {not differ}"
              + (f" (first differs at keystroke {differ[0] + 1} of {len(memory)})" if differ else ""))


if __name__ == "__main__":
    main()
