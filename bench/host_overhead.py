"""Host time per call of the Triton paths: the Python work around each kernel launch.

On a GPU, decoding runs one query row per (session, head) through every layer, and each kernel then takes a few
microseconds: the host work that launches it can cost more than the kernel. This prints microseconds per call.

- Without CUDA (any machine): the launches are replaced by no-ops (TRITON_INTERPRET=1 lets the CPU take the Triton
  path; the kernels never run). What is left is ours: checks, tile choice, allocations, autograd, the grid. Triton's
  own launcher is not in it.
- On CUDA: real launches at shapes small enough that the GPU keeps up, so a call's wall time is its host time;
  F.scaled_dot_product_attention at the same shapes is the yardstick.

    python -m bench.host_overhead [--calls N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import machine_line
from kernels import batched_adapter, compress_memory, memory_attention


class _NoLaunch:
    """Stands in for a kernel: `kernel[grid](*args, **meta)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **meta: None


def stub_launches() -> int:
    """Replace every Triton kernel of the kernels package by a no-op; -> how many."""
    import kernels.adapter
    import kernels.attention
    import kernels.compress

    kernels.attention._triton()  # wraps the attention module's functions: stub the wrapped kernels
    n = 0
    for mod in (kernels.attention, kernels.compress, kernels.adapter):
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(obj, "__getitem__"):  # `kernel[grid]`: jitted, or lazily so
                setattr(mod, name, _NoLaunch())
                n += 1
    return n


def per_call_us(fn: Callable[[], object], calls: int, cuda: bool) -> float:
    """Median over 5 rounds of the wall time per call, in microseconds."""
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def cases(device: torch.device) -> dict[str, Callable[[], object]]:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    B, H, D, Lk = 8, 8, 64, 512
    q1, q, k, v = rnd(B, H, 1, D), rnd(B, H, 128, D), rnd(B, H, Lk, D), rnd(B, H, Lk, D)
    rel = (rnd(Lk, H, D), rnd(H, D), rnd(H, D))
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    mem = rnd(B, 96, 128)
    h, m = rnd(64, 192), rnd(16, 64, 64)
    index = torch.randint(0, 16, (64,), generator=g, device=device)
    out: dict[str, Callable[[], object]] = {}

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                return fn()
        return call

    out["memory_attention decode Lq1 Lk512, no grad"] = no_grad(lambda: memory_attention(q1, k, v, impl="triton"))
    out["memory_attention decode Lq1 Lk512 rel, no grad"] = no_grad(
        lambda: memory_attention(q1, k, v, rel=rel, impl="triton"))
    out["memory_attention Lq128 Lk512, no grad"] = no_grad(lambda: memory_attention(q, k, v, impl="triton"))
    out["memory_attention Lq128 Lk512, recording gradients"] = lambda: memory_attention(qg, kg, vg, impl="triton")
    if device.type == "cuda":
        out["sdpa decode Lq1 Lk512 (yardstick), no grad"] = no_grad(
            lambda: F.scaled_dot_product_attention(q1, k, v))
    out["compress_memory mean B8 N96 D128, no grad"] = no_grad(
        lambda: compress_memory(mem, rate=3, mode="mean", impl="triton"))
    out["batched_adapter N64 A64 H192 S16, no grad"] = no_grad(lambda: batched_adapter(h, m, index, impl="triton"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per round (5 rounds; default 2000)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # the Triton path takes CPU tensors (its launches are stubbed)
    how = "real launches" if cuda else f"launches stubbed ({stub_launches()} kernels), TRITON_INTERPRET=1"
    print(f"# host time per call, {machine_line()}; {how}")
    print("| case | host us per call |\n| --- | ---: |")
    rows = []
    for name, fn in cases(device).items():
        us = per_call_us(fn, args.calls, cuda)
        rows.append({"case": name, "us": us})
        print(f"| {name} | {us:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "how": how, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
