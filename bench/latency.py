"""What a keyboard user feels, per checkpoint: bench.families' "generate ms/byte" and "suggest ms" columns alone, each
the median of several runs, with the suggestions found (to compare two versions of the code side by side).

    python -m bench.latency [--checkpoints DIR ...] [--text FILE] [--runs 5] [--threads 1]

generate ms/byte: a 256-byte prompt, then 64 bytes greedy, batch 1, the whole call divided by 64 (as bench.families);
suggest ms: `advance` over a 256-byte context from the initial state, then `suggest` (word completions of a two-letter
prefix and next characters).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench._common import ROOT, SHARED, machine_line
from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, generate
from models.suggest import advance, suggest

FAMILIES = ("default", "char-transformer", "compressive")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", nargs="+",
                    default=[str(ROOT / "checkpoints" / f) for f in FAMILIES if (ROOT / "checkpoints" / f).is_dir()])
    ap.add_argument("--text", default=str(SHARED / "gutenberg" / "chesterton-brown.txt"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = Path(args.text).read_bytes()[:2000]
    print(f"# latency on cpu ({machine_line()})")
    print("| checkpoint | generate ms/byte | suggest ms | completions |")
    print("| --- | ---: | ---: | --- |")
    for path in args.checkpoints:
        ck = load_checkpoint(Path(path), device=torch.device("cpu"))
        model = ck.model
        prompt = text[:256]
        "".join(generate(model, prompt, SamplingParams(max_tokens=8, temperature=0.0)))  # warm-up
        gen = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            "".join(generate(model, prompt, SamplingParams(max_tokens=64, temperature=0.0)))
            gen.append((time.perf_counter() - t0) * 1e3 / 64)
        context = text[1000:1256].decode("utf-8", errors="ignore")
        context = context[: context.rfind(" ") + 3]  # inside a word: completions of a two-letter prefix
        raw = context.encode()
        times = []
        for _ in range(args.runs + 1):
            t0 = time.perf_counter()
            cursor = advance(model, model.init_state(1), b"\n" + raw)  # the model after the whole context
            found = suggest(model, cursor, context, tokenizer=ck.tokenizer)
            times.append((time.perf_counter() - t0) * 1e3)
        words = ", ".join(f"{c.text} {c.prob:.5f}" for c in found.completions)
        print(f"| {Path(path).name} | {statistics.median(gen):.2f} | {statistics.median(times[1:]):.1f} | {words} |")


if __name__ == "__main__":
    main()
