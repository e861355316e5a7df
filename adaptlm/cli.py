"""`adaptlm` command line: train, score, generate, eval, tune, serve, and `client ...` (the SDK, against a server).

User mistakes (bad flags, unreadable files, bad checkpoints, empty text) print one line to stderr and
exit with status 2; no tracebacks. Ctrl-C exits 130; a standard output closed early (`| head`) 141, quietly.
`adaptlm client` commands print the server's error in one line and exit with 2 when the request was at fault
(a 4xx answer), 1 when the server failed or could not be reached.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from clients import Client

__all__ = ["main"]


class UsageError(Exception):
    """A user mistake: reported in one line, exit status 2."""


def _fail(message: str) -> NoReturn:
    print(f"adaptlm: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _device(name: str | None) -> Any:
    from models.device import resolve_device

    try:
        return resolve_device(name or "auto")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _load(checkpoint: str | None, device: str | None = None) -> Any:
    from models.checkpoint import CheckpointError, load_checkpoint
    from server.settings import DEFAULT_CHECKPOINT

    try:
        return load_checkpoint(checkpoint or DEFAULT_CHECKPOINT, device=_device(device))
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def _read_text_arg(path: str) -> bytes:
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    if not data:
        raise UsageError(f"{path}: empty text: nothing to score")
    return data


def _check_output(path: str) -> None:
    """Refuse an output path that cannot be written, before the work that fills it (which may take minutes)."""
    out = Path(path)
    if path.endswith("/") or out.is_dir():
        raise UsageError(f"{path}: is a directory, not a file to write")
    if not out.parent.is_dir():
        raise UsageError(f"{path}: cannot write (no directory {str(out.parent)!r})")


def _write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a temporary file beside `path`, then rename it over `path`: the output is written whole or
    not at all, so that a failure or Ctrl-C half-way leaves what was there (a checkpoint's dyneval.json stays
    readable) and no partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"{path}: cannot write ({e.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)


def cmd_train(args: argparse.Namespace) -> int:
    from trainer.cli import config_from_args, run_command, summary
    from trainer.train import train

    def run() -> dict[str, Any]:
        cfg = config_from_args(args)
        device = _device(args.device)
        return summary(train(cfg, args.data, Path(args.out), valid_path=args.valid, resume=args.resume,
                             progress=not args.quiet, device=device))

    return run_command("adaptlm", run)  # (a device that is not here: a UsageError, as for every command)


def cmd_score(args: argparse.Namespace) -> int:
    from models.scoring import score_bytes

    data = _read_text_arg(args.file)
    ckpt = _load(args.checkpoint, args.device)
    result = score_bytes(ckpt.model, data, tokenizer=ckpt.tokenizer)
    record = {"bits_per_byte": result.bits_per_byte, "bytes": result.bytes, "bits": result.bits}
    words = ckpt.tokenizer.kind != "bytes"  # a word model: per word too (ALGORITHMS.md §10)
    if words:
        record.update({"tokens": result.tokens, "bits_per_word": result.bits_per_token,
                       "perplexity": 2.0 ** result.bits_per_token})
    if args.json:
        print(json.dumps(record))
    else:
        per_word = _per_word(result.bits_per_token if words else None)
        print(f"{result.bits_per_byte:.4f} bits per byte{per_word} ({result.bytes} bytes, {result.bits:.1f} bits)")
    return 0


def _per_word(bits_per_word: float | None) -> str:
    """A word model's figures for a text line after its bits per byte (score, eval, client score); "" for bytes."""
    if bits_per_word is None:
        return ""
    return f", {bits_per_word:.4f} bits per word, perplexity {2.0 ** bits_per_word:.2f}"


