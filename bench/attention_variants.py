"""memory_attention's kernel settings (`kernels.attention.Tuning`) side by side: correctness compiled, then speed.

The kernel's settings were chosen compiled on an H200 (the fastest correct one is the only kernel: docs/benchmarks.md,
"GPU"; the runs: docs/notes/2026-11-benchmarks-history.md). Two remain:
the shipped kernel and its forward in key splits (`splits=0`: FlashDecoding when the query tiles leave SMs idle), or
any setting named with --settings. Each setting is checked, then timed if correct:

1. for each setting, the kernel at test_cuda_realistic_shape's inputs (B2 H4 Lq128 Lk384 D64, key lengths 384 and
   200, rel; fp16 and bf16): the out and every gradient against the fp32 reference, by the kernel tolerance rule
   (tests/kernels/_tolerance.py): "ratio" is the worst error over its allowance, <= 1 passes; a setting with key
   splits is also checked decoding (Lq = 1, 2,048 keys);
2. for each setting that passed: forward and forward+backward times (triton.testing.do_bench medians) at B8 H8 D64
   fp16 with rel, the forward without rel, and the forward decoding (Lq = 1, 4,096 keys, rel), with every key valid
   given as key lengths; before them SDPA's at the same inputs, given the explicit bias built
   before timing (`sdpa+bias`, the issue's baseline) and built in every call (`sdpa+bias built`), as bench.kernels;
   then the fastest setting: the smallest geometric mean of its times (the JSON's "fastest"; bench/gpu_run.sh runs
   bench.kernels under it).

    python -m bench.attention_variants [--smoke] [--settings 'a;b'] [--graphs] [--json PATH]

--smoke: tiny shapes, any device (on a CPU, the kernels under TRITON_INTERPRET=1); checks this script, not speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench._common import machine_line  # noqa: E402
from bench.kernels import Bench, _fwd_bwd, _sdpa_bias  # noqa: E402
from kernels import attention  # noqa: E402
from kernels.attention import Tuning, memory_attention, memory_attention_ref  # noqa: E402
from tests.kernels._tolerance import kernel_error_ratio  # noqa: E402

SETTINGS = ["shipped", "splits=0"]  # on CUDA each is checked in bfloat16 too: gpu_run.sh times bench.kernels' bfloat16
# rows under the fastest
GRADS = ["out", "dq", "dk", "dv", "dr", "du", "dv_bias"]


def _inputs(B: int, H: int, Lq: int, Lk: int, D: int, dtype: torch.dtype, rel: bool, device: torch.device,
            seed: int = 11) -> list[torch.Tensor]:
    """q, k, v, do (and r, u, v_bias) as leaves in `dtype`."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (s * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    x = [rnd(B, H, Lq, D), rnd(B, H, Lk, D), rnd(B, H, Lk, D), rnd(B, H, Lq, D)]
    return x + ([rnd(Lk + 3, H, D, s=0.5), rnd(H, D, s=0.5), rnd(H, D, s=0.5)] if rel else [])


def _out_and_grads(fn: Callable[..., torch.Tensor], x: list[torch.Tensor], dtype: torch.dtype,
                   key_lengths: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.to(dtype).requires_grad_(True) for t in x[:3] + x[4:]]
    rel = tuple(leaves[3:]) if len(leaves) > 3 else None
    out = fn(*leaves[:3], rel=rel, key_lengths=key_lengths)
    return [out, *torch.autograd.grad((out * x[3].to(dtype)).sum(), leaves)]


