"""Shedding load at the door (server/_admission.py): a request for model work beyond what the server holds
(`max_queue`, its HTTP processes' shares) is answered 429 `queue_full` at once, its body unread and its route not
run; what holds no model work (reads, health, metrics) passes; places free as answers end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from server._admission import SharedDoor, shared_places
from server.settings import Settings
from tests.server.conftest import AssertErrorFn, ServeFn

LONG = "It is a truth universally acknowledged. " * 3000  # about 120 KB: seconds of the tiny model's time


def _hold(url: str, path: str, body: dict[str, str]) -> socket.socket:
    """Send a request and leave its connection open, its answer unread (the work stays in flight)."""
    address = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_the_workers_of_a_server_share_its_places() -> None:
    """Two workers' doors (here in one process, each taking its own slot): the limit is the server's; a slot of a
    worker that died gives its places back to the one that takes it."""
    places = shared_places(2)
    one, two = SharedDoor(3, places), SharedDoor(3, places)
    assert [one.enter(), one.enter(), two.enter(), two.enter(), one.enter()] == [True, True, True, False, False]
    one.leave()
    assert two.enter() and not one.enter()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with places.get_lock():
        places[4], places[5] = gone.pid, 2  # a third slot, of a worker that died holding 2 places
        places[6] = os.getpid() + 10**7  # a fourth, of no process (the pid is beyond any)
    assert sum(places[2 * s + 1] for s in range(len(places) // 2)) == 5
    replacement = SharedDoor(3, places)  # takes the dead worker's slot
    assert replacement._slot == 2 and places[5] == 0
    two.leave()
    assert replacement.enter() and not replacement.enter()


def test_work_beyond_the_door_is_refused_at_once_and_the_rest_still_served(
        serve_app: ServeFn, tiny_checkpoint: Path, assert_error: AssertErrorFn) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, max_queue=2, max_request_engine_s=0, retry_after_s=2)
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        sid = c.post("/v1/sessions", json={}).json()["id"]
        held = [_hold(live.url, "/v1/score", {"text": LONG}) for _ in range(2)]
        try:
            time.sleep(0.5)
            start = time.monotonic()
            refused = c.post("/v1/score", json={"text": LONG})
            assert time.monotonic() - start < 2.0  # not after the held work
            assert assert_error(refused, 429, "rate_limit_error")["code"] == "queue_full"
            assert refused.headers["Retry-After"] == "2"
            assert assert_error(c.post(f"/v1/sessions/{sid}/observe", json={"text": "abc"}), 429,
                                "rate_limit_error")["code"] == "queue_full"
            # no model work: served whatever the load
            assert c.get(f"/v1/sessions/{sid}").status_code == 200
            assert c.get("/healthz").status_code == 200
            assert 'reason="queue_full"} 2.0' in c.get("/metrics").text
        finally:
            for sock in held:
                sock.close()  # the clients go away: their work is cancelled, their places free
        deadline = time.monotonic() + 30
        while (answer := c.post("/v1/score", json={"text": "abc"})).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer.status_code == 200
