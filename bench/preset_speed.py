"""Training speed of a preset (what sizes its max_steps): tokens/s of the trainer's own step, its parameters, and
the steps that fit in a training time.

    python -m bench.preset_speed --arch char-transformer --preset small --seconds 60
    python -m bench.preset_speed --arch char-transformer --preset gpu --device cuda --set batch_size=256 --minutes 5

Runs `trainer.train.train_step` (the preset's precision, accumulation and threads) on real text for `--seconds`
after a few warm-up steps; `--set key=JSON` overrides a setting (`--set model.n_layer=8`). Parameters are counted
as shipped: the inference ones, and the training-only heads apart (a preset with ship_training_only false leaves
them out of model.safetensors).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from bench._common import ROOT, machine_line
from models.device import resolve_device
from models.registry import build_model, config_from_dict
from trainer.config import make_config
from trainer.data import ByteStreams, read_corpus
from trainer.train import lr_at, train_precision, train_step

WARMUP_STEPS = 3


def _override(text: str) -> dict[str, Any]:
    key, _, value = text.partition("=")
    parsed = json.loads(value)
    if key.startswith("model."):
        return {"model": {key[6:]: parsed}}
    return {key: parsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="char-transformer")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--set", action="append", default=[], help="key=JSON, e.g. batch_size=64 or model.n_layer=8")
    ap.add_argument("--data", nargs="+", default=[str(ROOT / "tests" / "data" / "train.txt")])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--minutes", type=float, default=0.0, help="steps in this many minutes (default: max_minutes)")
    args = ap.parse_args()
    cfg = make_config(args.preset, {"arch": args.arch}, *[_override(s) for s in args.set])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(args.device)
    precision = train_precision(cfg.precision, device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as the trainer does on CUDA
    torch.manual_seed(cfg.seed)
    model = build_model(config_from_dict({"arch": cfg.arch, **cfg.model})).to(device).train()
    aux = set(model.training_only_parameters())
    n_aux = sum(p.numel() for n, p in model.named_parameters() if n in aux)
    n_inf = sum(p.numel() for p in model.parameters()) - n_aux
    data = read_corpus(args.data)
    while len(data) < cfg.batch_size * (cfg.bptt + 1) * 4:
        data += data
    streams = ByteStreams(data, cfg.batch_size, cfg.bptt)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    state = model.init_state(cfg.batch_size)
    step, t0, loss = 0, 0.0, torch.zeros(())
    while True:
        if step == WARMUP_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        elif step > WARMUP_STEPS and time.perf_counter() - t0 > args.seconds:
            break
        chunk, new_epoch = streams.chunk(step)
        if new_epoch:
            state = model.init_state(cfg.batch_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        model.set_training_progress(step / cfg.max_steps)
        result = train_step(model, opt, chunk.to(device), state, accumulate=cfg.accumulate, clip=cfg.clip,
                            precision=precision)
        loss, state = result.nll, result.state
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    tps = (step - WARMUP_STEPS) * cfg.batch_size * cfg.bptt / seconds
    minutes = args.minutes or cfg.max_minutes
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {args.arch} preset {args.preset} {' '.join(args.set)}: {machine_line()}, {device_name}, {precision}")
    print("| inference params | training-only params | float16 MB shipped | batch x bptt | tokens/s | steps timed"
          " | steps in " + f"{minutes:g} min | last next-byte loss (bits) |")
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    shipped = n_inf + (n_aux if cfg.ship_training_only else 0)
    steps = int(tps * minutes * 60 / (cfg.batch_size * cfg.bptt))
    print(f"| {n_inf:,} | {n_aux:,} | {shipped * 2 / 1e6:.2f} | {cfg.batch_size} x {cfg.bptt} | {tps:,.0f} "
          f"| {step - WARMUP_STEPS} | {steps:,} | {float(loss) / math.log(2):.3f} |")


if __name__ == "__main__":
    main()
