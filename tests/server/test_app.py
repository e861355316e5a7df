"""The API end to end, against a real uvicorn server with the tiny checkpoint."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.checkpoint import load_checkpoint
from models.scoring import score_bytes
from server.settings import Settings

TEXT = "Elinor, this eldest daughter, whose advice was so effectual, possessed a strength of understanding."


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Any:
    return load_checkpoint(tiny_checkpoint).model


def test_healthz(client: httpx.Client) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_readyz(client: httpx.Client, tiny_checkpoint: Path) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "model": tiny_checkpoint.name}


def test_models_in_openai_shape(client: httpx.Client, tiny_checkpoint: Path) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert set(card) == {"id", "object", "created", "owned_by", "tokenizer", "vocab_size"}
    assert card["tokenizer"] == "bytes" and card["vocab_size"] == 256
    assert card["id"] == tiny_checkpoint.name
    assert card["object"] == "model"
    assert isinstance(card["created"], int) and card["created"] > 0


@pytest.mark.parametrize("text", [TEXT, "a", "héllo wörld ✓ 🙂\n\tend", "\x00"])
def test_score_matches_score_bytes(client: httpx.Client, reference: Any, text: str) -> None:
    r = client.post("/v1/score", json={"text": text, "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    data = text.encode("utf-8")
    assert body["bytes"] == len(data)
    assert body["bits_per_byte"] == pytest.approx(body["bits"] / body["bytes"], rel=1e-12)
    assert len(body["logprobs"]) == len(data)
    assert set(body) == {"model", "bits", "bytes", "bits_per_byte", "logprobs", "session_id", "nonfinite_reset"}
    expected = score_bytes(reference, data, logprobs=True)
    # float32 on both sides, but not the same kernels (the server batches and pads): a few ulps apart on any CPU
    assert body["bits"] == pytest.approx(expected.bits, rel=1e-6)
    assert body["logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)
    assert body["bits"] == pytest.approx(-sum(body["logprobs"]) / 0.6931471805599453, abs=1e-4)


def test_score_without_logprobs(client: httpx.Client, reference: Any, tiny_checkpoint: Path) -> None:
    r = client.post("/v1/score", json={"text": TEXT})
    assert r.status_code == 200
    body = r.json()
    assert body["logprobs"] is None
    assert body["model"] == tiny_checkpoint.name
    assert body["bits"] == pytest.approx(score_bytes(reference, TEXT.encode()).bits, rel=1e-6)


@pytest.mark.parametrize(("payload", "param", "code"), [
    ({"text": ""}, "text", "string_too_short"),
    ({}, "text", "missing"),
    ({"text": "a", "temperature": 1}, "temperature", "extra_forbidden"),
    ({"text": 3}, "text", "string_type"),
    ({"text": ["a"]}, "text", "string_type"),
    ({"text": "a", "logprobs": "yes"}, "logprobs", "bool_type"),
    ({"text": "a", "logprobs": 1}, "logprobs", "bool_type"),
    ([{"text": "a"}], None, "model_attributes_type"),
])
def test_invalid_requests_are_422(client: httpx.Client, assert_error: Any, payload: Any, param: str | None,
                                  code: str) -> None:
    error = assert_error(client.post("/v1/score", json=payload), 422, "validation_error", param)
    assert error["code"] == code


def test_lone_surrogate_is_422(client: httpx.Client, assert_error: Any) -> None:
    r = client.post("/v1/score", content=b'{"text": "a\\ud800b"}', headers={"content-type": "application/json"})
    assert_error(r, 422, "validation_error", "text")


@pytest.mark.parametrize("content", [b'{"text": "a"', b"not json", b'{"text": "a",}'])
def test_malformed_json_is_400(client: httpx.Client, assert_error: Any, content: bytes) -> None:
    r = client.post("/v1/score", content=content, headers={"content-type": "application/json"})
    assert assert_error(r, 400, "invalid_request_error")["code"] == "invalid_json"


def test_body_without_json_content_type_is_422(client: httpx.Client, assert_error: Any) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = client.post("/v1/score", content=b'{"text": "a"}', headers=form)
    assert "application/json" in assert_error(r, 422, "validation_error")["message"]


def test_unknown_route_is_404(client: httpx.Client, assert_error: Any) -> None:
    assert_error(client.get("/v1/nothing-here"), 404, "not_found_error")
    assert_error(client.post("/v1/chat/completions", json={}), 404, "not_found_error")


def test_wrong_method_is_405(client: httpx.Client, assert_error: Any) -> None:
    r = client.get("/v1/score")
    assert_error(r, 405, "method_not_allowed_error")
    assert r.headers["allow"] == "POST"


def test_keeps_serving_after_bad_requests(client: httpx.Client) -> None:
    for _ in range(3):
        client.post("/v1/score", content=b"{", headers={"content-type": "application/json"})
        client.post("/v1/score", json={"text": ""})
        client.get("/nowhere")
    r = client.post("/v1/score", json={"text": TEXT})
    assert r.status_code == 200
    assert client.get("/readyz").status_code == 200


def test_unexpected_exception_is_500_without_details(live: Any, client: httpx.Client, assert_error: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(data: bytes, logprobs: bool = False) -> None:
        raise RuntimeError("secret-internal-detail")

    monkeypatch.setattr(live.app.state.engine, "score", broken)
    r = client.post("/v1/score", json={"text": TEXT})
    error = assert_error(r, 500, "server_error")
    assert "secret" not in r.text and "Traceback" not in r.text
    assert error["message"] == "internal server error"
    monkeypatch.undo()
    assert client.post("/v1/score", json={"text": TEXT}).status_code == 200


def test_metrics(client: httpx.Client, tiny_checkpoint: Path) -> None:
    client.get("/healthz")
    client.post("/v1/score", json={"text": TEXT})
    client.post("/v1/score", json={"text": ""})
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    model = tiny_checkpoint.name
    assert f'adaptlm_http_requests_total{{method="GET",model="{model}",route="/healthz",status="200"}}' in text
    assert f'adaptlm_http_requests_total{{method="POST",model="{model}",route="/v1/score",status="200"}}' in text
    assert f'adaptlm_http_requests_total{{method="POST",model="{model}",route="/v1/score",status="422"}}' in text
    assert 'adaptlm_http_request_duration_seconds_bucket{le="0.005"' in text
    assert f'adaptlm_scored_bytes_total{{model="{model}"}}' in text


def test_metrics_say_when_the_kernels_failed_their_check(tiny_checkpoint: Path, serve_app: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # what the alert AdaptlmKernelCheckFailed reads (deploy/prometheus/adaptlm.rules.yml); 0 on a healthy server
    from server.engine import _loading

    for result, value in ((("reference", ""), 0.0), (("reference", "RuntimeError: no kernel image"), 1.0)):
        monkeypatch.setattr(_loading, "serving_kernels", lambda ckpt, result=result: result)
        with serve_app(Settings(checkpoint=tiny_checkpoint)) as live:
            lines = [line for line in httpx.get(f"{live.url}/metrics").text.splitlines()
                     if line.startswith("adaptlm_kernel_check_failed{")]
        assert len(lines) == 1 and float(lines[0].rsplit(" ", 1)[1]) == value, lines

def test_metrics_label_unknown_routes_by_template_not_path(client: httpx.Client) -> None:
    client.get("/some/random/path/12345")
    text = client.get("/metrics").text
    assert "12345" not in text
    assert 'route="<unmatched>",status="404"' in text


def test_metrics_label_unknown_methods_as_other(client: httpx.Client) -> None:
    """Each method a client made up was a label of its own (in every request metric): a client without a key could
    grow the registry, and /metrics, without bound by sending methods named at random."""
    for i in range(3):
        assert client.request(f"X-MADE-UP{i}", "/v1/score").status_code == 405
        assert client.request(f"X-MADE-UP{i}", "/nowhere").status_code == 404
    long = client.request("X" * 10_000, "/v1/score")  # nor is a refusal's echo of it unbounded
    assert long.status_code == 405 and len(long.json()["error"]["message"]) < 200
    text = client.get("/metrics").text
    assert "MADE-UP" not in text
    assert 'method="other",model=' in text and 'route="/v1/score",status="405"' in text


def test_openapi_and_docs(client: httpx.Client) -> None:
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    score = spec["paths"]["/v1/score"]["post"]
    assert score["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ScoreRequest")
    assert score["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def _get_on(conn: socket.socket) -> bytes:
    """GET /healthz on an open connection -> the whole response (headers, then Content-Length bytes)."""
    conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)
    return data


def test_idle_connections_live_for_keep_alive_s(tiny_checkpoint: Path, serve_app: Any) -> None:
    """An idle keep-alive connection is closed after `keep_alive_s`, not uvicorn's 5 s (which races with clients
    that keep connections 5 s themselves: a request on a connection being closed reads a reset)."""
    with serve_app(Settings(checkpoint=tiny_checkpoint, keep_alive_s=1)) as live:
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            assert _get_on(conn).startswith(b"HTTP/1.1 200")
            time.sleep(0.4)
            assert _get_on(conn).startswith(b"HTTP/1.1 200")  # still open
            time.sleep(2.0)
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
            try:
                answer = conn.recv(65536)
            except ConnectionResetError:
                answer = b""
            assert answer == b""  # the server closed it


def test_attention_tuning_setting_reaches_the_kernels(serve_app: Any, tiny_checkpoint: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # ADAPTLM_ATTENTION_TUNING is a server setting (validated at start) and the kernels' process-wide settings
    from kernels import attention

    monkeypatch.setattr(attention, "TUNING", attention.TUNING)  # restored after the test
    with serve_app(Settings(checkpoint=tiny_checkpoint, attention_tuning="splits=0")) as live:
        assert httpx.get(f"{live.url}/readyz").status_code == 200
        assert attention.tuning() == attention.Tuning(splits=0)


def test_kernels_setting_reaches_the_dispatcher(serve_app: Any, tiny_checkpoint: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # a Settings value (not only the environment) picks the process's kernels; "reference" names itself in the log
    from kernels import _dispatch

    monkeypatch.setattr(_dispatch, "WANTED", _dispatch.WANTED)  # restored after the test
    with serve_app(Settings(checkpoint=tiny_checkpoint, kernels="reference")) as live:
        assert httpx.get(f"{live.url}/readyz").status_code == 200
        assert _dispatch.WANTED == "reference" and _dispatch.kernel_implementation() == "reference"
        assert 'kernel="reference"' in httpx.get(f"{live.url}/metrics").text
    _dispatch.kernel_implementation.cache_clear()
