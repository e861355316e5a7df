"""`adaptlm client ...`: the Python SDK (clients/) against a running server, a command per endpoint.

An SDK error is one line on stderr; the exit status is 2 for a 4xx answer (the request was at fault), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptlm.cli._common import Parser, UsageError, check_output, per_word, read_text_arg, write_whole

if TYPE_CHECKING:
    from adaptlm_client import Client


_MAX_TIMEOUT_S = 1e6


def make_client(args: argparse.Namespace) -> Client:
    from adaptlm_client import DEFAULT_BASE_URL, Client, RetryPolicy

    if args.max_retries < 0:
        raise UsageError("--max-retries must not be negative")
    if args.timeout is not None and not 0 < args.timeout <= _MAX_TIMEOUT_S:  # a socket cannot wait for ever (inf)
        raise UsageError(f"--timeout must be a positive number of seconds, at most {_MAX_TIMEOUT_S:.0f}")
    options: dict[str, Any] = {"api_key": args.api_key or None, "retry": RetryPolicy(max_retries=args.max_retries)}
    if args.timeout is not None:
        options["timeout"] = args.timeout
    url = args.url or DEFAULT_BASE_URL
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url!r}: give the server's http:// or https:// address")
    return Client(url, **options)


def _text_or_file(text: str | None, path: str | None, what: str) -> str:
    """The text given on the command line, or a file's (`-`: standard input), which must be UTF-8."""
    if text is None and path is None:
        raise UsageError(f"give the {what} as an argument or with --file")
    if text is not None and path is not None:
        raise UsageError(f"give the {what} either as an argument or with --file, not both")
    if text is not None:
        return text
    assert path is not None
    data = read_text_arg(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _print_model(model: Any) -> None:
    print(model.model_dump_json())


def cmd_client(args: argparse.Namespace) -> int:
    """Runs one `adaptlm client` command; an SDK error is one line: exit 2 for a 4xx answer, else 1."""
    from adaptlm_client import AdaptlmError

    try:
        with make_client(args) as client:
            return int(args.client_func(client, args))
    except AdaptlmError as e:
        return report_sdk_error(e)


def report_sdk_error(e: Any) -> int:
    """An SDK error (`AdaptlmError`) in one line on stderr -> the exit status: 2 for a 4xx answer, else 1."""
    details = ", ".join(str(part) for part in (e.status, e.type) if part is not None)
    if e.param:
        details += f", param {e.param}"
    print(f"adaptlm: error: {e.message}" + (f" ({details})" if details else ""), file=sys.stderr)
    return 2 if e.status is not None and 400 <= e.status < 500 else 1


def client_health(client: Client, args: argparse.Namespace) -> int:
    _print_model(client.ready())
    return 0


def client_score(client: Client, args: argparse.Namespace) -> int:
    text = _text_or_file(args.text, args.file, "text")
    if args.adapt and not args.session:
        raise UsageError("--adapt needs --session")
    if args.logprobs and not args.json:  # the text line has no room for them
        raise UsageError("--logprobs needs --json")
    result = client.score(text, logprobs=args.logprobs, session_id=args.session, adapt=args.adapt)
    if args.json:
        _print_model(result)
    elif result.bits_per_byte is None:  # a word session's --adapt that only grew its pending word
        print(f"nothing scored yet (0 bytes: the text only grew the word {args.session} holds pending)")
    else:
        words = per_word(result.bits_per_word, result.perplexity)
        print(f"{result.bits_per_byte:.4f} bits per byte{words} ({result.bytes} bytes, {result.bits:.1f} bits)")
    return 0


def client_generate(client: Client, args: argparse.Namespace) -> int:
    if args.adapt and not args.session:
        raise UsageError("--adapt needs --session")
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
               "top_p": args.top_p, "seed": args.seed, "stop": args.stop, "session_id": args.session,
               "adapt_while_generating": args.adapt}
    if not args.stream:
        result = client.generate(args.prompt, **options)
        if args.json:
            _print_model(result)
        else:
            print(result.text)
        return 0
    out = sys.stdout
    with client.generate_stream(args.prompt, **options) as stream:
        for chunk in stream:
            if not args.json:
                out.write(chunk)
                out.flush()
    if args.json:
        print(json.dumps({"text": stream.text, **stream.result.model_dump(mode="json")}))
    else:
        out.write("\n")
    return 0


def client_suggest(client: Client, args: argparse.Namespace) -> int:
    """Suggestions under a session; without --session, under a new one deleted afterwards (the bare model)."""
    context = _text_or_file(args.context, args.file, "context")
    session = client.session(args.session) if args.session else client.create_session()
    try:
        result = session.suggest(context, k=args.k, max_chars=args.max_chars, n_chars=args.n_chars)
    finally:
        if not args.session:
            session.delete()
    if args.json:
        _print_model(result)
    else:
        for word in result.completions:  # as a keyboard inserts it: after a mark, maybe with a space before it
            print(f"{' ' if word.space_before else ''}{word.text}\t{word.prob:.4f}")
    return 0


def client_session_create(client: Client, args: argparse.Namespace) -> int:
    session = client.create_session(args.initial_text, ttl_s=args.ttl, lr=args.lr, decay=args.decay,
                                    adapter_size=args.adapter_size)
    _print_model(session.info)
    return 0


def client_session_get(client: Client, args: argparse.Namespace) -> int:
    _print_model(client.get_session(args.id))
    return 0


