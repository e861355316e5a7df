"""`adaptlm serve`: the HTTP server, its settings from the environment and the command line."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from adaptlm.cli._common import UsageError, pick_device


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
    pick_device(settings.device)  # a device that is not here: one line, before uvicorn starts
    from models.checkpoint import CheckpointError

    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    logging.basicConfig(level=level)
    request_id.install(settings.log_format)  # the server's lines name the request they belong to
    try:  # the engine loads the checkpoint before uvicorn starts: a bad one is this one line
        return serve(settings)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def add_parsers(sub: Any) -> None:
    v = sub.add_parser("serve", help="run the HTTP server")
    v.add_argument("--checkpoint")
    v.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: ADAPTLM_DEVICE, else auto)")
    v.add_argument("--host")
    v.add_argument("--port", type=int)
    v.set_defaults(func=cmd_serve)
