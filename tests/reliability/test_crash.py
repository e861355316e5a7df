"""`kill -9` of a real server process.

With the Redis store every change is written when the worker commits it, before the client's answer: killed
during a keyboard load (typists suggesting on keystrokes and observing their messages) and started again, the
server has every session whose creation was acknowledged, each exactly as after its last acknowledged observe
(its state, adapter, statistics and word cache equal those of a fresh session replaying the acknowledged texts).
One case is not a loss: an observe the worker committed whose answer the kill cut off is in the store although
its client never saw it acknowledged (a client that retries it adapts twice); it is counted apart.

With the in-memory store the snapshot file is written at a clean shutdown only, so a `kill -9` loses everything
since the process started: sessions created since are gone, observes since are undone, and sessions deleted
since come back, all as the snapshot of the last clean shutdown has them (untouched by the killed process).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load

from tests.reliability.conftest import RedisProcess, StartServerFn

MESSAGES = [line.strip() for line in (Path(__file__).resolve().parents[2] / "loadtest" / "messages.txt").read_text()
            .splitlines() if line.strip() and not line.startswith("#")]
# concurrent typists, so that observes are in flight together at the kill; more for a bigger run (docs/benchmarks.md)
TYPISTS = int(os.environ.get("ADAPTLM_CRASH_TYPISTS", "4"))


def export(client: httpx.Client, sid: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A session's export: its tensors and its metadata (the creation time and TTL left out)."""
    r = client.get(f"/v1/sessions/{sid}/state")
    assert r.status_code == 200, r.text
    blob = r.content
    meta = json.loads(json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]["session"])
    del meta["created"], meta["ttl_s"]
    return load(blob), meta


def same_state(a: tuple[dict[str, torch.Tensor], dict[str, Any]], b: tuple[dict[str, torch.Tensor], dict[str, Any]],
               exact: bool = False) -> bool:
    """Equal exports; tensors within float32 rounding unless `exact` (the replay runs in other batches, whose
    matmuls may round differently), bits of the statistics likewise."""
    (ta, ma), (tb, mb) = a, b
    if ta.keys() != tb.keys() or ma["memories"] != mb["memories"] or ma["config"] != mb["config"]:
        return False
    if ma["last_token"] != mb["last_token"]:
        return False
    sa, sb = ma["stats"], mb["stats"]
    if {k: sa[k] for k in sa if "bits" not in k} != {k: sb[k] for k in sb if "bits" not in k}:
        return False
    if exact:
        return sa == sb and all(torch.equal(ta[k], tb[k]) for k in ta)
    return all(abs(sa[k] - sb[k]) <= 1e-4 * max(1.0, abs(sb[k])) for k in sa if "bits" in k) and all(
        torch.allclose(ta[k], tb[k], rtol=1e-4, atol=1e-5) for k in ta)


@dataclass
class Typist:
    """One user: a session, messages typed with a suggestion every few keystrokes, then observed."""

    url: str
    seed: int
    session: str | None = None
    acknowledged: list[str] = field(default_factory=list)  # texts of the observes answered 200, in order
    in_flight: str | None = None  # the observe the kill cut off, if any
    suggestions: int = 0
    errors: list[str] = field(default_factory=list)  # any answer but the expected, before the kill

    def run(self, stop: threading.Event) -> None:
        rng = random.Random(self.seed)
        try:
            with httpx.Client(base_url=self.url, timeout=30) as c:
                r = c.post("/v1/sessions", json={})
                if r.status_code != 201:
                    self.errors.append(f"create: {r.status_code} {r.text[:200]}")
                    return
                self.session = r.json()["id"]
                while not stop.is_set():
                    message = rng.choice(MESSAGES) + "\n"
                    for i in range(3, len(message), 4):
                        r = c.post(f"/v1/sessions/{self.session}/suggest", json={"context": message[:i], "k": 3})
                        if r.status_code != 200:
                            self.errors.append(f"suggest: {r.status_code} {r.text[:200]}")
                            return
                        self.suggestions += 1
                        time.sleep(rng.uniform(0.0, 0.02))
                    self.in_flight = message
                    r = c.post(f"/v1/sessions/{self.session}/observe", json={"text": message})
                    if r.status_code != 200:
                        self.errors.append(f"observe: {r.status_code} {r.text[:200]}")
                        return
                    self.acknowledged.append(message)
                    self.in_flight = None
        except httpx.TransportError:  # the kill
            pass


