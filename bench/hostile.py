"""The hostile catalogue: what a client with a valid key may send, sent to real servers, each answer checked.

    python -m bench.hostile [--checkpoints default words compressive] [--stores memory redis] [--imports 60]

For each checkpoint and session store (the memory store; Redis: a redis-server of its own on a loopback port),
`adaptlm serve` runs on loopback with two API keys, and the catalogue's groups go to it:
- `bodies`: malformed JSON, wrong types, bodies of other routes, to every JSON route;
- `numbers`: every numeric field of every route at the ends of the float and integer range (subnormals, 1e308,
  10**400 spelled out, NaN and Infinity literals), streamed and not;
- `texts`: lone surrogates, NUL, bidi controls, combining marks, in every text field;
- `keys`: the other key's session through every session route, against a missing id: the same answer;
- `imports`: valid exports mutated at random (bench/_mutations.py) PUT over a session, then the session used;
- `http`: malformed HTTP on a raw socket (a raw UTF-8 path, Content-Length: abc, a header line without a colon,
  headers of 64 KB and 1 MB, a bare line of garbage);
- `abandon`: a request with a long prompt to each route, abandoned by its client after 1 s; the next request's
  wait is timed (right: under 3 s);
- `replay`: one session's observes alone and batched with others: the same adapter (within float32 rounding:
  2e-5 of its largest entry).
A request is *right* when its answer is a 2xx whose numbers are finite (none null where the schema promises one)
or a 4xx in the one error shape, and the server still answers /readyz after its group. Prints a markdown table of
requests sent, right and wrong per checkpoint, store and group, and the wrong ones.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import load as load_tensors

from bench._common import ROOT, machine_line, redis_on_loopback
from bench._mutations import apply, draw, fields, finite_numbers, header
from bench.server import serve

KEYS = ("hostile-key-a", "hostile-key-b")
MISSING = "no-such-session-0000"
EXTREMES = ["0", "-0.0", "5e-324", "1e-323", "2.2e-308", "1e-300", "1e308", "-1e308", "1.7976931348623157e308",
            "1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1", "9223372036854775808", "18446744073709551616",
            "NaN", "Infinity", "-Infinity", '"1"', "true", "null", "[]", "{}"]
TEXTS = ['"\\ud800"', '"a\\udfffb"', '"\\u0000x"', '"\\u202eabc"', '"' + "\\u0301" * 500 + '"',
         '"' + "\U0001F600" * 200 + '"', '""', '"\\ud83d\\ude00"']
BAD_BODIES = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
              b"\xff\xfe{}", b'{"text": "a"}garbage', b"{'text': 'a'}", b'{"text": "a", "text": 2}', b"\x00" * 64,
              b'{"nope": 1}']
ABANDON_BYTES = 60_000
NEXT_TIMEOUT_S = 30.0
REPLAY_REL = 2e-5  # of the adapter's largest entry: a replay's adapters may differ by float32 rounding, no more
SLOW_S = 3.0  # the next request's wait after an abandoned one, beyond which the abandoned one held the engine


class Tally:
    """Requests sent, right and wrong, per group; the first wrong ones of each group kept for the report."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.wrong: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.slowest: dict[str, tuple[float, str]] = {}

    def time(self, group: str, seconds: float, what: str) -> None:
        if seconds > self.slowest.get(group, (0.0, ""))[0]:
            self.slowest[group] = (seconds, what)

    def check(self, group: str, what: str, right: bool, detail: str = "") -> None:
        self.sent[group] += 1
        if not right:
            self.wrong[group] += 1
            if len(self.examples[group]) < 5:
                self.examples[group].append(f"{what}: {detail[:300]}")


def error_shaped(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (set(body) == {"error"} and isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str) and {"param", "code"} <= set(error))


NUMBERS = ("bits", "bytes", "static_bits", "bits_per_byte")  # numbers an answer carries that may be null only where
# nothing was scored (bytes 0)