def cmd_generate(args: argparse.Namespace) -> int:
    from models.sampling import SamplingParams, generate
    from server.protocol import MAX_SEED

    if not args.prompt:
        raise UsageError("--prompt must not be empty")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:  # as /v1/generate: the same seed, the same text
        raise UsageError(f"--seed must be between 0 and {MAX_SEED}")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ckpt = _load(args.checkpoint, args.device)
    out = sys.stdout
    prompt = os.fsencode(args.prompt)  # the bytes given, UTF-8 or not (argv keeps undecodable bytes as surrogates)
    for piece in generate(ckpt.model, prompt, params, tokenizer=ckpt.tokenizer):
        out.write(piece)
        out.flush()
    out.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from server import request_id
    from server.app import serve
    from server.settings import Settings

    overrides: dict[str, Any] = {}
    if args.checkpoint:
        overrides["checkpoint"] = args.checkpoint
    if args.device:
        overrides["device"] = args.device
    if args.host:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        raise UsageError("invalid settings: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    _device(settings.device)  # a device that is not here: one line, before uvicorn starts
    from models.checkpoint import CheckpointError

    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=level)
    request_id.install(settings.log_format)  # the server's lines name the request they belong to
    try:  # the engine loads the checkpoint before uvicorn starts: a bad one is this one line
        return serve(settings)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"lr": args.lr, "decay": args.decay, "eps": args.eps, "segment": args.segment,
                           "adapter_units": args.adapter_size, "layers_from": args.layers_from}
    if args.sites:
        out["params"] = tuple(s for s in args.sites.split(",") if s)
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    from trainer.evaluation import EVAL_MODES, loss_curve, plot_curves, run_eval, write_curves_csv

    modes = [m for m in args.mode.split(",") if m]
    if not modes:
        raise UsageError(f"--mode: give at least one of {', '.join(EVAL_MODES)}")
    for m in modes:
        if m not in EVAL_MODES:
            raise UsageError(f"unknown mode {m!r}; choose from {', '.join(EVAL_MODES)}")
    for flag, inner in _EVAL_FLAG_MODES.items():  # a setting no asked mode reads would be silently ignored
        if getattr(args, flag) is not None and not any(EVAL_MODES[m][0] in inner for m in modes):
            fits = ", ".join(m for m, (i, _, _) in EVAL_MODES.items() if i in inner)
            raise UsageError(f"--{flag.replace('_', '-')} applies to the modes {fits}; --mode asks for {args.mode}")
    if args.window < 1:
        raise UsageError("--window must be positive")
    if args.limit < 0:
        raise UsageError("--limit must not be negative (0: the whole file)")
    for out in (args.csv, args.plot):  # before the evaluation, which may take minutes
        if out:
            _check_output(out)
    plot_format = _plot_format(args.plot) if args.plot else None
    data = _read_text_arg(args.file)
    if args.limit:
        data = data[: args.limit]
    ckpt = _load(args.checkpoint, args.device)
    records, curves = [], {}
    for m in modes:
        try:
            record, result = run_eval(ckpt, data, m, **_overrides(args))
        except ValueError as e:
            raise UsageError(str(e)) from None
        records.append(record)
        curves[m] = loss_curve(result.logprobs, args.window)
        if not args.json:
            print(f"{m}: {record['bits_per_byte']:.4f} bits per byte{_per_word(record.get('bits_per_word'))} "
                  f"({record['bytes']} bytes, {record['params_adapted']:,} parameters adapted, "
                  f"{record['state_bytes']:,} state bytes, {record['seconds']:.1f} s)")
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records))
    title = f"{Path(args.file).name}: loss against position"
    if args.csv:
        _write_whole(Path(args.csv), lambda path: write_curves_csv(path, curves))
    if args.plot:
        _write_whole(Path(args.plot), lambda path: plot_curves(path, curves, title, fmt=plot_format))
    return 0


# eval's adaptation settings -> the inner modes (EVAL_MODES' first field) that read them
_EVAL_FLAG_MODES = {"lr": ("full", "sparse"), "decay": ("full", "sparse"), "eps": ("full", "sparse"),
                    "segment": ("full", "sparse"), "adapter_size": ("sparse",), "sites": ("full",),
                    "layers_from": ("full",)}


def _plot_format(path: str) -> str:
    """The image format of --plot, from its suffix (none: PNG); one matplotlib cannot write is a usage error."""
    from matplotlib.figure import Figure

    fmt = Path(path).suffix[1:].lower() or "png"
    supported = Figure().canvas.get_supported_filetypes()
    if fmt not in supported:
        raise UsageError(f"{path}: cannot write a plot as {fmt!r} (give a name ending in "
                         f"{', '.join('.' + f for f in sorted(supported))})")
    return fmt


