"""X-Request-ID: every answer carries one (the client's own when it is a safe one, a new one otherwise), whoever
answers it, and the server's access log prints it on the request's line."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.request_id import request_id_for
from tests.server.test_shutdown import server

NEW = re.compile(r"[0-9a-f]{32}")


def test_every_answer_carries_an_id(client: httpx.Client, parse_sse: Any) -> None:
    answers = [client.get("/healthz"), client.post("/v1/score", json={"text": "abc"}),
               client.get("/nowhere"),  # 404 from the router
               client.post("/v1/score", json={"text": ""}),  # 422 from validation
               client.post("/v1/score", content=b"x" * (20 << 20), headers={"content-type": "application/json"})]
    assert [r.status_code for r in answers] == [200, 200, 404, 422, 413]
    ids = [r.headers["x-request-id"] for r in answers]
    assert all(NEW.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)
    with client.stream("POST", "/v1/generate", json={"prompt": "a", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and NEW.fullmatch(r.headers["x-request-id"])
        assert "finish_reason" in parse_sse(r.read().decode().splitlines())[-1]


@pytest.mark.parametrize(("given", "kept"), [("trace-42", True), ("a1b2.c3_d4:e5", True), ("x" * 128, True),
                                             ("x" * 129, False), ("two words", False), ("", False),
                                             ("<script>", False), ("é", False)])
def test_the_clients_id_is_kept_when_it_is_safe(client: httpx.Client, given: str, kept: bool) -> None:
    r = client.get("/healthz", headers={"X-Request-ID": given.encode("utf-8")})  # type: ignore[dict-item]
    assert r.headers["x-request-id"] == given if kept else NEW.fullmatch(r.headers["x-request-id"])
    assert request_id_for(given) == given if kept else request_id_for(given) != given


# The text access log (`"POST /v1/score HTTP/1.1" 200 OK [trace-42]`) is checked in test_shutdown.py, on a server
# process that test starts anyway.


def test_json_logs_are_one_object_a_line(tiny_checkpoint: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTLM_LOG_FORMAT", "json")
    log = tmp_path / "server.log"
    with server(tiny_checkpoint, tmp_path / "sessions.zip", log) as (url, proc):
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/score", json={"text": "abc"}, headers={"X-Request-ID": "trace-7"}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(240) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]  # every line is JSON
    assert all({"time", "level", "logger", "message", "request_id"} <= set(line) for line in lines)
    access = [line for line in lines if line.get("request_id") == "trace-7"]
    assert len(access) == 1 and access[0]["logger"] == "uvicorn.access", access
    assert (access[0]["method"], access[0]["path"], access[0]["status"]) == ("POST", "/v1/score", 200)
    own = [line for line in lines if line["logger"].startswith("server.")]
    assert own and all(line["request_id"] == "-" for line in own)  # the engine's lines: no request of their own
    assert lines[-1]["message"] == f"Finished server process [{proc.pid}]"  # uvicorn's own lines too
