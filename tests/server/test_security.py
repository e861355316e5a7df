"""Security (issue 14, part 5): API keys compared in constant time; another key's session indistinguishable from
a missing one; per-key rate limits; no pickle where user-supplied bytes are read; no checkpoint path taken from a
request; user text never logged at INFO; no internal address in an error."""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import logging
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.engine import RedisSessionStore, SessionStoreUnavailable
from server.ratelimit import RateLimiter
from server.routes import _deps
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("key-alice-0123456789", "key-bob-9876543210")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint: Path, serve_app: Any) -> Iterator[str]:
    with serve_app(Settings(checkpoint=tiny_checkpoint, api_keys=",".join(KEYS), suggest_budget_ms=0)) as live:
        yield live.url


@pytest.fixture(scope="module")
def model_name(keyed: str) -> str:
    return str(httpx.get(f"{keyed}/v1/models", headers=bearer(KEYS[0])).json()["data"][0]["id"])


# -- API keys --------------------------------------------------------------------------------------------------

def test_api_keys_are_compared_in_constant_time(keyed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured key is compared, each with hmac.compare_digest on equal-length digests: neither where a
    wrong key first differs nor the keys' lengths shape the time a refusal takes."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(_deps.hmac, "compare_digest", spy)
    for key in ("x", "key-alice-0123456789-and-more", KEYS[0][:-1] + "X", KEYS[1]):
        calls.clear()
        status = httpx.get(f"{keyed}/v1/models", headers=bearer(key)).status_code
        assert status == (200 if key in KEYS else 401)
        assert len(calls) == len(KEYS)  # no early exit
        assert {len(a) for a, _ in calls} | {len(b) for _, b in calls} == {hashlib.sha256().digest_size}
    source = ast.parse(Path(_deps.__file__).read_text())
    compared = [node for node in ast.walk(source) if isinstance(node, ast.Compare)
                and any("key" in ast.unparse(side).lower() or "credentials" in ast.unparse(side)
                        for side in (node.left, *node.comparators))
                and any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops)]
    assert not compared, [ast.unparse(n) for n in compared]  # no `==` on a key anywhere


# -- another key's session -------------------------------------------------------------------------------------

def _requests(sid: str, model: str) -> list[tuple[str, str, Any]]:
    return [
        ("GET", f"/v1/sessions/{sid}", None), ("GET", f"/v1/sessions/{sid}/state", None),
        ("POST", f"/v1/sessions/{sid}/observe", {"text": "hello"}), ("POST", f"/v1/sessions/{sid}/reset", None),
        ("POST", f"/v1/sessions/{sid}/suggest", {"context": "he"}),
        ("POST", "/v1/score", {"text": "hello", "session_id": sid}),
        ("POST", "/v1/generate", {"prompt": "a", "max_tokens": 1, "session_id": sid}),
        ("DELETE", f"/v1/sessions/{sid}", None),
    ]


def test_another_keys_session_is_indistinguishable_from_a_missing_one(keyed: str, model_name: str) -> None:
    with httpx.Client(base_url=keyed, timeout=60, headers=bearer(KEYS[0])) as alice, \
            httpx.Client(base_url=keyed, timeout=60, headers=bearer(KEYS[1])) as bob:
        sid = alice.post("/v1/sessions", json={"initial_text": "Alice's private text. "}).json()["id"]
        blob = alice.get(f"/v1/sessions/{sid}/state").content
        missing = "M" * len(sid)
        for (method, path, body), (_, missing_path, missing_body) in zip(_requests(sid, model_name),
                                                                         _requests(missing, model_name), strict=True):
            theirs = bob.request(method, path, json=body)
            absent = bob.request(method, missing_path, json=missing_body)
            assert theirs.status_code == absent.status_code == 404, (path, theirs.text)
            assert theirs.text.replace(sid, missing) == absent.text, path
            per_answer = ("date", "content-length", "x-request-id")  # the request's own ID differs, of course
            assert {k: v for k, v in theirs.headers.items() if k not in per_answer} == \
                {k: v for k, v in absent.headers.items() if k not in per_answer}
        # a PUT of Bob's onto Alice's id answers as onto a missing id (Bob's session goes under an alias of his,
        # test_session_idspace.py), and leaves her session as it was
        theirs, absent = bob.put(f"/v1/sessions/{sid}/state", content=blob), bob.put(
            f"/v1/sessions/{missing}/state", content=blob)
        assert theirs.status_code == absent.status_code == 200, theirs.text
        assert theirs.json().keys() == absent.json().keys() and theirs.json()["id"] == sid
        assert bob.delete(f"/v1/sessions/{sid}").status_code == bob.delete(f"/v1/sessions/{missing}").status_code == 204
        # the completions route treats a `user` that is not one of your sessions as an end user: both alike
        for user in (sid, missing):
            r = bob.post("/v1/completions", json={"model": model_name, "prompt": "a", "max_tokens": 1, "seed": 1,
                                                  "user": user, "temperature": 0})
            assert r.status_code == 200
        assert alice.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len("Alice's private text. ")

        # timing: the two interleaved request by request, so that a loaded machine's drift hits both alike
        times: dict[str, list[float]] = {sid: [], missing: []}
        for _ in range(60):
            for session_id in (sid, missing):
                t = time.perf_counter()
                bob.get(f"/v1/sessions/{session_id}")
                times[session_id].append(time.perf_counter() - t)
        theirs_s, absent_s = statistics.median(times[sid]), statistics.median(times[missing])
        assert abs(theirs_s - absent_s) < max(0.01, min(theirs_s, absent_s)), (theirs_s, absent_s)