def cmd_tune(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trainer.evaluation import config_for
    from trainer.tune import tune_mode

    if args.bytes < 1:
        raise UsageError("--bytes must be positive")
    if args.max_trials < 1:
        raise UsageError("--max-trials must be positive")
    if not 0 < args.lr_start < math.inf:
        raise UsageError("--lr-start must be a finite positive number")
    if args.mode == "cache" and args.cache_window < 1:
        raise UsageError("--cache-window must be positive")
    data = _read_text_arg(args.valid)[: args.bytes]
    tuned_on = {"file": Path(args.valid).name, "bytes": len(data)}
    ckpt = _load(args.checkpoint, args.device)
    if ckpt.path is None:
        raise UsageError("checkpoint has no directory to write dyneval.json into")
    dyneval = dict(ckpt.dyneval)
    sections = {"both": ["full", "sparse"], "full": ["full"], "sparse": ["sparse"], "cache": []}[args.mode]
    results: dict[str, Any] = {}
    from models.adaptation import evaluate

    static = evaluate(ckpt.model, data, config_for("static", dyneval), stats=ckpt.stats,
                      tokenizer=ckpt.tokenizer).bits_per_byte
    if args.mode == "cache":  # the neural cache's theta and lambda at a window, on the static model
        from trainer.tune import tune_cache

        cache, trials = tune_cache(ckpt.model, data, args.cache_window, tokenizer=ckpt.tokenizer,
                                   on_trial=lambda t: print(f"cache: theta={t['theta']:.3g} lambda={t['lam']:.3g}"
                                                            f" -> {t['bits_per_byte']:.4f}", file=sys.stderr))
        entry = {"window": cache.window, "theta": cache.theta, "lam": cache.lam,
                 "valid_bpb": min(t["bits_per_byte"] for t in trials), "valid_static_bpb": static,
                 "trials": len(trials), "tuned_on": tuned_on}
        dyneval["cache"] = results["cache"] = entry
    for section in sections:
        layers = {"layers_from": args.layers_from} if section == "full" else {}
        try:
            base = config_for("dynamic" if section == "full" else "sparse", dyneval, segment=args.segment, **layers)
        except ValueError as e:
            raise UsageError(str(e)) from None
        best, trials = tune_mode(ckpt.model, ckpt.stats, data, base, lr_start=args.lr_start,
                                 max_trials=args.max_trials, tokenizer=ckpt.tokenizer,
                                 on_trial=lambda t, s=section: print(f"{s}: lr={t['lr']:.3g} decay={t['decay']:.3g}"
                                                                     f" -> {t['bits_per_byte']:.4f}", file=sys.stderr))
        best_bpb = min(t["bits_per_byte"] for t in trials)
        entry = {k: v for k, v in asdict(best).items() if k in ("rule", "lr", "decay", "eps", "segment",
                                                                 "adapter_units")}
        if section == "full":
            entry.pop("adapter_units", None)
            if best.layers_from:
                entry["layers_from"] = best.layers_from
        entry.update({"valid_bpb": best_bpb, "valid_static_bpb": static, "trials": len(trials)})
        dyneval[section] = entry
        results[section] = entry
    if sections:  # "tuned" and "tuned_on" are of the adaptation sections: the cache alone (its own tuned_on) leaves
        # them as they were, so that a checkpoint whose full and sparse settings are the trainer's does not claim more
        dyneval["tuned"] = True
        dyneval["tuned_on"] = tuned_on
    text = json.dumps(dyneval, indent=2, sort_keys=True) + "\n"
    _write_whole(ckpt.path / "dyneval.json", lambda path: path.write_text(text))
    print(json.dumps({"static_bpb": static, **results}))
    return 0


# -- adaptlm keyboard-sim: keystroke savings of suggestions (clients/keysim.py) ---------------------------------


def cmd_keyboard_sim(args: argparse.Namespace) -> int:
    """Type a text against suggestions from a server (--url) or a checkpoint here (--checkpoint)."""
    from clients.keysim import messages, simulate, split_text

    if (args.url is None) == (args.checkpoint is None):
        raise UsageError("give either --url (a running server) or --checkpoint (a model in this process)")
    if args.suggestions < 1 or args.suggestions > 10:
        raise UsageError("--suggestions must be between 1 and 10")
    if args.max_chars is not None and not 1 <= args.max_chars <= 64:  # the server's suggest range
        raise UsageError("--max-chars must be between 1 and 64")
    if args.progress < 0:
        raise UsageError("--progress must not be negative (0: no progress lines)")
    if not args.adapt and (args.lr is not None or args.decay is not None):
        raise UsageError("--lr and --decay set the adaptation: they need --adapt")
    if args.url is not None and args.device is not None:
        raise UsageError("--device applies to --checkpoint (with --url the server's device runs the model)")
    for name in ("last_bytes", "warmup_bytes", "limit_bytes"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup_bytes" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.cache_weight is not None and not 0 <= args.cache_weight <= 1:
        raise UsageError("--cache-weight must be between 0 and 1")
    if args.adapt_mode == "full" and args.checkpoint is None:
        raise UsageError("--adapt-mode full runs in this process: it needs --checkpoint")
    data = _read_text_arg(args.text)
    try:
        warm, measured = split_text(data, last_bytes=args.last_bytes, warmup_bytes=args.warmup_bytes,
                                    limit_bytes=args.limit_bytes)
    except UnicodeDecodeError as e:
        raise UsageError(f"{args.text}: not UTF-8 text (byte {e.start})") from None
    adaptation = args.adapt_mode if args.adapt else "static"
    record: dict[str, Any] = {"text": args.text, "measured_bytes": len(measured.encode("utf-8")),
                              "warmup_bytes": len(warm.encode("utf-8")), "suggestions": args.suggestions,
                              "adaptation": adaptation}

    def progress(result: Any) -> None:
        if not args.json and args.progress and result.messages % args.progress == 0:
            print(f"{result.messages} messages, {result.chars:,} chars: KSR {result.ksr:.4f}", file=sys.stderr)

    if args.url is not None:
        from clients import AdaptlmError
        from clients.keysim import SessionSuggester

        args.timeout, args.max_retries = 600.0, 2
        args.api_key = args.api_key or None
        record["url"] = args.url
        try:
            cache = args.cache_weight if args.adapt or args.cache_weight is not None else 0.0
            with _client(args) as client, SessionSuggester(
                    client, lr=(args.lr if args.adapt else 0.0), decay=args.decay if args.adapt else None,
                    cache_weight=cache, max_chars=args.max_chars) as suggester:
                info = suggester.session.info
                if info is not None:
                    record.update({"lr": info.adaptation.lr, "decay": info.adaptation.decay,
                                   "cache_weight": info.adaptation.cache_weight})
                result = simulate(suggester, messages(measured), k=args.suggestions, warmup=messages(warm),
                                  on_message=progress)
        except AdaptlmError as e:
            return _report_sdk_error(e)
    else:
        from models.keysim import ModelSuggester
        from trainer.evaluation import config_for

        ckpt = _load(args.checkpoint, args.device)
        if ckpt.tokenizer.kind != "bytes":  # the in-process simulator runs the byte search
            raise UsageError(f"keyboard-sim --checkpoint needs a byte-level model; this one reads "
                             f"{ckpt.tokenizer.kind}: run it against a server of it (--url)")
        config = None
        cache = args.cache_weight or 0.0
        if args.adapt:
            try:
                if args.adapt_mode == "full":
                    config = config_for("dynamic", ckpt.dyneval, lr=args.lr, decay=args.decay)
                else:  # the server sessions' settings
                    section = ckpt.dyneval.get("session") or ckpt.dyneval.get("sparse", {})
                    from models.adaptation import DynEvalConfig

                    config = DynEvalConfig.from_dict(section, mode="sparse", cache=None,
                                                     **{k: v for k, v in (("lr", args.lr), ("decay", args.decay))
                                                        if v is not None})
                    if args.cache_weight is None:
                        cache = float(section.get("cache_weight", 0.0))
            except ValueError as e:  # --lr nan, --decay -1
                raise UsageError(str(e)) from None
            record.update({k: getattr(config, k) for k in ("rule", "lr", "decay", "segment")})
        record["checkpoint"] = str(ckpt.path)
        record["cache_weight"] = cache
        try:
            suggester = ModelSuggester(ckpt.model, config, stats=ckpt.stats, tokenizer=ckpt.tokenizer,
                                       max_chars=24 if args.max_chars is None else args.max_chars,
                                       cache_weight=cache, lexicon=ckpt.lexicon)
        except ValueError as e:
            raise UsageError(str(e)) from None
        result = simulate(suggester, messages(measured), k=args.suggestions, warmup=messages(warm),
                          on_message=progress)
    record.update(result.summary())
    if args.json:  # no word typed: accuracies and latencies are undefined (NaN), null in JSON
        print(json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                          for k, v in record.items()}))
    else:
        print(f"KSR {record['ksr']:.4f} ({result.typed:,} keys typed + {result.selections:,} selections for "
              f"{result.chars:,} characters); next word top-1 {record['top1_accuracy']:.4f}, top-3 "
              f"{record['top3_accuracy']:.4f} ({result.words:,} words); suggest p50 {record['suggest_ms_p50']:.1f} "
              f"ms, p99 {record['suggest_ms_p99']:.1f} ms")
    return 0


