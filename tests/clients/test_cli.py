"""`adaptlm client ...` against a real server: output, exit codes (0; 2 for a 4xx answer or a usage mistake; 1 when the
server fails or cannot be reached), one-line errors. The commands run in the test process (tests/_cli.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptlm_client import Client
from server.settings import Settings
from tests._cli import run_cli
from tests.clients.conftest import LiveServer, serve

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune."


def adaptlm(*args: str, url: str | None, stdin: bytes | None = None, api_key: str | None = None,
            ) -> subprocess.CompletedProcess[bytes]:
    """`adaptlm client ARGS --url URL`, with ADAPTLM_API_KEY set to `api_key` (None: unset)."""
    url_args = ("--url", url) if url is not None else ()
    r = run_cli("client", *args, *url_args, stdin=stdin, env={"ADAPTLM_API_KEY": api_key})
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout_bytes, r.stderr_bytes)


def ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, r.stderr.decode()
    assert r.stderr == b""
    return r.stdout.decode()


def failed(r: subprocess.CompletedProcess[bytes], status: int) -> str:
    """The command failed with exit `status` and one line on stderr (no traceback)."""
    assert r.returncode == status, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.decode()
    assert err.startswith("adaptlm: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_health(live: LiveServer) -> None:
    assert json.loads(ok(adaptlm("health", url=live.url)))["status"] == "ready"


def test_score(live: LiveServer, client: Client, tmp_path: Path) -> None:
    expected = client.score(TEXT)
    out = json.loads(ok(adaptlm("score", TEXT, "--json", url=live.url)))
    assert out["bits"] == pytest.approx(expected.bits) and out["bytes"] == expected.bytes
    assert out["logprobs"] is None
    assert "bits per byte" in ok(adaptlm("score", TEXT, url=live.url))
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    from_file = json.loads(ok(adaptlm("score", "--file", str(path), "--json", "--logprobs", url=live.url)))
    assert from_file["bits"] == pytest.approx(expected.bits) and len(from_file["logprobs"]) == expected.bytes
    from_stdin = json.loads(ok(adaptlm("score", "--file", "-", "--json", url=live.url, stdin=TEXT.encode())))
    assert from_stdin["bytes"] == expected.bytes


def test_generate(live: LiveServer, client: Client) -> None:
    expected = client.generate("The ", max_tokens=20, seed=1, temperature=0.8)
    args = ("generate", "--prompt", "The ", "--max-tokens", "20", "--seed", "1", "--temperature", "0.8")
    assert ok(adaptlm(*args, url=live.url)) == expected.text + "\n"
    assert ok(adaptlm(*args, "--stream", url=live.url)) == expected.text + "\n"
    whole = json.loads(ok(adaptlm(*args, "--json", url=live.url)))
    assert whole == expected.model_dump(mode="json")
    streamed = json.loads(ok(adaptlm(*args, "--stream", "--json", url=live.url)))
    assert streamed["text"] == expected.text and streamed["finish_reason"] == "length"
    assert streamed["usage"] == expected.usage.model_dump() and set(streamed["timings"]) == {
        "first_token_seconds", "total_seconds"}


def test_sessions(live: LiveServer, client: Client, tmp_path: Path) -> None:
    created = json.loads(ok(adaptlm("session", "create", "--initial-text", TEXT, "--adapter-size", "16",
                                    "--ttl", "600", url=live.url)))
    sid = created["id"]
    assert created["observed"]["bytes"] == len(TEXT.encode()) and created["adaptation"]["adapter_size"] == 16
    observed = json.loads(ok(adaptlm("session", "observe", sid, " And more.", url=live.url)))
    assert observed["bytes"] == 10 and observed["updates"] >= 1
    scored = json.loads(ok(adaptlm("score", "x y", "--session", sid, "--adapt", "--json", url=live.url)))
    assert scored["session_id"] == sid
    got = json.loads(ok(adaptlm("session", "get", sid, url=live.url)))
    assert got["stats"]["bytes_observed"] == len(TEXT.encode()) + 10 + 3
    ok(adaptlm("generate", "--prompt", "a", "--max-tokens", "3", "--session", sid, "--adapt", url=live.url))

    blob = tmp_path / "session.bin"
    assert ok(adaptlm("session", "export", sid, "--out", str(blob), url=live.url)) == ""
    imported = json.loads(ok(adaptlm("session", "import", "cli-imported-session-01", "--file", str(blob),
                                     url=live.url)))
    assert imported["id"] == "cli-imported-session-01"
    assert imported["stats"] == client.get_session(sid).stats.model_dump(mode="json")
    piped = adaptlm("session", "export", sid, url=live.url).stdout  # to stdout, and back from stdin
    assert json.loads(ok(adaptlm("session", "import", "cli-piped-session-0001", url=live.url, stdin=piped)))["id"]

    assert json.loads(ok(adaptlm("session", "reset", sid, url=live.url)))["stats"]["bytes_observed"] == 0
    assert ok(adaptlm("session", "delete", sid, url=live.url)) == ""
    err = failed(adaptlm("session", "get", sid, url=live.url), 2)
    assert "404" in err and "not_found_error" in err and "param session_id" in err


def test_client_mistakes_exit_2(live: LiveServer, tmp_path: Path) -> None:
    err = failed(adaptlm("generate", "--prompt", "x", "--temperature", "-1", url=live.url), 2)
    assert "422" in err and "param temperature" in err
    assert "not both" in failed(adaptlm("score", "x", "--file", "f", url=live.url), 2)  # both
    err = failed(adaptlm("score", url=live.url), 2)  # neither
    assert "give the text as an argument or with --file" in err and "not both" not in err
    failed(adaptlm("score", "x", "--adapt", url=live.url), 2)
    assert "--logprobs needs --json" in failed(adaptlm("score", "x", "--logprobs", url=live.url), 2)  # was ignored
    failed(adaptlm("score", "--file", str(tmp_path / "missing.txt"), url=live.url), 2)
    failed(adaptlm("session", "import", "some-session-0123456789", "--file", str(tmp_path / "none"),
                   url=live.url), 2)
    failed(adaptlm("session", "frobnicate", url=live.url), 2)
    failed(adaptlm("score", "x", url="localhost:8000"), 2)
    failed(adaptlm("score", "x", "--max-retries", "-1", url=live.url), 2)
    for timeout in ("0", "nan", "inf", "1e300"):  # inf and 1e300 were an OverflowError traceback from the socket
        assert "--timeout must be" in failed(adaptlm("health", "--timeout", timeout, url=live.url), 2)
    err = failed(adaptlm("session", "export", "some-session-0123456789", "--out", str(tmp_path), url=live.url), 2)
    assert "is a directory" in err  # before the request


def test_an_unreachable_server_exits_1() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    err = failed(adaptlm("score", "x", url=f"http://127.0.0.1:{port}"), 1)
    assert f"127.0.0.1:{port}" in err
    # and the default address is where `adaptlm serve` listens
    assert "127.0.0.1:8000" in adaptlm("--help", url=None).stdout.decode() + adaptlm(
        "score", "--help", url=None).stdout.decode()


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with serve(Settings(checkpoint=tiny_checkpoint, api_keys="cli-key")) as live:  # type: ignore[arg-type]
        yield live


def test_api_key_from_the_flag_or_the_environment(keyed: LiveServer) -> None:
    err = failed(adaptlm("score", "x", url=keyed.url), 2)
    assert "401" in err and "authentication_error" in err
    failed(adaptlm("score", "x", url=keyed.url, api_key="wrong"), 2)
    assert ok(adaptlm("score", "x", url=keyed.url, api_key="cli-key"))
    assert ok(adaptlm("score", "x", "--api-key", "cli-key", url=keyed.url, api_key="wrong"))


def test_suggest(live: LiveServer, client: Client) -> None:
    session = client.create_session(initial_text=TEXT)
    expected = session.suggest("It is a tr", k=2, n_chars=3)
    out = json.loads(ok(adaptlm("suggest", "It is a tr", "--session", session.id, "--k", "2", "--n-chars", "3",
                                "--json", url=live.url)))
    assert out == expected.model_dump(mode="json") and out["prefix"] == "tr" and len(out["next_chars"]) == 3
    lines = ok(adaptlm("suggest", "It is a tr", "--session", session.id, "--k", "2", url=live.url)).splitlines()
    assert [line.split("\t")[0] for line in lines] == [w.text for w in expected.completions]
    # without --session: the bare model, in a session made for the call and deleted after it
    before = client.suggest(client.create_session().id, "The ", k=3)
    bare = json.loads(ok(adaptlm("suggest", "--file", "-", "--json", url=live.url, stdin=b"The ")))
    assert bare["completions"] == before.model_dump(mode="json")["completions"]
    err = failed(adaptlm("suggest", "x", "--k", "11", url=live.url), 2)
    assert "422" in err and "param k" in err
    failed(adaptlm("suggest", "x", "--session", "no-such-session-0000", url=live.url), 2)


def test_an_export_is_not_written_to_a_terminal(live: LiveServer) -> None:
    """Without --out, an export went to standard output even when that was a terminal: binary bytes on screen."""
    import pty

    controller, terminal = pty.openpty()
    try:
        with os.fdopen(terminal, "wb", closefd=False) as tty:
            r = run_cli("client", "session", "export", "some-session-0123456789", "--url", live.url, stdout=tty)
    finally:
        os.close(terminal)
    os.set_blocking(controller, False)
    try:
        shown = os.read(controller, 4096)
    except (BlockingIOError, OSError):  # nothing was written to the terminal
        shown = b""
    os.close(controller)
    err = r.stderr
    assert r.returncode == 2 and err.startswith("adaptlm: error: an export is binary") and shown == b"", (err, shown)
