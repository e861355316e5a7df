"""What uvicorn's HTTP parser refuses before the app sees a request is answered in the one error shape, with a
request ID, and the server keeps serving (server/_http_protocol.py). Raw sockets: no client sends these."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from server._http_protocol import MAX_HEAD_BYTES

ERROR_KEYS = {"message", "type", "param", "code"}


def _exchange(live: Any, request: bytes) -> bytes:
    """Send all of `request` and read the answer to the end of the stream; a reset on either side fails."""
    port = int(live.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _error(answer: bytes, status: int, code: str) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), answer[:300]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert len(headers["x-request-id"]) == 32 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error" and error["code"] == code
    assert error["param"] is None and error["message"]
    return dict(error)


@pytest.mark.parametrize("request_bytes", [
    "GET /v1/models/é HTTP/1.1\r\nHost: x\r\n\r\n".encode(),  # a raw UTF-8 path, not percent-encoded
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: abc\r\n\r\n{}",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon on this line\r\n\r\n",
], ids=["utf8-path", "content-length-abc", "header-without-colon"])
def test_malformed_http_is_a_400_in_the_error_shape(live: Any, client: httpx.Client,
                                                    request_bytes: bytes) -> None:
    error = _error(_exchange(live, request_bytes), 400, "malformed_http")
    assert "no colon" not in error["message"]  # what h11 quotes of the request is not echoed
    assert client.get("/healthz").status_code == 200


def test_a_1mb_header_is_a_431_the_client_reads(live: Any, client: httpx.Client) -> None:
    """The client sends all of its 1 MB and then reads the answer: the server drops what follows the refused head
    rather than resetting the connection under it."""
    huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    error = _error(_exchange(live, huge), 431, "header_too_large")
    assert f"{MAX_HEAD_BYTES:,}" in error["message"]
    assert client.get("/healthz").status_code == 200


def test_the_head_bound_does_not_depend_on_packets(live: Any) -> None:
    """A head under MAX_HEAD_BYTES is served and one just over is refused, though each arrives in one read."""
    def head(size: int) -> bytes:
        start = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
        return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"

    assert _exchange(live, head(MAX_HEAD_BYTES - 100)).startswith(b"HTTP/1.1 200 ")
    _error(_exchange(live, head(MAX_HEAD_BYTES + 100)), 431, "header_too_large")
