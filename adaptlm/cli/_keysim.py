"""`adaptlm keyboard-sim`: the keystroke savings of word suggestions on a text (adaptlm_client.keysim), from a server
(--url) or a checkpoint in this process (--checkpoint)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from adaptlm.cli._client import make_client, report_sdk_error
from adaptlm.cli._common import UsageError, load, read_text_arg


def cmd_keyboard_sim(args: argparse.Namespace) -> int:
    """Type a text against suggestions from a server (--url) or a checkpoint here (--checkpoint)."""
    from adaptlm_client.keysim import messages, simulate, split_text

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
    data = read_text_arg(args.text)
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
        from adaptlm_client import AdaptlmError
        from adaptlm_client.keysim import SessionSuggester

        args.timeout, args.max_retries = 600.0, 2
        args.api_key = args.api_key or None
        record["url"] = args.url
        try:
            cache = args.cache_weight if args.adapt or args.cache_weight is not None else 0.0
            with make_client(args) as client, SessionSuggester(
                    client, lr=(args.lr if args.adapt else 0.0), decay=args.decay if args.adapt else None,
                    cache_weight=cache, max_chars=args.max_chars) as suggester:
                info = suggester.session.info
                if info is not None:
                    record.update({"lr": info.adaptation.lr, "decay": info.adaptation.decay,
                                   "cache_weight": info.adaptation.cache_weight})
                result = simulate(suggester, messages(measured), k=args.suggestions, warmup=messages(warm),
                                  on_message=progress)
        except AdaptlmError as e:
            return report_sdk_error(e)
    else:
        from models.keysim import ModelSuggester
        from trainer.evaluation import config_for

        ckpt = load(args.checkpoint, args.device)
        config = None
        sessions = None  # with --adapt (sparse): the checkpoint's sessions, as its server runs them
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
                    from models.session import SessionModel

                    sessions = SessionModel.of(ckpt)
            except ValueError as e:  # --lr nan, --decay -1
                raise UsageError(str(e)) from None
            record.update({k: getattr(config, k) for k in ("rule", "lr", "decay", "segment")})
        record["checkpoint"] = str(ckpt.path)
        record["cache_weight"] = cache
        try:
            settings: dict[str, dict[str, Any] | None] = {"words": {"weight": cache}}
            learner = None
            if sessions is not None:
                from models.memory import weight_learner

                # --lr and --decay name the sessions' weight-learning memory, as the server's flat lr and decay do
                # (server/serving/_sessions.py): the output rows where they replace M; lr 0 leaves those off
                learner = weight_learner(sessions.memories) or "adapter"
                given = {k: v for k, v in (("lr", args.lr), ("decay", args.decay)) if v is not None}
                settings[learner] = None if args.lr == 0 and learner != "adapter" else given
            suggester = ModelSuggester(ckpt.model, config, stats=ckpt.stats, tokenizer=ckpt.tokenizer,
                                       max_chars=24 if args.max_chars is None else args.max_chars,
                                       cache_weight=cache, lexicon=ckpt.lexicon, sessions=sessions,
                                       settings=settings)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if learner is not None:
            on = suggester.session.config
            record["memories"] = list(on)
            chosen = on.get(learner)
            record.update({"lr": chosen.model_dump()["lr"], "decay": chosen.model_dump()["decay"]} if chosen
                          else {"lr": 0.0, "decay": 0.0})
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


def add_parsers(sub: Any) -> None:
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
