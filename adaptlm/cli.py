"""`adaptlm` command line: train, score, generate, eval, tune, serve.

User mistakes (bad flags, unreadable files, bad checkpoints, empty text) print one line to stderr and
exit with status 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]


class UsageError(Exception):
    """A user mistake: reported in one line, exit status 2."""


def _fail(message: str) -> NoReturn:
    print(f"adaptlm: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _load(checkpoint: str | None) -> Any:
    from models.checkpoint import CheckpointError, load_checkpoint
    from server.settings import DEFAULT_CHECKPOINT

    try:
        return load_checkpoint(checkpoint or DEFAULT_CHECKPOINT)
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


def cmd_train(args: argparse.Namespace) -> int:
    from trainer.config import load_config_file, make_config
    from trainer.train import train

    layers: list[dict[str, Any]] = []
    if args.config:
        layers.append(load_config_file(args.config))
    flags: dict[str, Any] = {"arch": args.arch} if args.arch else {}
    for name in ("max_steps", "max_minutes", "batch_size", "bptt", "lr", "seed", "threads"):
        value = getattr(args, name)
        if value is not None:
            flags[name] = value
    layers.append(flags)
    try:
        cfg = make_config(args.preset, *layers)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    if cfg.arch != "mlstm":
        raise UsageError(f"architecture {cfg.arch!r} cannot be trained yet (available: mlstm)")
    for p in [*args.data, *([args.valid] if args.valid else [])]:
        if not Path(p).is_file():
            raise UsageError(f"{p}: no such file")
    out = Path(args.out)
    if args.resume and not (out / "last" / "trainer_state.json").is_file():
        raise UsageError(f"{out}: nothing to resume")
    try:
        result = train(cfg, args.data, out, valid_path=args.valid, resume=args.resume, progress=not args.quiet)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps({"out": str(result.out), "best_valid_bpb": result.best_valid_bpb, "steps": result.steps,
                      "seconds": round(result.seconds, 1)}))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from models.scoring import score_bytes

    data = _read_text_arg(args.file)
    ckpt = _load(args.checkpoint)
    result = score_bytes(ckpt.model, data)
    if args.json:
        print(json.dumps({"bits_per_byte": result.bits_per_byte, "bytes": result.bytes, "bits": result.bits}))
    else:
        print(f"{result.bits_per_byte:.4f} bits per byte ({result.bytes} bytes, {result.bits:.1f} bits)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from models.sampling import SamplingParams, generate

    if not args.prompt:
        raise UsageError("--prompt must not be empty")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    ckpt = _load(args.checkpoint)
    out = sys.stdout
    for piece in generate(ckpt.model, args.prompt.encode("utf-8"), params):
        out.write(piece)
        out.flush()
    out.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from server.app import create_app
    from server.settings import Settings

    overrides: dict[str, Any] = {}
    if args.checkpoint:
        overrides["checkpoint"] = args.checkpoint
    if args.host:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        raise UsageError("invalid settings: " + "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    if not Path(settings.checkpoint).is_dir():
        raise UsageError(f"{settings.checkpoint}: not a checkpoint directory")
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"lr": args.lr, "decay": args.decay, "eps": args.eps, "segment": args.segment,
                           "adapter_units": args.adapter_size}
    if args.sites:
        out["params"] = tuple(s for s in args.sites.split(",") if s)
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    from trainer.evaluation import EVAL_MODES, loss_curve, plot_curves, run_eval, write_curves_csv

    modes = [m for m in args.mode.split(",") if m]
    for m in modes:
        if m not in EVAL_MODES:
            raise UsageError(f"unknown mode {m!r}; choose from {', '.join(EVAL_MODES)}")
    data = _read_text_arg(args.file)
    if args.limit:
        data = data[: args.limit]
    ckpt = _load(args.checkpoint)
    records, curves = [], {}
    for m in modes:
        try:
            record, result = run_eval(ckpt, data, m, **_overrides(args))
        except ValueError as e:
            raise UsageError(str(e)) from None
        records.append(record)
        curves[m] = loss_curve(result.logprobs, args.window)
        if not args.json:
            print(f"{m}: {record['bits_per_byte']:.4f} bits per byte ({record['bytes']} bytes, "
                  f"{record['params_adapted']:,} parameters adapted, {record['state_bytes']:,} state bytes, "
                  f"{record['seconds']:.1f} s)")
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records))
    if args.csv:
        write_curves_csv(Path(args.csv), curves)
    if args.plot:
        plot_curves(Path(args.plot), curves, f"{Path(args.file).name}: loss against position")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trainer.evaluation import config_for
    from trainer.tune import tune_mode

    data = _read_text_arg(args.valid)[: args.bytes]
    ckpt = _load(args.checkpoint)
    if ckpt.path is None:
        raise UsageError("checkpoint has no directory to write dyneval.json into")
    dyneval = dict(ckpt.dyneval)
    sections = {"both": ["full", "sparse"], "full": ["full"], "sparse": ["sparse"]}[args.mode]
    results: dict[str, Any] = {}
    from models.adaptation import evaluate

    static = evaluate(ckpt.model, data, config_for("static", dyneval), stats=ckpt.stats).bits_per_byte
    for section in sections:
        base = config_for("dynamic" if section == "full" else "sparse", dyneval, segment=args.segment)
        best, trials = tune_mode(ckpt.model, ckpt.stats, data, base, lr_start=args.lr_start,
                                 max_trials=args.max_trials,
                                 on_trial=lambda t, s=section: print(f"{s}: lr={t['lr']:.3g} decay={t['decay']:.3g}"
                                                                     f" -> {t['bits_per_byte']:.4f}", file=sys.stderr))
        best_bpb = min(t["bits_per_byte"] for t in trials)
        entry = {k: v for k, v in asdict(best).items() if k in ("rule", "lr", "decay", "eps", "segment",
                                                                 "adapter_units")}
        if section == "full":
            entry.pop("adapter_units", None)
        entry.update({"valid_bpb": best_bpb, "valid_static_bpb": static, "trials": len(trials)})
        dyneval[section] = entry
        results[section] = entry
    dyneval["tuned"] = True
    dyneval["tuned_on"] = {"file": Path(args.valid).name, "bytes": len(data)}
    (ckpt.path / "dyneval.json").write_text(json.dumps(dyneval, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"static_bpb": static, **results}))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="adaptlm", description="Adaptive language models: train, score, generate, serve.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a checkpoint")
    t.add_argument("--arch", choices=["mlstm"], default=None)
    t.add_argument("--preset", choices=["tiny", "default"], default=None)
    t.add_argument("--config", help="JSON or TOML file of training settings")
    t.add_argument("--data", nargs="+", required=True, help="training text files")
    t.add_argument("--valid", help="validation text file")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--resume", action="store_true", help="continue from OUT/last")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--max-minutes", type=float)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--bptt", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--seed", type=int)
    t.add_argument("--threads", type=int)
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("score", help="bits per byte of a file")
    s.add_argument("--checkpoint", help="checkpoint directory (default: the shipped model)")
    s.add_argument("file", help="text file, or - for standard input")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_score)

    g = sub.add_parser("generate", help="sample a continuation")
    g.add_argument("--checkpoint")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="bits per byte under static, dynamic, sparse or cache evaluation")
    e.add_argument("--checkpoint")
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
        parser.add_argument("--segment", type=int, help="bytes per adaptation segment")
        parser.add_argument("--sites", help="full mode: comma-separated parameter-name prefixes to adapt")
        parser.add_argument("--adapter-size", type=int, help="sparse mode: units of the adaptation site")
    e.set_defaults(func=cmd_eval)

    u = sub.add_parser("tune", help="tune dynamic evaluation on validation text; writes dyneval.json")
    u.add_argument("--checkpoint")
    u.add_argument("--valid", required=True)
    u.add_argument("--mode", choices=["both", "full", "sparse"], default="both")
    u.add_argument("--bytes", type=int, default=20_000, help="tune on the first N bytes of the validation text")
    u.add_argument("--segment", type=int)
    u.add_argument("--lr-start", type=float, default=1e-5)
    u.add_argument("--max-trials", type=int, default=30)
    u.set_defaults(func=cmd_tune)

    v = sub.add_parser("serve", help="run the HTTP server")
    v.add_argument("--checkpoint")
    v.add_argument("--host")
    v.add_argument("--port", type=int)
    v.set_defaults(func=cmd_serve)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
