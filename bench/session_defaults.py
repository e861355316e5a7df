"""The grid behind the checkpoint's session defaults (dyneval.json "session"): sparse adaptation (H = 256) of one
stream, score-then-update, for each (eta, lambda), on held-out personal text (the first 30 KB of SMS messages;
the keyboard benchmark uses the file's last 20 KB) and on in-domain prose that adaptation must not hurt.

    python -m bench.session_defaults [--checkpoint DIR] [--lrs 4e-5,1e-4,2e-4,5e-4] [--decays 0,1e-3,1e-2]
"""

from __future__ import annotations

import argparse
import itertools

from bench._common import DEFAULT_CHECKPOINT, SHARED, machine_line
from models.checkpoint import load_checkpoint
from trainer.evaluation import run_eval

TEXTS = {  # name -> (file, first byte, last byte)
    "SMS": ("messages/sms_ham.train.txt", 0, 30_000),
    "prose": ("gutenberg/austen-persuasion.txt", 20_000, 40_000),
}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--lrs", type=floats, default=[4e-5, 1e-4, 2e-4, 5e-4])
    ap.add_argument("--decays", type=floats, default=[0.0, 1e-3, 1e-2])
    ap.add_argument("--adapter-size", type=int, default=256)
    args = ap.parse_args()
    ck = load_checkpoint(args.checkpoint)
    data = {name: (SHARED / rel).read_bytes()[a:b] for name, (rel, a, b) in TEXTS.items()}
    static = {name: run_eval(ck, text, "static")[0]["bits_per_byte"] for name, text in data.items()}
    print(f"# session defaults grid, {ck.name}, sparse H={args.adapter_size}: {machine_line()}")
    print("| eta | lambda | " + " | ".join(f"{n} bpb | {n} gain" for n in data) + " |")
    print("| ---: | ---: | " + " | ".join("---: | ---:" for _ in data) + " |")
    print("| static | | " + " | ".join(f"{static[n]:.3f} | " for n in data) + " |", flush=True)
    for lr, decay in itertools.product(args.lrs, args.decays):
        cells = []
        for name, text in data.items():
            bpb = run_eval(ck, text, "sparse", lr=lr, decay=decay, adapter_units=args.adapter_size)[0]["bits_per_byte"]
            cells.append(f"{bpb:.3f} | {100 * (1 - bpb / static[name]):+.1f}%")
        print(f"| {lr:g} | {decay:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