# -- adaptlm client ...: the Python SDK (clients/) against a running server ------------------------------------


_MAX_TIMEOUT_S = 1e6


def _client(args: argparse.Namespace) -> Client:
    from clients import DEFAULT_BASE_URL, Client, RetryPolicy

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
    data = _read_text_arg(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None


def _print_model(model: Any) -> None:
    print(model.model_dump_json())


def cmd_client(args: argparse.Namespace) -> int:
    """Runs one `adaptlm client` command; an SDK error is one line: exit 2 for a 4xx answer, else 1."""
    from clients import AdaptlmError

    try:
        with _client(args) as client:
            return int(args.client_func(client, args))
    except AdaptlmError as e:
        return _report_sdk_error(e)


def _report_sdk_error(e: Any) -> int:
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
        print(f"{result.bits_per_byte:.4f} bits per byte{_per_word(result.bits_per_word)} ({result.bytes} bytes, "
              f"{result.bits:.1f} bits)")
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
        _check_output(args.out)
    elif sys.stdout.isatty():  # binary bytes would garble the terminal and be of no use there
        raise UsageError("an export is binary: give --out FILE, or redirect standard output")
    blob = client.export_state(args.id)
    if args.out == "-":
        sys.stdout.buffer.write(blob)
        sys.stdout.buffer.flush()
    else:
        _write_whole(Path(args.out), lambda path: path.write_bytes(blob))
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


def _add_client_parsers(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="the server (default: http://127.0.0.1:8000)")
    common.add_argument("--api-key", default=os.environ.get("ADAPTLM_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $ADAPTLM_API_KEY)")
    common.add_argument("--timeout", type=float, help="seconds to wait for an answer (default: 120)")
    common.add_argument("--max-retries", type=int, default=2, help="retries of a 429 or 503 answer (default: 2)")

    c = sub.add_parser("client", help="talk to a running server (the Python SDK)")
    csub = c.add_subparsers(dest="client_command", required=True, parser_class=_Parser)

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
    ssub = se.add_subparsers(dest="session_command", required=True, parser_class=_Parser)
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="adaptlm", description="Adaptive language models: train, score, generate, serve, and a "
                                            "client of the server.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    from trainer.cli import add_train_arguments

    t = sub.add_parser("train", help="train a checkpoint (several processes: torchrun -m trainer)")
    add_train_arguments(t)  # shared with `python -m trainer` (torchrun)
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("score", help="bits per byte of a file")
    s.add_argument("--checkpoint", help="checkpoint directory (default: the shipped model)")
    s.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N")
    s.add_argument("file", help="text file, or - for standard input")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_score)

    g = sub.add_parser("generate", help="sample a continuation")
    g.add_argument("--checkpoint")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="bits per byte under static, dynamic, sparse or cache evaluation")
    e.add_argument("--checkpoint")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    e.add_argument("file", help="text file, or - for standard input")
    e.add_argument("--mode", default="static",
                   help="one or several (comma-separated) of static, dynamic, sparse, cache, dynamic+cache, "
                        "sparse+cache")
    e.add_argument("--json", action="store_true")
    e.add_argument("--plot", help="PNG of the loss against position for the modes asked")
    e.add_argument("--csv", help="CSV of the loss against position")
    e.add_argument("--window", type=int, default=2000, help="bytes per point of the loss curve")
    e.add_argument("--limit", type=int, default=0, help="evaluate the first N bytes only")
    for parser in (e,):
        parser.add_argument("--lr", type=float, help="eta (default: the checkpoint's tuned value)")
        parser.add_argument("--decay", type=float, help="lambda")
        parser.add_argument("--eps", type=float, help="epsilon of the RMS rules")
        parser.add_argument("--segment", type=int, help="tokens per adaptation segment (bytes; words for a word "
                            "model; default: the checkpoint's)")
        parser.add_argument("--sites", help="full mode: comma-separated parameter-name prefixes to adapt")
        parser.add_argument("--adapter-size", type=int,
                            help="sparse mode: units of the adaptation site (0: the whole site)")
        parser.add_argument("--layers-from", type=int,
                            help="full mode: adapt only the blocks from this one on (0 = the first) and the output "
                                 "layers; the embedding and earlier blocks stay fixed (0: every layer)")
    e.set_defaults(func=cmd_eval)

    u = sub.add_parser("tune", help="tune dynamic evaluation on validation text; writes dyneval.json")
    u.add_argument("--checkpoint")
    u.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    u.add_argument("--valid", required=True)
    u.add_argument("--mode", choices=["both", "full", "sparse", "cache"], default="both",
                   help="cache: the neural cache's theta and lambda at --cache-window, for the eval modes with +cache")
    u.add_argument("--cache-window", type=int, default=2000, help="cache mode: the window (tokens) tuned at")
    u.add_argument("--bytes", type=int, default=20_000, help="tune on the first N bytes of the validation text")
    u.add_argument("--segment", type=int, help="tokens per adaptation segment (bytes; words for a word model)")
    u.add_argument("--lr-start", type=float, default=1e-5)
    u.add_argument("--max-trials", type=int, default=30)
    u.add_argument("--layers-from", type=int, help="full mode: tune adapting the blocks from this one on only "
                                                   "(kept in dyneval.json; default: the checkpoint's, else 0)")
    u.set_defaults(func=cmd_tune)

    v = sub.add_parser("serve", help="run the HTTP server")
    v.add_argument("--checkpoint")
    v.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: ADAPTLM_DEVICE, else auto)")
    v.add_argument("--host")
    v.add_argument("--port", type=int)
    v.set_defaults(func=cmd_serve)

    kb = sub.add_parser("keyboard-sim", help="keystroke savings of word suggestions on a text")
    kb.add_argument("--text", required=True, help="the text to type (UTF-8); each line is a message")
    kb.add_argument("--url", help="a running server: suggestions under a session of it")
    kb.add_argument("--checkpoint", help="or a model in this process")
    kb.add_argument("--device", help="with --checkpoint: auto (the default), cpu, cuda or cuda:N")
    kb.add_argument("--api-key", default=os.environ.get("ADAPTLM_API_KEY"), help="with --url")
    kb.add_argument("--suggestions", type=int, default=3, help="words offered at each keystroke (default: 3)")
    kb.add_argument("--adapt", action=argparse.BooleanOptionalAction, default=False,
                    help="adapt on each finished message (default: no, the static model)")
    kb.add_argument("--adapt-mode", choices=["sparse", "full"], default="sparse",
                    help="sparse: a session's adapter (the server's settings); full: full dynamic evaluation "
                         "(--checkpoint only; the checkpoint's 'full' settings)")
    kb.add_argument("--lr", type=float, help="adaptation learning rate (default: the checkpoint's)")
    kb.add_argument("--decay", type=float, help="adaptation decay (default: the checkpoint's)")
    kb.add_argument("--cache-weight", type=float,
                    help="weight of the word cache of the observed text in the suggestions (default: with --adapt "
                         "sparse, the session's; else 0)")
    kb.add_argument("--last-bytes", type=int, help="type only the last N bytes (from a line start)")
    kb.add_argument("--warmup-bytes", type=int,
                    help="observe at most the N bytes before the typed part first (default: all of them)")
    kb.add_argument("--limit-bytes", type=int, help="type only the first N bytes of the typed part (whole lines)")
    kb.add_argument("--max-chars", type=int, help="longest completion in characters (default: 24)")
    kb.add_argument("--progress", type=int, default=0, help="a line on stderr every N messages (0: none)")
    kb.add_argument("--json", action="store_true")
    kb.set_defaults(func=cmd_keyboard_sim)

    _add_client_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        status = int(args.func(args))
        sys.stdout.flush()  # a closed standard output raises here, in the handler below, rather than at exit
        return status
    except UsageError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of standard output went away (`| head`): stop quietly, as a process that SIGPIPE ends would
        # (Python ignores SIGPIPE, so the write raised); stdout goes to /dev/null so that the flush at exit cannot
        # raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
