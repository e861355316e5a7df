"""The commands that run a checkpoint in this process: train (handed to the trainer), score, generate, eval and
tune; each with its parser."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from adaptlm.cli._common import UsageError, check_output, load, per_word, pick_device, read_text_arg, write_whole


def cmd_train(args: argparse.Namespace) -> int:
    from trainer.cli import config_from_args, run_command, summary
    from trainer.train import train

    def run() -> dict[str, Any]:
        cfg = config_from_args(args)
        device = pick_device(args.device)
        return summary(train(cfg, args.data, Path(args.out), valid_path=args.valid, resume=args.resume,
                             progress=not args.quiet, device=device))

    return run_command("adaptlm", run)  # (a device that is not here: a UsageError, as for every command)


def cmd_score(args: argparse.Namespace) -> int:
    from models.scoring import score_bytes

    data = read_text_arg(args.file)
    ckpt = load(args.checkpoint, args.device)
    result = score_bytes(ckpt.model, data, tokenizer=ckpt.tokenizer)
    record: dict[str, Any] = {"bits_per_byte": result.bits_per_byte, "bytes": result.bytes, "bits": result.bits}
    if ckpt.tokenizer.reports_tokens:  # a word model: per word too (docs/algorithms.md §13)
        record.update(result.word_figures()._asdict())
    if args.json:
        print(json.dumps(record))
    else:
        words = per_word(record.get("bits_per_word"), record.get("perplexity"))
        print(f"{result.bits_per_byte:.4f} bits per byte{words} ({result.bytes} bytes, {result.bits:.1f} bits)")
    return 0


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
    ckpt = load(args.checkpoint, args.device)
    out = sys.stdout
    prompt = os.fsencode(args.prompt)  # the bytes given, UTF-8 or not (argv keeps undecodable bytes as surrogates)
    for piece in generate(ckpt.model, prompt, params, tokenizer=ckpt.tokenizer):
        out.write(piece)
        out.flush()
    out.write("\n")
    return 0


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
            check_output(out)
    plot_format = _plot_format(args.plot) if args.plot else None
    data = read_text_arg(args.file)
    if args.limit:
        data = data[: args.limit]
    ckpt = load(args.checkpoint, args.device)
    records, curves = [], {}
    for m in modes:
        try:
            record, result = run_eval(ckpt, data, m, **_overrides(args))
        except ValueError as e:
            raise UsageError(str(e)) from None
        records.append(record)
        curves[m] = loss_curve(result.logprobs, args.window)
        if not args.json:
            print(f"{m}: {record['bits_per_byte']:.4f} bits per byte"
                  f"{per_word(record.get('bits_per_word'), record.get('perplexity'))} "
                  f"({record['bytes']} bytes, {record['params_adapted']:,} parameters adapted, "
                  f"{record['state_bytes']:,} state bytes, {record['seconds']:.1f} s)")
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records))
    title = f"{Path(args.file).name}: loss against position"
    if args.csv:
        write_whole(Path(args.csv), lambda path: write_curves_csv(path, curves))
    if args.plot:
        write_whole(Path(args.plot), lambda path: plot_curves(path, curves, title, fmt=plot_format))
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
    data = read_text_arg(args.valid)[: args.bytes]
    tuned_on = {"file": Path(args.valid).name, "bytes": len(data)}
    ckpt = load(args.checkpoint, args.device)
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
    write_whole(ckpt.path / "dyneval.json", lambda path: path.write_text(text))
    print(json.dumps({"static_bpb": static, **results}))
    return 0


def add_parsers(sub: Any) -> None:
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
    e.add_argument("--lr", type=float, help="eta (default: the checkpoint's tuned value)")
    e.add_argument("--decay", type=float, help="lambda")
    e.add_argument("--eps", type=float, help="epsilon of the RMS rules")
    e.add_argument("--segment", type=int,
                   help="tokens per adaptation segment (bytes; words for a word model; default: the checkpoint's)")
    e.add_argument("--sites", help="full mode: comma-separated parameter-name prefixes to adapt")
    e.add_argument("--adapter-size", type=int, help="sparse mode: units of the adaptation site (0: the whole site)")
    e.add_argument("--layers-from", type=int,
                   help="full mode: adapt only the blocks from this one on (0 = the first) and the output layers; "
                        "the embedding and earlier blocks stay fixed (0: every layer)")
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
