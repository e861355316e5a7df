"""`adaptlm` command line: train, score, generate, serve.

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