def replay(client: httpx.Client, texts: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What a session is after observing `texts` one by one, from a fresh session of the same settings."""
    sid = client.post("/v1/sessions", json={}).json()["id"]
    for text in texts:
        assert client.post(f"/v1/sessions/{sid}/observe", json={"text": text}).status_code == 200
    state = export(client, sid)
    assert client.delete(f"/v1/sessions/{sid}").status_code == 204
    return state


def test_kill_9_with_redis_loses_no_acknowledged_session(start_server: StartServerFn,
                                                         redis_process: Any) -> None:
    store: RedisProcess = redis_process()
    env = {"ADAPTLM_SESSION_STORE": store.url}
    with start_server(env) as server:
        typists = [Typist(server.url, seed) for seed in range(TYPISTS)]
        stop = threading.Event()
        threads = [threading.Thread(target=t.run, args=(stop,), daemon=True) for t in typists]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while sum(len(t.acknowledged) for t in typists) < 2 * TYPISTS and time.monotonic() < deadline:
            time.sleep(0.05)
        # while observes are in flight (sent, not yet answered), the moment that can lose or half-do one
        deadline = time.monotonic() + 10
        while sum(t.in_flight is not None for t in typists) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        in_flight_at_kill = sum(t.in_flight is not None for t in typists)
        server.kill9()
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not [e for t in typists for e in t.errors], [e for t in typists for e in t.errors]
    assert sum(len(t.acknowledged) for t in typists) >= 2 * TYPISTS and sum(t.suggestions for t in typists) > 0

    with start_server(env) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        recovered = exact = ahead = 0
        for t in typists:
            assert t.session is not None  # every creation was acknowledged
            r = c.get(f"/v1/sessions/{t.session}")
            assert r.status_code == 200, r.text
            recovered += 1
            got = export(c, t.session)
            if same_state(got, replay(c, t.acknowledged)):
                exact += 1
            else:  # only the observe the kill cut off may be in it, committed but never answered
                assert t.in_flight is not None and same_state(got, replay(c, [*t.acknowledged, t.in_flight])), (
                    t.session, got[1]["stats"], len(t.acknowledged))
                ahead += 1
        # the sessions are usable, and keep adapting from where they were
        assert c.post(f"/v1/sessions/{typists[0].session}/observe", json={"text": "one more\n"}).status_code == 200
    observes = sum(len(t.acknowledged) for t in typists)
    print(f"kill -9 (redis): {recovered}/{len(typists)} acknowledged sessions recovered, {exact} exactly at their "
          f"last acknowledged observe ({observes} acknowledged observes, {sum(t.suggestions for t in typists)} "
          f"suggestions), {ahead} one committed-but-unanswered observe ahead ({in_flight_at_kill} observes "
          f"waiting for an answer at the kill)")
    assert recovered == exact + ahead == len(typists)


def test_kill_9_with_the_memory_store_loses_everything_since_start(start_server: StartServerFn,
                                                                   tmp_path: Path) -> None:
    snapshot = tmp_path / "sessions.zip"
    env = {"ADAPTLM_SESSION_SNAPSHOT": str(snapshot)}
    first, second = MESSAGES[0] + "\n", MESSAGES[1] + "\n"

    # a first process killed before any clean shutdown: no snapshot at all, nothing survives
    with start_server(env) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        lost = c.post("/v1/sessions", json={"initial_text": first}).json()["id"]
        server.kill9()
    assert not snapshot.exists()
    with start_server(env) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get(f"/v1/sessions/{lost}").status_code == 404
        # a clean shutdown writes the snapshot: a session that observed `first`, one to be deleted later
        kept = c.post("/v1/sessions", json={"initial_text": first}).json()["id"]
        doomed = c.post("/v1/sessions", json={}).json()["id"]
        at_shutdown = export(c, kept)
    assert snapshot.exists()
    written = snapshot.read_bytes()

    # the next process changes everything, then is killed
    with start_server(env) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert same_state(export(c, kept), at_shutdown, exact=True)
        assert c.post(f"/v1/sessions/{kept}/observe", json={"text": second}).status_code == 200
        new = c.post("/v1/sessions", json={"initial_text": second}).json()["id"]
        assert c.delete(f"/v1/sessions/{doomed}").status_code == 204
        server.kill9()
    assert snapshot.read_bytes() == written  # the killed process wrote nothing, and left no temporary file
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("sessions")) == ["sessions.zip"]

    # started again: the state of the last clean shutdown, exactly
    with start_server(env) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert same_state(export(c, kept), at_shutdown, exact=True)  # the observe since is undone
        assert c.get(f"/v1/sessions/{kept}").json()["stats"]["bytes_observed"] == len(first)
        assert c.get(f"/v1/sessions/{new}").status_code == 404  # created since: gone
        assert c.get(f"/v1/sessions/{doomed}").status_code == 200  # deleted since: back