def client_session_delete(client: Client, args: argparse.Namespace) -> int:
    client.delete_session(args.id)
    return 0


def client_session_reset(client: Client, args: argparse.Namespace) -> int:
    _print_model(client.reset_session(args.id))
    return 0


def client_session_observe(client: Client, args: argparse.Namespace) -> int:
    _print_model(client.observe(args.id, _text_or_file(args.text, args.file, "text")))
    return 0


def client_session_export(client: Client, args: argparse.Namespace) -> int:
    if args.out != "-":
        check_output(args.out)
    elif sys.stdout.isatty():  # binary bytes would garble the terminal and be of no use there
        raise UsageError("an export is binary: give --out FILE, or redirect standard output")
    blob = client.export_state(args.id)
    if args.out == "-":
        sys.stdout.buffer.write(blob)
        sys.stdout.buffer.flush()
    else:
        write_whole(Path(args.out), lambda path: path.write_bytes(blob))
    return 0


def client_session_import(client: Client, args: argparse.Namespace) -> int:
    try:
        blob = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as e:
        raise UsageError(f"{args.file}: cannot read ({e.strerror})") from None
    if not blob:
        raise UsageError(f"{args.file}: empty: not a session export")
    _print_model(client.import_state(args.id, blob).info)
    return 0


def add_parsers(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="the server (default: http://127.0.0.1:8000)")
    common.add_argument("--api-key", default=os.environ.get("ADAPTLM_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $ADAPTLM_API_KEY)")
    common.add_argument("--timeout", type=float, help="seconds to wait for an answer (default: 120)")
    common.add_argument("--max-retries", type=int, default=2, help="retries of a 429 or 503 answer (default: 2)")

    c = sub.add_parser("client", help="talk to a running server (the Python SDK)")
    csub = c.add_subparsers(dest="client_command", required=True, parser_class=Parser)

    def leaf(parent: Any, name: str, func: Any, summary: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=summary, parents=[common])
        p.set_defaults(func=cmd_client, client_func=func)
        return p

    leaf(csub, "health", client_health, "is the server ready (GET /readyz)")

    s = leaf(csub, "score", client_score, "bits per byte of a text (POST /v1/score)")
    s.add_argument("text", nargs="?", help="the text (or --file)")
    s.add_argument("--file", help="read the text from a file, - for standard input")
    s.add_argument("--session", help="score under this session")
    s.add_argument("--adapt", action="store_true", help="with --session: the session adapts on the text")
    s.add_argument("--logprobs", action="store_true",
                   help="with --json: each token's log-probability (a byte; a word model's word, with token_texts)")
    s.add_argument("--json", action="store_true")

    g = leaf(csub, "generate", client_generate, "continue a prompt (POST /v1/generate)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, help="bytes to generate (default: the server's, 200)")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--session", help="continue this session's stream")
    g.add_argument("--adapt", action="store_true", help="with --session: the session then observes the text")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--json", action="store_true", help="print the answer as JSON")

    su = leaf(csub, "suggest", client_suggest, "keyboard suggestions for a context (POST /v1/sessions/{id}/suggest)")
    su.add_argument("context", nargs="?", help="the text typed so far (or --file); the word at its end is completed")
    su.add_argument("--file", help="read the context from a file, - for standard input")
    su.add_argument("--session", help="under this session (default: a new session, deleted afterwards)")
    su.add_argument("--k", type=int, help="word completions (default: the server's, 3)")
    su.add_argument("--max-chars", type=int, help="longest completion in characters (default: 24)")
    su.add_argument("--n-chars", type=int, help="most likely next characters (default: 5)")
    su.add_argument("--json", action="store_true", help="the whole answer as JSON (next characters too); without "
                    "it, a word and its probability a line, a word offered after a space (space_before) with the space")

    se = csub.add_parser("session", help="adaptive sessions (/v1/sessions)")
    ssub = se.add_subparsers(dest="session_command", required=True, parser_class=Parser)
    cr = leaf(ssub, "create", client_session_create, "a new session; prints it as JSON")
    cr.add_argument("--initial-text", help="text for the session to observe first")
    cr.add_argument("--ttl", type=float, help="seconds the session lives after its last use")
    cr.add_argument("--lr", type=float, help="adaptation learning rate (default: the checkpoint's)")
    cr.add_argument("--decay", type=float, help="decay towards the unadapted model")
    cr.add_argument("--adapter-size", type=int, help="units of the adaptation site")
    for name, func, what in (("get", client_session_get, "the session's settings and statistics, as JSON"),
                             ("delete", client_session_delete, "delete the session"),
                             ("reset", client_session_reset, "back to the start; prints the session")):
        leaf(ssub, name, func, what).add_argument("id")
    ob = leaf(ssub, "observe", client_session_observe, "the session reads a text and adapts; prints the cost")
    ob.add_argument("id")
    ob.add_argument("text", nargs="?", help="the text (or --file)")
    ob.add_argument("--file", help="read the text from a file, - for standard input")
    ex = leaf(ssub, "export", client_session_export, "write the session's state (bytes)")
    ex.add_argument("id")
    ex.add_argument("--out", default="-", help="file to write (default: standard output)")
    im = leaf(ssub, "import", client_session_import, "create or replace session ID from an export")
    im.add_argument("id")
    im.add_argument("--file", default="-", help="the export (default: standard input)")