def check(setting: str, dtype: torch.dtype, device: torch.device, smoke: bool) -> dict[str, Any]:
    """The kernel under `setting` against the fp32 reference, at the compiled test's shape (smaller with --smoke),
    and for a setting with key splits also decoding (Lq = 1, 2,048 keys: the auto splits' case)."""
    B, H, Lq, Lk, D = (2, 2, 20, 45, 16) if smoke else (2, 4, 128, 384, 64)
    attention.TUNING = Tuning.parse(setting)
    shapes = [(Lq, Lk)] + ([(1, 45 if smoke else 2048)] if attention.TUNING.splits != 1 else [])
    try:
        ratios: dict[str, float] = {}
        out_err = 0.0
        for Lq, Lk in shapes:
            x = _inputs(B, H, Lq, Lk, D, dtype, True, device)
            kl = torch.tensor([Lk, Lk * 200 // 384], device=device)
            got = _out_and_grads(lambda *a, **kw: memory_attention(*a, impl="triton", **kw), x, dtype, kl)
            lowp = _out_and_grads(memory_attention_ref, x, dtype, kl)
            exact = _out_and_grads(memory_attention_ref, x, torch.float32, kl)
            for n, a, b, w in zip(GRADS, got, lowp, exact, strict=True):
                key = n if Lq > 1 else f"{n} (Lq 1)"
                ratios[key] = kernel_error_ratio(a, w, b)
            out_err = max(out_err, (got[0].float() - exact[0]).abs().max().item())
        worst = max(ratios, key=lambda n: ratios[n])
        return {"setting": setting, "dtype": str(dtype)[6:], "ok": ratios[worst] <= 1.0, "worst": worst,
                "ratio": ratios[worst], "out_err": out_err, "error": ""}
    except Exception as e:  # a failing compile is a row, not the end of the one-shot run
        traceback.print_exc(file=sys.stderr)
        return {"setting": setting, "dtype": str(dtype)[6:], "ok": False, "worst": "-", "ratio": float("nan"),
                "out_err": float("nan"), "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


SDPA_ROWS = ["sdpa+bias", "sdpa+bias built"]  # bench.kernels' baselines: the bias built before timing, or per call


def timings(settings: list[str], device: torch.device, smoke: bool,
            done: Callable[[list[dict[str, Any]]], None] = lambda rows: None, graphs: bool = False
            ) -> list[dict[str, Any]]:
    """Each setting's times (a setting of SDPA_ROWS: SDPA's at the same inputs, for the targets' ratios). Decoding
    (Lq = 1, the forward alone: sessions generate without gradients) is one of the cases. The settings of one case are
    timed in turns (bench.kernels' `alternating`: rounds of each, the least of its round medians): timed one setting
    after another, the plain forward, the same kernel under settings that change only `rel`, ranged over 2x on an
    H200. `done(rows)` after each case: a run stopped by its time limit keeps the cases it timed. `graphs`: timed
    through CUDA graphs (the GPU's time without the Python launch, bench.kernels' Bench)."""
    b = Bench(device, quick=smoke, graphs=graphs)
    B, H, D = (1, 2, 16) if smoke else (8, 8, 64)
    scale = D**-0.5
    shapes = [(16, 48, True), (1, 48, True)] if smoke else [(128, 512, True), (512, 2048, True), (512, 4096, True),
                                                            (128, 512, False), (512, 2048, False), (512, 4096, False),
                                                            (1, 4096, True)]
    tunings = {s: Tuning.parse(s) for s in settings if s not in SDPA_ROWS}
    rows: list[dict[str, Any]] = []
    for Lq, Lk, rel in shapes:
        # under graphs the forward alone (a backward captured in a graph is another question than the kernel's time)
        for mode in ("fwd", "fwd+bwd") if rel and Lq > 1 and not graphs else ("fwd",):
            x = [t.requires_grad_(True) for t in _inputs(B, H, Lq, Lk, D, torch.float16, rel, device)]
            q, k, v = x[:3]
            r = tuple(x[4:]) if rel else None
            full = torch.full((B,), Lk, device=device)  # every key valid: the checks' compiled kernels serve
            with torch.no_grad():
                prebuilt = _sdpa_bias(q, Lk, r, scale)  # type: ignore[arg-type]
            case = f"Lq{Lq} Lk{Lk}{' rel' if rel else ''}"
            first = len(b.results)
            with b.alternating():
                for setting in settings:
                    def call(setting: str = setting, q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                             r: Any = r, prebuilt: torch.Tensor = prebuilt, full: torch.Tensor = full) -> torch.Tensor:
                        if setting in SDPA_ROWS:  # SDPA(q + u, k, v) under the explicit bias, as bench.kernels
                            bias = prebuilt if setting == "sdpa+bias" else _sdpa_bias(q, k.shape[2], r, scale)
                            qu = q if r is None else q + r[1].view(1, H, 1, D)
                            return F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, scale=scale)
                        attention.TUNING = tunings[setting]  # the launch reads it: each contender its own
                        return memory_attention(q, k, v, rel=r, key_lengths=full, impl="triton")
                    b.case(mode, case, setting, lambda call=call, x=x, mode=mode:
                           _fwd_bwd(call, x[:3] + x[4:]) if mode == "fwd+bwd" else call)
            rows += [{"setting": res.impl, "mode": mode, "case": case, "ms": res.ms, "error": res.error}
                     for res in b.results[first:]]
            done(rows)
    return rows


def fastest(times: list[dict[str, Any]], settings: list[str]) -> tuple[str, float] | None:
    """The setting (of those that passed) whose times have the smallest geometric mean over the cases, and that mean
    over the first setting's (shipped); None when no setting has every case timed."""
    def mean_log(setting: str) -> float | None:
        ms = [t["ms"] for t in times if t["setting"] == setting]
        if not ms or any(m is None or m <= 0 for m in ms) or len(ms) != len({(t["mode"], t["case"]) for t in times}):
            return None
        return sum(math.log(m) for m in ms) / len(ms)
    scored = {s: m for s in settings if (m := mean_log(s)) is not None}
    if not scored:
        return None
    best = min(scored, key=scored.__getitem__)
    base = scored.get(settings[0])
    return best, math.exp(scored[best] - base) if base is not None else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script on any device")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--graphs", action="store_true", help="time through CUDA graphs: the GPU's time alone, without the "
                    "host's launch between calls")
    ap.add_argument("--settings", help="';'-separated settings to check and time instead of the list (each checked in "
                    "bfloat16 too), e.g. 'shipped;splits=4'")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        ap.error("no CUDA device: the compiled kernels need one (--smoke runs them in the Triton interpreter)")
    import triton
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU, Triton interpreter)"
    print(f"# memory_attention settings\n\n{machine_line()}\n\nGPU: {card}; torch {torch.__version__}, "
          f"triton {triton.__version__}\n")
    with torch.inference_mode(False):
        # each setting checked, then the correct ones timed in turns, case by case; the JSON rewritten after each
        # check and each case, so a run stopped by its time limit keeps what it measured
        settings = args.settings.split(";") if args.settings else SETTINGS
        checks: list[dict[str, Any]] = []
        passed: list[str] = []
        times: list[dict[str, Any]] = []

        def save(rows: list[dict[str, Any]]) -> None:
            if args.json:  # whole or not at all: a run killed while writing leaves the previous version
                best = fastest(rows, passed) if rows else None
                partial = args.json.with_suffix(".tmp")
                partial.write_text(json.dumps({
                    "machine": machine_line(), "device": card, "triton": triton.__version__, "checks": checks,
                    "times": rows, "fastest": best[0] if best else None}, indent=1))
                os.replace(partial, args.json)
        for s in settings:
            mine = [check(s, dt, device, args.smoke) for dt in (torch.float16, torch.bfloat16)
                    if dt == torch.float16 or device.type == "cuda"]  # the interpreter: no bf16 dots
            checks += mine
            if all(c["ok"] for c in mine):
                passed.append(s)
            save(times)
        times = timings(SDPA_ROWS + passed, device, args.smoke, save, graphs=args.graphs)
        print("\n## Correctness (out and every gradient against the fp32 reference; ratio <= 1 passes)\n\n"
              "| setting | dtype | ok | worst | ratio | out max error |\n| --- | --- | --- | --- | ---: | ---: |")
        for c in checks:
            print(f"| {c['setting']} | {c['dtype']} | {'yes' if c['ok'] else 'NO'} | {c['worst']} | "
                  f"{c['ratio']:.2f} | {c['out_err']:.3g} |{' ' + c['error'] if c['error'] else ''}")
        print(f"\n## Times, ms ({'B1 H2 D16' if args.smoke else 'B8 H8 D64'} fp16; the settings that passed"
              f"{'; CUDA graphs: the GPU alone' if args.graphs else ''})\n")
        cases = list(dict.fromkeys((t["mode"], t["case"]) for t in times))
        print("| setting | " + " | ".join(f"{m} {c}" for m, c in cases) + " |")
        print("| --- |" + " ---: |" * len(cases))
        for s in [*SDPA_ROWS, *passed]:
            by = {(t["mode"], t["case"]): t for t in times if t["setting"] == s}
            cells = [f"{by[mc]['ms']:.3f}" if by.get(mc) and by[mc]["ms"] is not None else
                     (by[mc]["error"] if by.get(mc) else "-") for mc in cases]
            print(f"| {s} | " + " | ".join(cells) + " |")
        best = fastest(times, passed)
        if best is not None:
            print(f"\nfastest: {best[0]} (geometric mean of its times over {passed[0]}'s: {best[1]:.2f}; "
                  f"{'checked in bfloat16 too' if device.type == 'cuda' else 'interpreted'})")
    attention.TUNING = None
    if args.json:
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
