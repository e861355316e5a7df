"""Decoding alone, one byte a row after a prompt, at batch 1 and batch 8, on the bare network and on the model the
server runs for adapting sessions (to compare two versions of the code side by side).

    python -m bench.decode [--checkpoints DIR ...] [--text FILE] [--runs 5] [--threads 1] [--bytes 64] [--batch 8]
                           [--profile]

"batch 1" is bench.families' "generate ms/byte": a greedy `generate` of a 256-byte prompt then n bytes, minus one of
the prompt then one byte, over the n - 1 bytes after the first (the prompt's time left out). "batch B" is the server's
generation step (`GenerationExecutor.step`): B sequences from B prompts (256 bytes each, at different places in the
text, so at different fills), each prefilled alone, then a byte of every one sampled and fed in one batched forward
(`Stepper.feed_many`), timed over the n - 1 steps after the first; ms a step, and a byte's share (÷ B). "served" runs
the network inside `MemoryMixed` with the checkpoint's distribution memories (`SessionModel.search_model`, what the
server runs for sessions; no session's memory is read here, as in bench.latency's second table). Medians of
`--runs`. The last column is a digest of the bytes generated, to check that two versions generate the same.

`--profile` prints instead where a step's time goes, per checkpoint at batch 1 and batch B on the bare network: the
steps after the first under `torch.profiler`, each top-level aten op's time (its children's included) by kind, the
top-level ops a step, and Python's own share of the time under `cProfile` (which inflates it).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench._common import family_args, family_text, machine_line
from models.base import LanguageModel
from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, Stepper, generate
from models.session import SessionModel


def batch1_ms(model: LanguageModel, prompt: bytes, n: int, runs: int) -> tuple[float, bytes]:
    """bench.families' decode-only figure: (a greedy call of n bytes - one of 1 byte) / (n - 1), medians of `runs`;
    and the n bytes."""

    def call(k: int) -> tuple[float, bytes]:
        t0 = time.perf_counter()
        text = "".join(generate(model, prompt, SamplingParams(max_tokens=k, temperature=0.0)))
        return (time.perf_counter() - t0) * 1e3, text.encode()

    call(8)  # warm-up
    whole = [call(n) for _ in range(runs)]
    first = [call(1)[0] for _ in range(runs)]
    return (statistics.median(t for t, _ in whole) - statistics.median(first)) / (n - 1), whole[0][1]


def batch_ms(model: LanguageModel, prompts: list[bytes], n: int, runs: int) -> tuple[float, bytes]:
    """ms a step of len(prompts) greedy sequences fed together (`Stepper.feed_many`), over the n - 1 steps after the
    first (median of `runs`); and the bytes generated, sequence after sequence."""

    def once(k: int) -> tuple[float, bytes]:
        steppers = []
        for p in prompts:
            s = Stepper(model, SamplingParams(max_tokens=k, temperature=0.0))
            s.prefill(p)
            steppers.append(s)
        out = [bytearray() for _ in prompts]
        tokens = [s.sample().token for s in steppers]  # the first byte: from the prompt's logits
        t0 = time.perf_counter()
        while True:
            Stepper.feed_many(steppers, tokens)
            tokens = [s.sample().token for s in steppers]
            for o, t in zip(out, tokens, strict=True):
                o.append(t)
            if steppers[0].finish_reason is not None:
                break
        return (time.perf_counter() - t0) * 1e3 / (k - 1), b"".join(bytes(o) for o in out)

    with torch.no_grad():
        once(8)  # warm-up
        timed = [once(n) for _ in range(runs)]
    return statistics.median(t for t, _ in timed), timed[0][1]


# the kinds of a step's top-level aten ops (`--profile`); the rest: "other"
KINDS = {
    "projections, MLP, head": ("addmm", "linear", "mm", "mv"),
    "attention products": ("bmm", "matmul", "baddbmm_", "baddbmm"),
    "state copies": ("cat", "index", "index_put_", "gather", "copy_", "clone", "stack", "index_select", "where",
                     "index_copy", "index_add_", "contiguous"),
    "softmax, masks, small elementwise": (
        "softmax", "masked_fill", "masked_fill_", "new_full", "full", "arange", "lt", "le", "eq", "ne", "sub", "rsub",
        "mul", "mul_", "add", "add_", "sum", "all", "any", "remainder", "bitwise_and", "clamp", "clamp_min",
        "nonzero", "_unique2", "sort", "argsort", "zeros", "zeros_like", "new_zeros", "new_empty", "empty", "to",
        "item", "relu", "relu_", "floor_divide", "minimum", "fill_", "embedding", "dropout", "is_nonzero",
        "detach_", "lift_fresh"),
    "views": ("view", "reshape", "slice", "select", "transpose", "permute", "expand", "split", "split_with_sizes",
              "unbind", "unsqueeze", "squeeze", "as_strided", "alias", "narrow", "t", "_unsafe_view", "chunk",
              "detach", "view_as"),
    "layer norms": ("layer_norm",),
    "log_softmax, greedy pick": ("log_softmax", "argmax"),
}


def profile_steps(model: LanguageModel, prompts: list[bytes], n: int) -> None:
    """Print where the n - 1 steps after the first of len(prompts) greedy sequences spend their time (`--profile`)."""

    def steppers() -> tuple[list[Stepper], list[int]]:
        out = []
        for p in prompts:
            s = Stepper(model, SamplingParams(max_tokens=n, temperature=0.0))
            s.prefill(p)
            out.append(s)
        return out, [s.sample().token for s in out]

    def steps(rows: list[Stepper], tokens: list[int]) -> None:
        for _ in range(n - 1):
            Stepper.feed_many(rows, tokens)
            tokens = [s.sample().token for s in rows]

    kind = {op: k for k, ops in KINDS.items() for op in ops}
    with torch.no_grad():
        steps(*steppers())  # warm-up
        rows, tokens = steppers()
        t0 = time.perf_counter()
        steps(rows, tokens)
        wall = (time.perf_counter() - t0) * 1e3 / (n - 1)
        rows, tokens = steppers()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            steps(rows, tokens)
        rows, tokens = steppers()
        python = cProfile.Profile()
        python.runcall(steps, rows, tokens)
    spent: dict[str, float] = defaultdict(float)
    ops = 0
    for e in prof.events():
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        ops += 1
        spent[kind.get(e.name[6:], "other")] += e.cpu_time_total
    stats = pstats.Stats(python)
    own = sum(v[2] for k, v in stats.stats.items() if not k[0].startswith("~"))  # type: ignore[attr-defined]
    total = sum(spent.values())
    print(f"batch {len(prompts)}: {wall:.2f} ms a step, {ops / (n - 1):.0f} top-level aten ops a step; "
          f"Python's own time under cProfile {100 * own / stats.total_tt:.0f}%")  # type: ignore[attr-defined]
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {100 * v / total:.0f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    family_args(ap)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bytes", type=int, default=64, help="bytes generated after each prompt")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="where a step's time goes, instead of the timings")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = family_text(args).read_bytes()[: 1000 * args.batch + 256]
    prompts = [text[1000 * b : 1000 * b + 256] for b in range(args.batch)]
    print(f"# decode on cpu ({machine_line()})")
    if args.profile:
        for path in args.checkpoints:
            print(f"\n## {Path(path).name}")
            model = load_checkpoint(Path(path), device=torch.device("cpu")).model
            for rows in (prompts[:1], prompts):
                profile_steps(model, rows, args.bytes)
        return
    print(f"| checkpoint | model | batch 1 ms/byte | batch {args.batch} ms/step | batch {args.batch} ms/byte "
          "| bytes digest |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for path in args.checkpoints:
        ck = load_checkpoint(Path(path), device=torch.device("cpu"))
        served = SessionModel.of(ck).search_model
        for name, model in (("bare", ck.model), ("served", served)):
            one, gen1 = batch1_ms(model, prompts[0], args.bytes, args.runs)
            many, genb = batch_ms(model, prompts, args.bytes, args.runs)
            digest = hashlib.sha256(gen1 + genb).hexdigest()[:10]
            print(f"| {Path(path).name} | {name} | {one:.3f} | {many:.2f} | {many / args.batch:.3f} | {digest} |",
                  flush=True)


if __name__ == "__main__":
    main()