def answered_right(r: httpx.Response) -> tuple[bool, str]:
    """A 2xx with finite numbers (and no null bits where bytes were scored), or a 4xx in the error shape."""
    if 400 <= r.status_code < 500:
        return error_shaped(r), f"{r.status_code} {r.text[:200]}"
    if not 200 <= r.status_code < 300:
        return False, f"{r.status_code} {r.text[:200]}"
    kind = r.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        events = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        for data in events:
            if data == "[DONE]":
                continue
            try:
                event = json.loads(data)
            except ValueError:
                return False, f"event {data[:100]}"
            if isinstance(event, dict) and "error" in event and event["error"].get("type") == "server_error":
                return False, f"event {data[:200]}"
            if not finite_numbers(event):
                return False, f"event {data[:200]}"
        return True, ""
    if kind.startswith("application/json"):
        body = r.json()
        if not finite_numbers(body):
            return False, r.text[:200]
        for part in (body, body.get("observed") if isinstance(body, dict) else None):
            if isinstance(part, dict) and part.get("bytes") and any(
                    k in part and part[k] is None for k in ("bits", "bits_per_byte")):
                return False, f"null number: {r.text[:200]}"
    return True, ""


class Catalogue:
    """The groups of hostile requests against one server."""

    def __init__(self, url: str, tally: Tally, checkpoint: str) -> None:
        self.url = url
        self.tally = tally
        self.a = httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {KEYS[0]}"})
        self.b = httpx.Client(base_url=url, timeout=120, headers={"authorization": f"Bearer {KEYS[1]}"})
        self.model = self.a.get("/v1/models").json()["data"][0]["id"]
        self.word = "words" in Path(checkpoint).name
        self.sid = self.session(self.a)

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def session(self, c: httpx.Client, **adaptation: Any) -> str:
        r = c.post("/v1/sessions", json={"initial_text": "Dear Anne, the meeting moved to Tuesday. ",
                                         "adaptation": {"cache_weight": 0.5} | adaptation})
        r.raise_for_status()
        return str(r.json()["id"])

    def send(self, group: str, method: str, path: str, body: bytes | None = None,
             c: httpx.Client | None = None) -> httpx.Response | None:
        c = c or self.a
        started = time.monotonic()
        try:
            r = c.request(method, path, content=body, headers={"content-type": "application/json"})
            self.tally.time(group, time.monotonic() - started, f"{method} {path} {body!r:.80}")
        except httpx.HTTPError as e:
            self.tally.check(group, f"{method} {path} {body!r:.80}", False, f"no answer: {e!r}")
            return None
        right, detail = answered_right(r)
        self.tally.check(group, f"{method} {path} {body!r:.80}", right, detail)
        return r

    def alive(self, group: str) -> None:
        try:
            ok = httpx.get(f"{self.url}/readyz", timeout=30).status_code == 200 and self.a.post(
                "/v1/score", json={"text": "alive"}).status_code == 200
        except httpx.HTTPError:
            ok = False
        self.tally.check(group, "serving after the group", ok, "the server stopped answering")

    def json_routes(self) -> list[tuple[str, str]]:
        sid = self.sid
        return [("POST", "/v1/score"), ("POST", "/v1/generate"), ("POST", "/v1/completions"), ("POST", "/v1/sessions"),
                ("POST", f"/v1/sessions/{sid}/observe"), ("POST", f"/v1/sessions/{sid}/suggest")]

    def bodies(self) -> None:
        for method, path in self.json_routes():
            for body in BAD_BODIES:
                self.send("bodies", method, path, body)
            for _, other in self.json_routes():  # another route's valid body
                self.send("bodies", method, path, json.dumps(self.valid(other)).encode())
        self.alive("bodies")

    def valid(self, path: str) -> dict[str, Any]:
        if path == "/v1/score":
            return {"text": "Dear Anne", "session_id": self.sid}
        if path == "/v1/generate":
            return {"prompt": "Dear ", "max_tokens": 4, "session_id": self.sid}
        if path == "/v1/completions":
            return {"model": self.model, "prompt": "Dear ", "max_tokens": 4}
        if path == "/v1/sessions":
            return {"initial_text": "Hello there. "}
        if path.endswith("/observe"):
            return {"text": "Hello again. "}
        return {"context": "Dear A"}

    def numbers(self) -> None:
        sid = self.sid
        cases: list[tuple[str, list[str]]] = [
            ("/v1/generate", ["temperature", "top_p", "top_k", "max_tokens", "seed"]),
            ("/v1/completions", ["temperature", "top_p", "max_tokens", "n", "logprobs", "presence_penalty",
                                 "frequency_penalty", "seed", "best_of", "logit_bias.65"]),
            ("/v1/sessions", ["ttl_s", "adaptation.lr", "adaptation.decay", "adaptation.adapter_size",
                              "adaptation.cache_weight"]),
            (f"/v1/sessions/{sid}/suggest", ["k", "max_chars", "n_chars"]),
        ]
        for path, names in cases:
            for name in names:
                for value in EXTREMES:
                    for stream in ([False, True] if path in ("/v1/generate", "/v1/completions") else [None]):
                        body = self.valid(path) | ({"stream": stream} if stream is not None else {})
                        self.send("numbers", "POST", path, _with_raw(body, name, value))
        self.alive("numbers")

    def texts(self) -> None:
        sid = self.sid
        slots = [("/v1/score", "text"), ("/v1/generate", "prompt"), ("/v1/generate", "stop"),
                 ("/v1/completions", "prompt"), ("/v1/completions", "stop"), ("/v1/completions", "user"),
                 ("/v1/sessions", "initial_text"), (f"/v1/sessions/{sid}/observe", "text"),
                 (f"/v1/sessions/{sid}/suggest", "context")]
        for path, name in slots:
            for text in TEXTS:
                value = f"[{text}]" if name == "stop" and path == "/v1/generate" else text
                self.send("texts", "POST", path, _with_raw(self.valid(path), name, value))
        self.alive("texts")

    def keys(self) -> None:
        """Key B reaches for key A's session: each answer must equal the one for an id that exists nowhere."""
        before = self.a.get(f"/v1/sessions/{self.sid}/state").content
        own = self.b.get(f"/v1/sessions/{self.session(self.b)}/state").content
        routes: list[tuple[str, str, Any]] = [
            ("GET", "/v1/sessions/{id}", None), ("GET", "/v1/sessions/{id}/state", None),
            ("POST", "/v1/sessions/{id}/observe", {"text": "mine now"}),
            ("POST", "/v1/sessions/{id}/suggest", {"context": "Dear"}),
            ("POST", "/v1/score", {"text": "x", "session_id": "{id}"}),
            ("POST", "/v1/generate", {"prompt": "x", "max_tokens": 2, "session_id": "{id}"}),
            ("DELETE", "/v1/sessions/{id}", None),
            # an import onto either id makes the session there B's own (the id space is per key): then both are B's
            ("PUT", "/v1/sessions/{id}/state", own), ("GET", "/v1/sessions/{id}/state", None),
            ("DELETE", "/v1/sessions/{id}", None), ("GET", "/v1/sessions/{id}", None)]
        for method, path, body in routes:
            answers = []
            for target in (self.sid, MISSING):
                content = body if isinstance(body, bytes) else None if body is None else \
                    json.dumps(body).replace("{id}", target).encode()
                r = self.b.request(method, path.replace("{id}", target), content=content)
                answers.append((r.status_code, r.json().get("error", {}).get("type") if r.content and
                                r.headers.get("content-type", "").startswith("application/json") else None))
            same = answers[0] == answers[1]
            self.tally.check("keys", f"{method} {path}", same, f"other key's id {answers[0]}, missing {answers[1]}")
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEYS[0]}"}):
            r = httpx.post(f"{self.url}/v1/score", json={"text": "x"}, headers=headers)
            self.tally.check("keys", f"score with {headers}", r.status_code == 401 and error_shaped(r), r.text[:200])
        after = self.a.get(f"/v1/sessions/{self.sid}/state").content
        self.tally.check("keys", "the owner's session untouched", _same_export(before, after), "it changed")
        self.alive("keys")

    def imports(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        sid = self.session(self.a)
        blob = self.a.get(f"/v1/sessions/{sid}/state").content
        keys = sorted(load_tensors(blob))
        paths = fields(json.loads(header(blob)["__metadata__"]["session"]))
        uses = [("POST", f"/v1/sessions/{sid}/observe", {"text": "Dear Anne, hello.\n"}),
                ("POST", "/v1/score", {"text": "Dear Anne", "session_id": sid}),
                ("POST", f"/v1/sessions/{sid}/suggest", {"context": "Dear A"}),
                ("POST", "/v1/generate", {"prompt": "Dear ", "max_tokens": 4, "session_id": sid}),
                ("GET", f"/v1/sessions/{sid}", None), ("GET", f"/v1/sessions/{sid}/state", None)]
        last: tuple[Any, ...] = ()
        for _ in range(n):
            reset = self.a.put(f"/v1/sessions/{sid}/state", content=blob)
            self.tally.check("imports", f"PUT the valid export back after {last!r:.120}", reset.status_code == 200,
                             f"{reset.status_code} {reset.text[:200]}")
            if reset.status_code != 200:
                break
            change = last = draw(rng, keys, paths)
            r = self.a.put(f"/v1/sessions/{sid}/state", content=apply(blob, change))
            if r.status_code >= 300:
                kept = _same_export(self.a.get(f"/v1/sessions/{sid}/state").content, blob)
                self.tally.check("imports", f"PUT {change!r:.120}", 400 <= r.status_code < 500 and error_shaped(r)
                                 and kept, f"{r.status_code} kept={kept} {r.text[:200]}")
                continue
            self.tally.check("imports", f"PUT {change!r:.120}", True)
            for method, path, body in uses:
                got = self.a.request(method, path, json=body)
                right, detail = answered_right(got)
                self.tally.check("imports", f"{method} {path} after {change!r:.120}",
                                 right and got.status_code < 300, detail)
        self.alive("imports")

    def http(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        cases = {
            "raw UTF-8 path": "GET /v1/models/é HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
            "Content-Length: abc": b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
            "header line without a colon": b"GET /healthz HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
            "12 KB header (within the bound)": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 12288
                                               + b"\r\n\r\n",
            "20 KB header (over the 16 KiB bound)": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20480
                                                    + b"\r\n\r\n",
            "1 MB header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
            "garbage line": b"\x16\x03\x01 not http at all\r\n\r\n",
            "two Content-Lengths": b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3"
                                   b"\r\n\r\n{}",
        }
        for name, raw in cases.items():
            status, body = _raw_request(host, int(port), raw)
            shaped = False
            try:
                shaped = set(json.loads(body.split(b"\r\n\r\n", 1)[1])) == {"error"}
            except (ValueError, IndexError):
                pass
            right = 200 <= status < 300 if "within" in name else 400 <= status < 500 and shaped
            self.tally.check("http", name, right, f"status {status}: {body[:160]!r}")
        self.alive("http")

    def abandon(self) -> None:
        prompt = ("All the world's a stage, and all the men and women merely players. " * 1000)[:ABANDON_BYTES]
        sid = self.session(self.a)
        routes = [("/v1/score", {"text": prompt}), ("/v1/sessions/{sid}/observe", {"text": prompt}),
                  ("/v1/sessions", {"initial_text": prompt}),
                  ("/v1/generate", {"prompt": prompt, "max_tokens": 8}),
                  ("/v1/generate", {"prompt": prompt, "max_tokens": 8, "stream": True}),
                  ("/v1/completions", {"model": self.model, "prompt": [prompt] * 2, "max_tokens": 8}),
                  ("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": 8, "stream": True})]
        for path, body in routes:
            path = path.replace("{sid}", sid)
            try:
                with httpx.Client(base_url=self.url, timeout=1.0, headers=self.a.headers) as quick:
                    quick.post(path, json=body)
            except httpx.TimeoutException:
                pass
            start = time.monotonic()
            try:
                answered = self.a.post("/v1/score", json={"text": "hello"}, timeout=NEXT_TIMEOUT_S).status_code == 200
            except httpx.TimeoutException:
                answered = False
            wait = time.monotonic() - start
            self.tally.check("abandon", f"{path} stream={body.get('stream', False)}",
                             answered and wait < SLOW_S, f"the next request waited {wait:.1f} s (answered: {answered})")
        self.alive("abandon")

    def replay(self, batched: int = 7) -> None:
        """The same observes alone and beside `batched` other sessions' observes: the same adapter."""
        texts = ["Thank you for the report on the meeting. ", "We moved the review to Friday at noon. ",
                 "Please send the minutes to the whole team. "]
        alone = self.session(self.a)
        for text in texts:
            self.a.post(f"/v1/sessions/{alone}/observe", json={"text": text}).raise_for_status()
        inside = self.session(self.a)
        others = [self.session(self.a) for _ in range(batched)]
        for text in texts:
            threads = [threading.Thread(target=self.a.post, args=(f"/v1/sessions/{o}/observe",),
                                        kwargs={"json": {"text": text * (1 + i % 3) + "x" * i}})
                       for i, o in enumerate(others)]
            for t in threads:
                t.start()
            self.a.post(f"/v1/sessions/{inside}/observe", json={"text": text}).raise_for_status()
            for t in threads:
                t.join()
        one = load_tensors(self.a.get(f"/v1/sessions/{alone}/state").content)
        two = load_tensors(self.a.get(f"/v1/sessions/{inside}/state").content)
        keys = [k for k in one if k.startswith("adapter") and one[k].numel()]
        worst = max((float((one[k].double() - two[k].double()).abs().max()) for k in keys), default=0.0)
        largest = max((float(one[k].double().abs().max()) for k in keys), default=0.0)
        # float32's last bits may differ between batches; bf16 rounding carried forward differs by ~1e-3 of it
        self.tally.check("replay", "adapter alone == adapter batched", worst <= REPLAY_REL * largest,
                         f"differ by up to {worst:.3g} ({worst / max(largest, 1e-30):.2g} of the largest entry)")
        self.alive("replay")


def _with_raw(body: dict[str, Any], name: str, raw: str) -> bytes:
    """`body` as JSON with the field at dotted path `name` spelled exactly `raw` (10**400, NaN: what json.dumps
    cannot write)."""
    marker = "__HOSTILE__"
    node = body
    *parents, last = name.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = marker
    return json.dumps(body).replace(f'"{marker}"', raw).encode()


def _same_export(a: bytes, b: bytes) -> bool:
    ta, tb = load_tensors(a), load_tensors(b)
    return ta.keys() == tb.keys() and all(ta[k].shape == tb[k].shape and bool((ta[k] == tb[k]).all()) for k in ta)


def _raw_request(host: str, port: int, raw: bytes) -> tuple[int, bytes]:
    """Send raw bytes, read the answer until the server closes or 5 s pass -> (status, answer); 0: no answer."""
    answer = b""
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may close before it has read everything: its answer still counts
            while chunk := s.recv(65536):
                answer += chunk
    except OSError:
        pass
    try:
        return int(answer.split(b" ", 2)[1]), answer
    except (IndexError, ValueError):
        return 0, answer


GROUPS: dict[str, Callable[[Catalogue, argparse.Namespace], None]] = {
    "bodies": lambda c, a: c.bodies(), "numbers": lambda c, a: c.numbers(), "texts": lambda c, a: c.texts(),
    "keys": lambda c, a: c.keys(), "imports": lambda c, a: c.imports(a.imports, a.seed), "http": lambda c, a: c.http(),
    "abandon": lambda c, a: c.abandon(), "replay": lambda c, a: c.replay(),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", nargs="+", default=["default", "words", "compressive"],
                    help="checkpoint directories, or names under checkpoints/")
    ap.add_argument("--stores", nargs="+", default=["memory", "redis"], choices=["memory", "redis"])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--imports", type=int, default=60, help="mutated imports per server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "bench-hostile.log")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"# bench.hostile at {commit.strip()}; {machine_line()}")
    rows = []
    wrongs: list[str] = []
    for checkpoint in args.checkpoints:
        path = Path(checkpoint) if Path(checkpoint).is_dir() else ROOT / "checkpoints" / checkpoint
        for store in args.stores:
            with (redis_on_loopback() if store == "redis" else _nothing()) as redis_url:
                settings: dict[str, object] = {"api_keys": ",".join(KEYS), "max_text_bytes": 2 * ABANDON_BYTES}
                if redis_url:
                    settings["session_store"] = redis_url
                with serve(str(path), args.log, **settings) as url:
                    tally = Tally()
                    catalogue = Catalogue(url, tally, str(path))
                    try:
                        for group in args.groups:
                            started = time.monotonic()
                            GROUPS[group](catalogue, args)
                            slowest = tally.slowest.get(group, (0.0, ""))
                            print(f"{path.name} {store} {group}: {tally.sent[group]} sent, {tally.wrong[group]} wrong "
                                  f"({time.monotonic() - started:.0f} s; slowest {slowest[0]:.1f} s: {slowest[1]})",
                                  file=sys.stderr, flush=True)
                    finally:
                        catalogue.close()
            for group in args.groups:
                rows.append((path.name, store, group, tally.sent[group], tally.sent[group] - tally.wrong[group],
                             tally.wrong[group]))
                wrongs += [f"{path.name} {store} {group}: {e}" for e in tally.examples[group]]
    print("\n| checkpoint | store | group | sent | right | wrong |\n|---|---|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    total = sum(r[3] for r in rows), sum(r[4] for r in rows), sum(r[5] for r in rows)
    print(f"| all | | | {total[0]} | {total[1]} | {total[2]} |")
    if wrongs:
        print("\nWrong answers (the first five of each group):")
        for line in wrongs:
            print(f"- {line}")


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