# -- one key's sessions cannot push out another's ---------------------------------------------------------------

@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_keys_session_flood_evicts_only_its_own_sessions(tiny_checkpoint: Path, serve_app: Any,
                                                           request: pytest.FixtureRequest, store: str) -> None:
    """The store evicts its least recently used idle sessions to make room: without a share per key, a key that
    creates sessions in a loop pushed every other key's sessions out (a 404 for them), at 300 a second. Only keys
    over their share give up sessions now, and a key alone may still fill the store."""
    session_store = request.getfixturevalue("redis_url") if store == "redis" else "memory"
    settings = Settings(checkpoint=tiny_checkpoint, api_keys=",".join(KEYS), max_sessions=20,
                        session_store=session_store)
    assert settings.session_share()[0] == 10
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60, headers=bearer(KEYS[0])) as alice, \
            httpx.Client(base_url=live.url, timeout=60, headers=bearer(KEYS[1])) as bob:

        def alive(client: httpx.Client, ids: list[str]) -> int:
            return sum(client.get(f"/v1/sessions/{i}").status_code == 200 for i in ids)

        theirs = [bob.post("/v1/sessions", json={}).json()["id"] for _ in range(20)]
        assert alive(bob, theirs) == 20  # alone, Bob fills the whole store, past his share
        mine = [alice.post("/v1/sessions", json={"initial_text": "Alice's text. "}).json()["id"]]
        assert alive(bob, theirs) == 19  # Alice is under her share: Bob, over his, made room
        created = [bob.post("/v1/sessions", json={}) for _ in range(25)]
        assert [r.status_code for r in created] == [201] * 25  # Bob's own oldest make room for his new ones
        theirs += [r.json()["id"] for r in created]
        assert alive(alice, mine) == 1 and alive(bob, theirs) == 19
        blob = alice.get(f"/v1/sessions/{mine[0]}/state").content
        for i in range(12):  # an import counts against the key's share alike
            assert bob.put(f"/v1/sessions/imported-by-bob-{i:04d}/state", content=blob).status_code == 200
        theirs += [f"imported-by-bob-{i:04d}" for i in range(12)]
        assert alive(alice, mine) == 1 and alive(bob, theirs) == 19
        mine += [alice.post("/v1/sessions", json={}).json()["id"] for _ in range(14)]
        # Bob gave up sessions down to his share, then Alice, over hers, made room from her own
        assert alive(alice, mine) == 10 and alive(bob, theirs) == 10


def test_a_keys_share_of_the_store() -> None:
    assert Settings(max_sessions=100, session_memory_bytes=1000).session_share() == (100, 1000)  # no keys: all
    assert Settings(max_sessions=100, session_memory_bytes=1000, api_keys="a,b,c").session_share() == (33, 333)
    assert Settings(max_sessions=100, api_keys="a,b", max_sessions_per_key=80,
                    session_memory_bytes_per_key=5).session_share() == (80, 5)


# -- slow clients ----------------------------------------------------------------------------------------------

def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection -> (bytes, seconds it took)."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit_s} s: {data[:200]!r}")
    return data, time.monotonic() - start


