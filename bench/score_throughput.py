"""Scoring throughput (tokens/s) of a checkpoint at batch 1 and batch 32 (fp32, no gradients).

    python -m bench.score_throughput [--checkpoint DIR] [--bytes 20000]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.checkpoint import load_checkpoint
from models.scoring import score_bytes
from trainer.train import evaluate_bpb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--bytes", type=int, default=20_000, help="bytes per stream")
    args = ap.parse_args()
    ck = load_checkpoint(args.checkpoint)
    text = data_file("gutenberg/chesterton-brown.txt").read_bytes()
    print(f"# scoring throughput, {ck.name}: {machine_line()}")
    print("| batch (streams) | bytes scored | seconds | tokens/s |")
    print("| ---: | ---: | ---: | ---: |")
    n1 = args.bytes // 4
    score_bytes(ck.model, text[:200])  # warm-up
    t0 = time.perf_counter()
    score_bytes(ck.model, text[:n1])
    dt = time.perf_counter() - t0
    print(f"| 1 | {n1:,} | {dt:.1f} | {n1 / dt:,.0f} |")
    data = text[: 32 * args.bytes]
    with torch.no_grad():
        t0 = time.perf_counter()
        evaluate_bpb(ck.model, data, streams=32)
        dt = time.perf_counter() - t0
    print(f"| 32 | {len(data):,} | {dt:.1f} | {len(data) / dt:,.0f} |")


if __name__ == "__main__":
    main()
