"""SIGTERM on a real `adaptlm serve` process: it finishes the work in flight, writes the in-memory sessions to the
snapshot file (ADAPTLM_SESSION_SNAPSHOT), exits 0; started again, it serves the same sessions."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load

from server.launch import serving

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."
# about 100 batched model steps (an observe takes one per ~20 bytes): the signal comes after its first ones
LONG = "However little known the feelings or views of such a man may be on his first entering a neighbourhood. " * 20


@contextmanager
def server(checkpoint: Path, snapshot: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with serving(checkpoint, log, {"ADAPTLM_SESSION_SNAPSHOT": str(snapshot), "ADAPTLM_LOG_LEVEL": "info"}) as served:
        yield served.url, served.process


def same_export(a: bytes, b: bytes) -> bool:
    """Equal tensors and metadata (safetensors writes the metadata's keys in an order that varies by process)."""
    ta, tb = load(a), load(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta) and header(a) == header(b)


def header(blob: bytes) -> Any:
    return json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM, then a clean exit: the app drains and the process exits 0. (uvicorn alone re-raises the signal it
    caught after its shutdown, and status 143, "terminated by SIGTERM", reads as a failure to supervisors.)"""
    proc.send_signal(signal.SIGTERM)
    # the drain finishes a 2 KB observe: a second or two on a quiet machine, a minute or more on a loaded CI runner
    assert proc.wait(240) == 0
    assert log.read_text().rstrip().endswith(f"Finished server process [{proc.pid}]"), log.read_text()[-3000:]


def text_steps(client: httpx.Client) -> float:
    """The batched model calls of text work (scores, observes) so far: adaptlm_batch_rows' count."""
    metrics = client.get("/metrics").text
    return sum(float(n) for n in re.findall(r'adaptlm_batch_rows_count\{[^}]*work="text"[^}]*\} (\S+)', metrics))


def test_sigterm_finishes_the_work_and_keeps_the_sessions(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The restarted server's text access log is checked too, where a real process writes it (X-Request-ID)."""
    snapshot, log = tmp_path / "sessions.zip", tmp_path / "server.log"
    answers: dict[str, Any] = {}
    with server(tiny_checkpoint, snapshot, log) as (url, proc), httpx.Client(base_url=url, timeout=120) as c:
        sid = c.post("/v1/sessions", json={"initial_text": TEXT}).json()["id"]
        gone = c.post("/v1/sessions", json={}).json()["id"]
        assert c.delete(f"/v1/sessions/{gone}").status_code == 204
        # a session left alone until the signal: its export and a score with it, to compare after the restart
        kept = c.post("/v1/sessions", json={"initial_text": TEXT[::-1]}).json()["id"]
        blob = c.get(f"/v1/sessions/{kept}/state").content
        probe = c.post("/v1/score", json={"text": "the end", "session_id": kept}).json()

        def observe() -> None:  # in flight when the signal comes
            answers["observe"] = httpx.post(f"{url}/v1/sessions/{sid}/observe", json={"text": LONG}, timeout=120)

        thread = threading.Thread(target=observe)
        before = text_steps(c)
        thread.start()
        deadline = time.monotonic() + 120
        while text_steps(c) == before and "observe" not in answers and time.monotonic() < deadline:
            time.sleep(0.01)  # until the server works on it
        assert "observe" not in answers, "the observe ended before the signal; make LONG longer"
        stop(proc, log)
        thread.join(60)
    assert answers["observe"].status_code == 200, answers["observe"].text  # finished, not dropped
    assert snapshot.exists(), log.read_text()[-3000:]
    with server(tiny_checkpoint, snapshot, log) as (url, proc), httpx.Client(base_url=url, timeout=60) as c:
        session = c.get(f"/v1/sessions/{sid}").json()
        assert session["stats"]["bytes_observed"] == len(TEXT) + len(LONG)
        assert c.get(f"/v1/sessions/{gone}").status_code == 404
        assert same_export(c.get(f"/v1/sessions/{kept}/state").content, blob)  # bit-identical through a restart
        assert c.post("/v1/score", json={"text": "the end", "session_id": kept}).json() == probe
        # and its access log names each request by its id (test_request_id.py: the ids)
        assert c.post("/v1/score", json={"text": "abc"}, headers={"X-Request-ID": "trace-42"}).status_code == 200
        missing = c.get("/v1/sessions/no-such-session-0123456789")
        stop(proc, log)
    text = log.read_text()
    assert '"POST /v1/score HTTP/1.1" 200 OK [trace-42]' in text
    assert f'"GET /v1/sessions/no-such-session-0123456789 HTTP/1.1" 404 Not Found [{missing.headers["x-request-id"]}]' \
        in text
    assert re.search(r"INFO server\.\S+ \[-\]: ", text), text[-2000:]  # the server's own lines, outside a request


def test_serve_reads_the_checkpoint_once_and_stops_its_engine_when_the_port_is_taken(
        tiny_checkpoint: Path, monkeypatch: Any) -> None:
    """`adaptlm serve` loads the checkpoint before uvicorn starts (a bad one is the CLI's one line) and only then:
    each file is hashed once (the CLI used to read it onto the meta device first, then the engine again). A start-up
    that fails after the load (the port is taken) ends with uvicorn's status 3 and the engine stopped."""
    import models.checkpoint as checkpoint
    from adaptlm import cli
    from server import app, request_id

    hashed: list[str] = []
    real_hash, real_start = checkpoint._sha256, app.start_engine
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: hashed.append(path.name) or real_hash(path))
    engines: list[Any] = []
    monkeypatch.setattr(app, "start_engine", lambda settings: engines.append(real_start(settings)) or engines[-1])
    monkeypatch.setattr(request_id, "install", lambda log_format: None)  # leave pytest's log handlers alone
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            cli.main(["serve", "--checkpoint", str(tiny_checkpoint), "--host", "127.0.0.1",
                      "--port", str(taken.getsockname()[1])])
            raise AssertionError("serve started on a port that is taken")
        except SystemExit as e:
            assert e.code == 3
    assert sorted(hashed) == ["model.safetensors", "stats.safetensors"]
    assert len(engines) == 1 and not engines[0].alive