def _timeout_error(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout", error
    return dict(error)


SLOW = {
    "nothing": [b""],
    "a partial head": [b"POST /v1/score HTTP/1.1\r\nHost: x\r\n"],
    "a head a byte at a time": [bytes([b]) for b in b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n"],
    "a body shorter than its length": [b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: 100\r\n\r\n{\"te"],
    "a chunked body without its end": [b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Transfer-Encoding: chunked\r\n\r\n2\r\n{\"\r\n"],
}


def test_slow_clients_are_answered_408_and_disconnected(tiny_checkpoint: Path, serve_app: Any) -> None:
    """uvicorn waited for a request's head, or its body, as long as the client liked (slowloris): a connection that
    sent nothing, or a byte now and then, was held open for ever (checked for 100 s)."""
    with serve_app(Settings(checkpoint=tiny_checkpoint, client_timeout_s=1.0)) as live:
        port = int(live.url.rsplit(":", 1)[1])
        socks = {}
        for name, parts in SLOW.items():
            socks[name] = socket.create_connection(("127.0.0.1", port))
            socks[name].sendall(parts[0])
        start = time.monotonic()
        for part in SLOW["a head a byte at a time"][1:9]:  # a byte every 0.1 s: a deadline, not an idle timer
            time.sleep(0.1)
            socks["a head a byte at a time"].sendall(part)
        for name, sock in socks.items():
            with sock:
                answer, _ = _read_until_closed(sock, 10)
                _timeout_error(answer)
                if name == "a head a byte at a time":
                    assert time.monotonic() - start < 1.8
        # a keep-alive connection idle between requests is still the keep-alive's (75 s), and answers in time work:
        # on one socket (httpx would open a new connection for one the server had closed, unseen)
        request = (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b'Content-Length: 15\r\n\r\n{"text": "abc"}')
        with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rb") as answers:
            for pause in (0.0, 1.5):
                time.sleep(pause)
                sock.sendall(request)
                assert answers.readline().startswith(b"HTTP/1.1 200 ")
                head = list(iter(answers.readline, b"\r\n"))
                length = next(int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length:"))
                assert json.loads(answers.read(length))["bytes"] == 3



def test_a_pipelined_requests_head_has_the_same_deadline(tiny_checkpoint: Path, serve_app: Any) -> None:
    """A request whose head came in part behind the one before it (pipelined) was bound only by the keep-alive's
    75 s once the first was answered, and closed without a 408."""
    request = (b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n"
               b'{"text":"ab"}')
    with serve_app(Settings(checkpoint=tiny_checkpoint, client_timeout_s=1.0)) as live:
        port = int(live.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(request + b"POST /v1/score HTTP/1.1\r\nHo")
            answer, took = _read_until_closed(sock, 10)
        first, _, second = answer.partition(b"HTTP/1.1 408 ")
        assert first.startswith(b"HTTP/1.1 200 ") and first.count(b"HTTP/1.1 ") == 1, answer[:300]
        _timeout_error(b"HTTP/1.1 408 " + second)
        assert took < 5


# -- rate limits -----------------------------------------------------------------------------------------------

def test_the_token_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [None, None, None]
    wait = limiter.take("a")
    assert wait is not None and wait == pytest.approx(0.5)
    assert limiter.take("b") is None  # another key's bucket is full
    now[0] += 0.5
    assert limiter.take("a") is None and limiter.take("a") is not None
    now[0] += 100
    assert [limiter.take("a") for _ in range(4)][-1] is not None  # never more than the burst
    assert RateLimiter(rate=0.0, burst=1).take("a") is None  # off
    assert Settings().rate_limit_per_s == 0  # off by default


def test_rate_limits_are_per_key(tiny_checkpoint: Path, serve_app: Any, assert_error: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, api_keys=",".join(KEYS), rate_limit_per_s=0.2,
                        rate_limit_burst=3)
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        for _ in range(3):
            assert c.post("/v1/score", json={"text": "a"}, headers=bearer(KEYS[0])).status_code == 200
        r = c.post("/v1/score", json={"text": "a"}, headers=bearer(KEYS[0]))
        assert_error(r, 429, "rate_limit_error")
        assert 1 <= int(r.headers["retry-after"]) <= 5
        assert c.get("/v1/models", headers=bearer(KEYS[0])).status_code == 429
        assert c.post("/v1/score", json={"text": "a"}, headers=bearer(KEYS[1])).status_code == 200  # Bob's own
        assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 200  # probes: no limit
        # a wrong key is refused as such (401), and does not spend a real key's tokens
        assert c.post("/v1/score", json={"text": "a"}, headers=bearer("wrong")).status_code == 401
        # /metrics tells a key over its rate from a lack of capacity (the capacity alert leaves it out)
        refused = {line.split("reason=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
                   for line in c.get("/metrics").text.splitlines() if line.startswith("adaptlm_refused_requests_total")}
        assert refused["rate_limited"] == 2 and refused["queue_full"] == 0, refused


# -- no pickle -------------------------------------------------------------------------------------------------

PACKAGES = ("server", "models", "adaptlm", "trainer", "clients/adaptlm_client", "kernels", "loadtest")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    return (node for node in ast.walk(tree) if isinstance(node, ast.Call))


def test_nothing_unpickles() -> None:
    """No module of ours imports a pickle library, calls torch.load without weights_only=True, or numpy.load with
    allow_pickle: checkpoints, session blobs and snapshots are safetensors and JSON only."""
    found = []
    files = [f for package in PACKAGES for f in (ROOT / package).rglob("*.py")]
    assert len(files) > 20
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path}: import {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        for call in _calls(tree):
            name = ast.unparse(call.func)
            keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
            if name.endswith("torch.load") or name == "load" and "weights_only" in keywords:
                if keywords.get("weights_only") != "True":
                    found.append(f"{path}:{call.lineno}: {ast.unparse(call)}")
            if name.endswith(("np.load", "numpy.load")) and keywords.get("allow_pickle", "False") != "False":
                found.append(f"{path}:{call.lineno}: {ast.unparse(call)}")
            if name.endswith(("pickle.load", "pickle.loads", "Unpickler")):
                found.append(f"{path}:{call.lineno}: {ast.unparse(call)}")
    assert not found, found


def test_session_blobs_are_read_by_safetensors_and_json_only() -> None:
    from server.engine import _export

    tree = ast.parse(Path(_export.__file__).read_text())
    loaders = {ast.unparse(c.func) for c in _calls(tree) if "load" in ast.unparse(c.func)}
    assert loaders <= {"load_tensors", "json.loads", "_header_metadata"}, loaders


# -- checkpoint paths ------------------------------------------------------------------------------------------

def test_no_request_names_a_path(keyed: str) -> None:
    """The checkpoint is the server's setting (ADAPTLM_CHECKPOINT) and nothing else: no request field or parameter
    names a file, directory or URL, so there is no path to confine. Static files are served by name from a fixed
    list (the keyboard's assets)."""
    schema = httpx.get(f"{keyed}/openapi.json").json()
    suspicious = ("path", "file", "dir", "checkpoint", "url", "uri", "location")
    fields = [name for model in schema["components"]["schemas"].values()
              for name in model.get("properties", {})]
    fields += [p["name"] for item in schema["paths"].values() for op in item.values() for p in op.get("parameters", [])]
    assert fields and not [f for f in fields if any(s in f.lower() for s in suspicious)]
    server_files = [f for f in (ROOT / "server").rglob("*.py")]
    engines = [f"{f.name}:{c.lineno}" for f in server_files for c in _calls(ast.parse(f.read_text()))
               if ast.unparse(c.func) == "Engine"]
    assert engines == [f"app.py:{_engine_line()}"]  # one engine, built from the settings
    for path in ("/keyboard/..%2f..%2fapp.py", "/keyboard/%2e%2e%2fapp.py", "/keyboard/..\\app.py",
                 "/keyboard/index.html/../../app.py"):
        r = httpx.get(f"{keyed}{path}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path


def _engine_line() -> int:
    from server import app

    source = Path(app.__file__).read_text().splitlines()
    [line] = [i + 1 for i, text in enumerate(source) if "Engine(settings.checkpoint" in text]
    return line


# -- logs ------------------------------------------------------------------------------------------------------

MARK = "Zq7xSECRETUSERTEXTw"


def test_user_text_is_never_logged_at_info(tiny_checkpoint: Path, serve_app: Any) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root = logging.getLogger()
    handler, level = Keep(logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        with serve_app(Settings(checkpoint=tiny_checkpoint, log_level="debug", max_text_bytes=2000)) as live, \
                httpx.Client(base_url=live.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            sid = c.post("/v1/sessions", json={"initial_text": f"{MARK} starts "}).json()["id"]
            c.post(f"/v1/sessions/{sid}/observe", json={"text": f"more {MARK} "})
            c.post(f"/v1/sessions/{sid}/suggest", json={"context": f"{MARK} wo"})
            c.post("/v1/score", json={"text": MARK, "logprobs": True})
            c.post("/v1/generate", json={"prompt": MARK, "max_tokens": 3, "stop": [MARK]})
            c.post("/v1/generate", json={"prompt": MARK, "max_tokens": 3, "stream": True})
            c.post("/v1/completions", json={"model": model, "prompt": MARK, "max_tokens": 2, "user": MARK})
            # refused requests too
            c.post("/v1/score", json={"text": MARK * 200})
            c.post("/v1/score", json={"text": MARK, "unknown": MARK})
            c.post("/v1/generate", content=f'{{"prompt": "{MARK}\\ud800"}}',
                   headers={"content-type": "application/json"})
            c.post("/v1/completions", json={"model": MARK, "prompt": MARK})
            c.post("/v1/score", content=f'{{"text": "{MARK}"', headers={"content-type": "application/json"})
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert records  # the capture works
    leaked = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records
              if r.levelno >= logging.INFO and MARK in r.getMessage() + str(r.exc_info or "")]
    assert not leaked, leaked


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_key_in_a_query_string_is_not_logged(log_format: str) -> None:
    """The keyboard page takes its key as `?key=` in its address: uvicorn's access line printed the whole path, and
    so the key, at INFO."""
    from uvicorn.logging import AccessFormatter

    from server.request_id import JsonFormatter, RequestIdFilter, uvicorn_log_config

    fmt = uvicorn_log_config("text")["formatters"]["access"]["fmt"]
    formatter = JsonFormatter() if log_format == "json" else AccessFormatter(fmt, use_colors=False)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/keyboard?x=1&key=key-alice-0123456789&api_key=s3cret"
                                "&X-Api-Key=h1dden#k", "1.1", 200), None)
    assert RequestIdFilter().filter(record)  # the filter uvicorn_log_config puts on every handler
    line = formatter.format(record)
    assert "key-alice" not in line and "s3cret" not in line and "h1dden" not in line, line
    assert "/keyboard?x=1&key=***&api_key=***&X-Api-Key=***" in line, line


# -- errors name no internals -----------------------------------------------------------------------------------

def test_an_unreachable_redis_is_not_named_to_clients() -> None:
    store = RedisSessionStore("redis://127.0.0.1:1/0", max_sessions=10, max_bytes=1 << 20, timeout_s=0.5)
    with pytest.raises(SessionStoreUnavailable) as caught:
        store.bind("0" * 64, None, None)  # type: ignore[arg-type]  # connects: refused
    message = str(caught.value)
    assert "127.0.0.1" not in message and ":1" not in message and "session store" in message
    assert "127.0.0.1" in str(caught.value.__cause__)  # the operator's log has it
    json.dumps(message)
    store.close()


# -- CORS: browser pages of the configured origins, and only those, may call the API ----------------------------

APP = "https://keyboard.example"


def test_cors_is_off_unless_origins_are_configured(client: httpx.Client) -> None:
    r = client.get("/healthz", headers={"Origin": APP})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    preflight = client.options("/v1/score", headers={"Origin": APP, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_answers_the_configured_origins(tiny_checkpoint: Path, serve_app: Any) -> None:
    settings = Settings(checkpoint=tiny_checkpoint, api_keys=KEYS[0], cors_origins=f"{APP}, https://other.example")
    with serve_app(settings) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        # the browser's preflight carries no key: it must not be refused as unauthenticated
        preflight = c.options("/v1/score", headers={"Origin": APP, "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == APP
        assert {"authorization", "content-type"} <= {
            h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
        r = c.post("/v1/score", json={"text": "abc"}, headers={"Origin": APP, **bearer(KEYS[0])})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
        exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {"x-request-id", "retry-after"} <= exposed  # a page can quote the ID and honour Retry-After
        # an error answer is readable by the page too
        r = c.post("/v1/score", json={"text": "abc"}, headers={"Origin": APP})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP
        # another origin gets nothing it could use
        evil = "https://evil.example"
        preflight = c.options("/v1/score", headers={"Origin": evil, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
        r = c.post("/v1/score", json={"text": "abc"}, headers={"Origin": evil, **bearer(KEYS[0])})
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("bad", ["https://keyboard.example/", "https://keyboard.example/app", "keyboard.example",
                                 "ftp://keyboard.example", "https://a.example, javascript:alert(1)"])
def test_cors_origins_must_be_origins(bad: str) -> None:
    with pytest.raises(ValueError, match="not an origin"):
        Settings(cors_origins=bad)
