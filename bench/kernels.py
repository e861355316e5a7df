"""Kernel benchmarks: each op's Triton kernel against eager PyTorch, as a markdown table.

On a CUDA device (the card is printed; timings by triton.testing.do_bench, median; the contenders of one case are
timed in turns, three rounds of a third of the time each, and each keeps the least of its round medians, so that a
slow stretch of the GPU cannot fall on one contender alone):
- memory_attention forward and forward+backward, B=8, H=8, D=64, Lq in {128, 512}, Lk in {512, 2048, 4096}, fp16 and
  bf16, with and without Transformer-XL relative terms, against F.scaled_dot_product_attention given the equivalent
  explicit float bias (causal mask, plus the relative term (q + v) . r[i - j] when rel). The rel bias depends on the
  queries, so it is (B, H, Lq, Lk); `sdpa+bias` has it built before timing (SDPA is not charged for it), `sdpa+bias
  built` builds it in every call, as a user without this kernel would (the (Lq, Lk) positional matmul and gather);
  and decoding, the forward at Lq = 1 over the longest memory (Lk 4096): a session's next token;
- compress_memory in each mode (B=8, N=1536, D=512, rate 3) against eager PyTorch, and one MemoryRing update
  (the paper's enwik8 layer: n_m 768, n_cm 1152, segment 768) against the eager torch.cat update, and the
  Compressive Transformer model's own fixed-shape update (kernels.fixed_memory_update) against its eager form;
- batched_adapter with 256 sessions (N=1024 rows, A=256 of H=768), forward and forward+backward, against a Python
  loop of per-session matmuls and against torch.bmm on the gathered adapters m[index].
Without CUDA: the reference paths' times at scaled-down shapes (GPU figures need a GPU).

Every case runs in its own try/except: a failure is a row of the table, not the end of the run (one GPU shot).
A Triton path that does not exist yet (memory_attention's kernel comes from another change) reads "n/a".

    python -m bench.kernels [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels.attention as attention_mod
from bench._common import DEFAULT_CHECKPOINT, ROOT, machine_line
from kernels import (
    MemoryRing,
    batched_adapter,
    batched_adapter_ref,
    compress_memory,
    compress_memory_ref,
    fixed_memory_update,
    memory_attention,
    memory_attention_ref,
    memory_update_ref,
)
from kernels._dispatch import kernel_implementation, triton_available

Fn = Callable[[], object]


@dataclass
class Result:
    op: str
    case: str
    impl: str
    ms: float | None = None
    error: str = ""
    baseline: str = ""  # the impls this row is compared with (same op and case), comma-separated


class Bench:
    def __init__(self, device: torch.device, quick: bool, graphs: bool = False) -> None:
        # graphs: on CUDA, time through a CUDA graph of many calls (triton's do_bench_cudagraph): the GPU's time alone,
        # without the Python launch between calls (which a short kernel waits for under do_bench) or the L2 flush
        self.device, self.quick, self.graphs = device, quick, graphs
        self.results: list[Result] = []
        # cases made inside `alternating()`, timed when it ends: (row, timed function)
        self._group: list[tuple[Result, Fn]] | None = None
        # on CUDA the rows of one case are timed in turns, this many rounds, each a third of the time: a slow
        # stretch of the GPU (clocks, a neighbour) then spoils one round of every row, not all of one row's
        self.rounds = 1 if quick or device.type != "cuda" else 3

    def time_ms(self, fn: Fn, share: float = 1.0) -> float:
        """Median time of `fn` in ms (on CUDA, triton's do_bench over `share` of the usual time)."""
        if self.device.type == "cuda":
            try:
                from triton.testing import do_bench, do_bench_cudagraph
            except ImportError:
                return self._cuda_events(fn)
            if self.graphs:
                return float(do_bench_cudagraph(fn, rep=max(1, int((40 if self.quick else 100) * share)),
                                                return_mode="median"))
            return float(do_bench(fn, warmup=max(1, int((10 if self.quick else 25) * share)),
                                  rep=max(1, int((40 if self.quick else 100) * share)), return_mode="median"))
        fn()  # warm-up
        times: list[float] = []
        budget = 0.05 if self.quick else 0.3
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 50):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def _cuda_events(self, fn: Fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10

    def case(self, op: str, case: str, impl: str, make: Callable[[], Fn | None], baseline: str = "") -> None:
        """make() builds the inputs and returns the timed function, or None when that path does not exist (n/a).
        Inside `alternating()` the timing waits for the block's end."""
        row = Result(op, case, impl, baseline=baseline)
        self.results.append(row)
        try:
            fn = make()
            if fn is None:
                row.error = "n/a"
            elif self._group is not None:
                self._group.append((row, fn))
                return
            else:
                row.ms = self.time_ms(fn)
        except Exception as e:  # one failing case must not end a one-shot GPU run
            row.error = _error(e)
        finally:
            if self.device.type == "cuda" and self._group is None:
                torch.cuda.empty_cache()
        self._report(row)

    @contextlib.contextmanager
    def alternating(self) -> Iterator[None]:
        """The cases made in the block (one case's contenders) are timed at its end, in turns: `rounds` rounds of
        each, its figure the least of its round medians."""
        self._group = []
        try:
            yield
        finally:
            group, self._group = self._group, None
            best: dict[int, float] = {}
            for _ in range(self.rounds):
                for row, fn in group:
                    if row.error:
                        continue
                    try:
                        ms = self.time_ms(fn, 1 / self.rounds)
                        best[id(row)] = min(ms, best.get(id(row), ms))
                    except Exception as e:
                        row.error = _error(e)
            for row, _ in group:
                if not row.error:
                    row.ms = best[id(row)]
                self._report(row)
            del group
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @staticmethod
    def _report(row: Result) -> None:
        # as it goes (stderr): a run stopped by its time limit still leaves its figures
        print(f"{row.op} | {row.case} | {row.impl} | {row.ms if row.ms is not None else row.error}", file=sys.stderr,
              flush=True)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:100]


def _fwd_bwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Fn:
    def run() -> None:
        for t in leaves:
            t.grad = None
        fn().float().sum().backward()
    return run


# ------------------------------------------------------------------------------------------------ memory_attention

def _attention_has_triton() -> bool:
    """kernels.attention's Triton kernel exists (STYLE: kernel functions are named `_<op>..._kernel`)."""
    return triton_available() and any(name.endswith("_kernel") for name in vars(attention_mod))


def _sdpa_bias(q: torch.Tensor, Lk: int, rel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
               scale: float) -> torch.Tensor:
    """The additive float bias that makes SDPA(q + u, k, v) equal memory_attention: (Lq, Lk) causal mask, or
    (B, H, Lq, Lk) with the relative term scale * (q + v) . r[Lk - Lq + i - j]."""
    B, H, Lq, D = q.shape
    i = torch.arange(Lq, device=q.device).view(Lq, 1)
    j = torch.arange(Lk, device=q.device).view(1, Lk)
    mask = torch.zeros(Lq, Lk, device=q.device, dtype=torch.float32).masked_fill(j > Lk - Lq + i, -math.inf)
    if rel is None:
        return mask.to(q.dtype)
    r, _, vb = rel
    pos = (q + vb.view(1, H, 1, D)) @ r[:Lk].permute(1, 2, 0)  # (B, H, Lq, Lk) by distance
    dist = (Lk - Lq + i - j).clamp(min=0).expand(B, H, Lq, Lk)
    return (scale * pos.float().gather(-1, dist) + mask).to(q.dtype)


def attention_cases(b: Bench) -> None:
    on_gpu = b.device.type == "cuda"
    if on_gpu:
        B, H, D = 8, 8, 64
        lqs, lks = ([1, 128], [512, 2048]) if b.quick else ([1, 128, 512], [512, 2048, 4096])
        dtypes = [torch.float16] if b.quick else [torch.float16, torch.bfloat16]
    else:
        B, H, D = 2, 4, 64
        lqs, lks = ([1, 64], [256]) if b.quick else ([1, 64, 128], [256, 512])
        dtypes = [torch.float32]
    has_triton = on_gpu and _attention_has_triton()
    for dtype in dtypes:
        for Lq in lqs:
            for Lk in lks[-1:] if Lq == 1 else lks:  # decoding: the longest memory
                for use_rel in (False, True):
                    case = f"B{B} H{H} D{D} Lq{Lq} Lk{Lk} {str(dtype)[6:]}{' rel' if use_rel else ''}"

                    def inputs(Lq: int = Lq, Lk: int = Lk, dtype: torch.dtype = dtype, use_rel: bool = use_rel
                               ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...] | None]:
                        g = torch.Generator(device=b.device).manual_seed(0)

                        def r(*s: int) -> torch.Tensor:
                            return torch.randn(*s, generator=g, device=b.device, dtype=dtype).requires_grad_(True)
                        qkv = [r(B, H, Lq, D), r(B, H, Lk, D), r(B, H, Lk, D)]
                        return qkv, ((r(Lk, H, D), r(H, D), r(H, D)) if use_rel else None)

                    for mode in ("fwd",) if Lq == 1 else ("fwd", "fwd+bwd"):  # sessions generate without gradients
                        def ours(impl: str, mode: str = mode, inputs: Callable = inputs) -> Fn | None:  # type: ignore[type-arg]
                            if impl == "triton" and not has_triton:
                                return None
                            (q, k, v), rel = inputs()

                            def call() -> torch.Tensor:
                                return memory_attention(q, k, v, rel=rel, impl=impl)  # type: ignore[arg-type]
                            call()  # a Triton path that fails raises here, not inside the timing
                            return _fwd_bwd(call, [q, k, v]) if mode == "fwd+bwd" else call

                        def built(mode: str = mode, inputs: Callable = inputs) -> Fn:  # type: ignore[type-arg]
                            # what a user without our kernel runs: the relative bias from q at every call, then SDPA
                            (q, k, v), rel = inputs()
                            scale = D**-0.5

                            def call() -> torch.Tensor:
                                bias = _sdpa_bias(q, k.shape[2], rel, scale)
                                qu = q + rel[1].view(1, H, 1, D)
                                return F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, scale=scale)
                            return _fwd_bwd(call, [q, k, v, *rel]) if mode == "fwd+bwd" else call

                        def sdpa(mode: str = mode, inputs: Callable = inputs) -> Fn:  # type: ignore[type-arg]
                            (q, k, v), rel = inputs()
                            scale = D**-0.5
                            with torch.no_grad():
                                bias = _sdpa_bias(q, k.shape[2], rel, scale)
                            qu = q if rel is None else (q + rel[1].view(1, H, 1, D)).detach().requires_grad_(True)
                            if on_gpu:  # the same numbers as ours, once
                                want = memory_attention_ref(q, k, v, rel=rel)  # type: ignore[arg-type]
                                got = F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, scale=scale)
                                assert (got.float() - want.float()).abs().max().item() < 0.05, "SDPA bias mismatch"

                            def call() -> torch.Tensor:
                                return F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, scale=scale)
                            return _fwd_bwd(call, [qu, k, v]) if mode == "fwd+bwd" else call

                        op = f"memory_attention {mode}"
                        with b.alternating():
                            b.case(op, case, "sdpa+bias", sdpa)
                            if use_rel:
                                b.case(op, case, "sdpa+bias built", built)
                            if on_gpu:
                                b.case(op, case, "triton", lambda ours=ours: ours("triton"),
                                       baseline="sdpa+bias,sdpa+bias built" if use_rel else "sdpa+bias")
                            b.case(op, case, "reference", lambda ours=ours: ours("reference"),
                                   baseline="sdpa+bias,sdpa+bias built" if use_rel else "sdpa+bias")


# ------------------------------------------------------------------------------------------------ compress

def compress_cases(b: Bench) -> None:
    on_gpu = b.device.type == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    if on_gpu:
        B, N, D, rate = (8, 768, 512, 3) if b.quick else (8, 1536, 512, 3)
        n_m, n_cm, n_s = (384, 576, 384) if b.quick else (768, 1152, 768)
    else:
        B, N, D, rate = (2, 192, 128, 3) if b.quick else (4, 384, 256, 3)
        n_m, n_cm, n_s = (96, 144, 96) if b.quick else (192, 288, 192)
    for mode in ("mean", "max", "conv"):
        case = f"B{B} N{N} D{D} rate{rate} {mode} {str(dtype)[6:]}"

        def make(impl: str, mode: str = mode) -> Fn | None:
            if impl == "triton" and not triton_available():
                return None
            g = torch.Generator(device=b.device).manual_seed(0)
            x = torch.randn(B, N, D, generator=g, device=b.device, dtype=dtype)
            w = torch.randn(D, D, rate, generator=g, device=b.device, dtype=dtype) / (D * rate) ** 0.5
            kw = {"weight": w} if mode == "conv" else {}
            if impl == "eager":
                return lambda: compress_memory_ref(x, rate=rate, mode=mode, **kw)
            return lambda: compress_memory(x, rate=rate, mode=mode, impl=impl, **kw)

        if on_gpu:
            with b.alternating():
                b.case("compress_memory", case, "eager", lambda make=make: make("eager"))
                b.case("compress_memory", case, "triton", lambda make=make: make("triton"), baseline="eager")
        else:
            b.case("compress_memory", case, "reference", lambda make=make: make("eager"))

        ring_case = f"B{B} D{D} n_m{n_m} n_cm{n_cm} seg{n_s} rate{rate} {mode} {str(dtype)[6:]}"

        def ring(impl: str, mode: str = mode) -> Fn | None:
            if impl == "triton" and not triton_available():
                return None
            g = torch.Generator(device=b.device).manual_seed(0)
            seg = torch.randn(B, n_s, D, generator=g, device=b.device, dtype=dtype)
            w = torch.randn(D, D, rate, generator=g, device=b.device, dtype=dtype) / (D * rate) ** 0.5
            if impl == "eager cat":
                state = [seg.new_zeros(B, n_m, D), seg.new_zeros(B, n_cm, D)]

                def cat_step() -> None:
                    state[0], state[1] = memory_update_ref(state[0], state[1], seg, mem_len=n_m, cmem_len=n_cm,
                                                           rate=rate, mode=mode, weight=w)
                return cat_step
            r = MemoryRing(B, D, mem_len=n_m, cmem_len=n_cm, rate=rate, mode=mode, device=b.device, dtype=dtype)
            for _ in range(3):  # full: every update evicts and compresses a whole segment
                r.update(seg, weight=w, impl=impl)
            return lambda: r.update(seg, weight=w, impl=impl)

        op = "memory update"
        with b.alternating():
            b.case(op, ring_case, "eager cat", lambda ring=ring: ring("eager cat"))
            if on_gpu:
                b.case(op, ring_case, "ring triton", lambda ring=ring: ring("triton"), baseline="eager cat")
            b.case(op, ring_case, "ring reference", lambda ring=ring: ring("reference"), baseline="eager cat")

    # the Compressive Transformer model's own update (fixed-shape right-aligned state, f applied before)
    fixed_case = f"B{B} D{D} n_m{n_m} n_cm{n_cm} seg{n_s} rate{rate} {str(dtype)[6:]}"

    def fixed(impl: str) -> Fn | None:
        if impl == "triton" and not triton_available():
            return None
        g = torch.Generator(device=b.device).manual_seed(0)
        mem, x, cmem, comp = (torch.randn(B, k, D, generator=g, device=b.device, dtype=dtype)
                              for k in (n_m + n_s - 1, n_s, n_cm, n_s // rate))
        done = torch.ones(B, dtype=torch.bool, device=b.device)
        n_new = torch.full((B,), n_s // rate, device=b.device)
        return lambda: fixed_memory_update(mem, x, done, cmem, comp, n_new, mem_len=n_m, impl=impl)

    with b.alternating():
        b.case("model memory update", fixed_case, "eager", lambda: fixed("reference"))
        if on_gpu:
            b.case("model memory update", fixed_case, "triton", lambda: fixed("triton"), baseline="eager")


# ------------------------------------------------------------------------------------------------ batched_adapter

def adapter_cases(b: Bench) -> None:
    on_gpu = b.device.type == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    if on_gpu:
        N, A, H, S = (256, 256, 768, 64) if b.quick else (1024, 256, 768, 256)
    else:
        N, A, H, S = (128, 64, 192, 32) if b.quick else (512, 128, 384, 128)
    case = f"N{N} A{A} H{H} S{S} {str(dtype)[6:]}"
    g = torch.Generator(device=b.device).manual_seed(0)
    index = torch.randint(0, S, (N,), generator=g, device=b.device)

    def leaves() -> list[torch.Tensor]:
        h = torch.randn(N, H, generator=g, device=b.device, dtype=dtype).requires_grad_(True)
        m = (0.05 * torch.randn(S, A, A, generator=g, device=b.device, dtype=dtype)).requires_grad_(True)
        return [h, m]

    def loop(h: torch.Tensor, m: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        head = h[:, :A]
        out = h.clone()
        for s, rows in groups:
            x = head[rows]
            out[rows, :A] = x + x @ m[s].T
        return out

    def gather_bmm(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        head = h[:, :A]
        adapted = head + torch.bmm(m[index], head.unsqueeze(-1)).squeeze(-1)  # (N, A, A) gathered
        return torch.cat([adapted, h[:, A:]], 1)

    impls: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {
        "python loop": None,  # built with its row groups in make()
        "gather+bmm": gather_bmm,
        "reference": lambda h, m: batched_adapter_ref(h, m, index),
        "triton": lambda h, m: batched_adapter(h, m, index, impl="triton"),
    }
    for mode in ("fwd", "fwd+bwd"):
        with b.alternating():
            for name in impls:
                if name == "triton" and not on_gpu:
                    continue

                def make(name: str = name, mode: str = mode) -> Fn | None:
                    if name == "triton" and not triton_available():
                        return None
                    h, m = leaves()
                    f = impls[name]
                    if f is None:  # the loop: each session's rows found once, outside the timing
                        found = [(s, (index == s).nonzero().squeeze(1)) for s in range(S)]
                        groups = [(s, rows) for s, rows in found if rows.numel()]

                        def f(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
                            return loop(a, c, groups)

                    def call() -> torch.Tensor:
                        return f(h, m)
                    return _fwd_bwd(call, [h, m]) if mode == "fwd+bwd" else call

                b.case(f"batched_adapter {mode}", case, name, make,
                       baseline="" if name == "python loop" else "python loop")


# ------------------------------------------------------------------------------------------------ end to end

def _impl_default(impl: str) -> None:
    """Make `impl` the process default that the models' calls (impl=None) take."""
    os.environ["ADAPTLM_KERNELS"] = impl
    kernel_implementation.cache_clear()


def _e2e_model(arch: str, device: torch.device, quick: bool) -> torch.nn.Module:
    """A randomly initialised model of the `gpu` preset (speed does not depend on the weights), frozen for serving."""
    from models.registry import build_model, config_from_dict
    from trainer.config import ARCH_PRESETS

    presets = ARCH_PRESETS.get(arch, {})
    fields = (presets.get("tiny") if quick else presets.get("gpu", presets.get("tiny"))) or {}
    torch.manual_seed(0)
    return build_model(config_from_dict({"arch": arch, **fields.get("model", {})})).to(device).eval().freeze()


def end_to_end(b: Bench) -> None:
    """Whole-model figures, Triton against reference as the process default (what a served model calls):
    - scoring a contiguous stream (8 rows x 1,024 bytes, no gradients) with the compressive and the character
      transformer at their `gpu` preset sizes (random weights: speed does not depend on them);
    - 64 adapting sessions of the shipped default mLSTM: sparse dynamic evaluation of 64 texts at once
      (evaluate_many, the engine's batched score-then-update step), 1,000 bytes each.
    The ms column is per call; the case names the bytes it handles, for tokens/s."""
    from models.adaptation import evaluate_many
    from models.checkpoint import load_checkpoint
    from trainer.evaluation import config_for

    device, quick = b.device, b.quick
    impls = ["reference"] + (["triton"] if device.type == "cuda" and triton_available() else [])
    rows, length = (2, 128) if quick else (8, 1024)
    for arch in ("compressive", "char-transformer"):
        try:
            model = _e2e_model(arch, device, quick)
        except Exception as e:
            b.results.append(Result(f"e2e {arch} scoring", "-", "-", error=f"{type(e).__name__}: {e}"[:100]))
            continue
        tokens = torch.randint(0, 256, (rows, length), device=device)
        case = f"{rows}x{length} bytes, gpu preset" if not quick else f"{rows}x{length} bytes, tiny preset"

        def score(model=model, tokens=tokens):  # noqa: ANN001, ANN202
            with torch.no_grad():
                return model(tokens, model.init_state(tokens.shape[0])).logits

        for impl in impls:
            _impl_default(impl)
            b.case(f"e2e {arch} scoring", case, impl, lambda score=score: score, baseline="reference")
    try:
        ck = load_checkpoint(DEFAULT_CHECKPOINT, device=device)
        text = (ROOT / "tests" / "data").glob("*.txt")
        corpus = b"".join(p.read_bytes() for p in sorted(text))
        n, size = (8, 200) if quick else (64, 1000)
        texts = [corpus[i * size : (i + 1) * size] for i in range(n)]
        cfg = config_for("sparse", ck.dyneval)
        for impl in impls:
            _impl_default(impl)
            b.case("e2e default mLSTM sessions", f"{n} sessions x {size} bytes, sparse", impl,
                   lambda: lambda: evaluate_many(ck.model, texts, cfg, stats=ck.stats, max_streams=n),
                   baseline="reference")
    except Exception as e:
        b.results.append(Result("e2e default mLSTM sessions", "-", "-", error=f"{type(e).__name__}: {e}"[:100]))
    os.environ.pop("ADAPTLM_KERNELS", None)
    kernel_implementation.cache_clear()


# ------------------------------------------------------------------------------------------------ report

def table(results: list[Result]) -> str:
    by_key = {(r.op, r.case, r.impl): r for r in results}
    lines = ["| op | case | impl | ms | speed-up |", "| --- | --- | --- | ---: | --- |"]
    for r in results:
        ms = f"{r.ms:.3f}" if r.ms is not None else r.error or "-"
        speeds = []
        for name in filter(None, r.baseline.split(",")):
            base = by_key.get((r.op, r.case, name))
            if r.ms and base is not None and base.ms:
                speeds.append(f"{base.ms / r.ms:.2f}x vs {name}")
        speed = ", ".join(speeds)
        lines.append(f"| {r.op} | {r.case} | {r.impl} | {ms} | {speed} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes and shorter timings")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = Bench(device, args.quick)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU only)"
    print(f"# Kernels\n\n{machine_line()}\n\nGPU: {card}; memory_attention tuning: {attention_mod.tuning()}\n")
    if device.type != "cuda":
        print("No CUDA device: the reference paths at scaled-down shapes. GPU figures need a GPU "
              "(run `python -m bench.kernels` on a CUDA machine).\n")
    with torch.inference_mode(False):
        for part in (attention_cases, compress_cases, adapter_cases):
            try:
                part(b)
            except Exception as e:  # keep the other parts' figures
                b.results.append(Result(part.__name__, "-", "-", error=f"{type(e).__name__}: {e}"[:100]))
        try:
            end_to_end(b)
        except Exception as e:  # the hook failing is a row too
            b.results.append(Result("end_to_end", "-", "-", error=f"{type(e).__name__}: {e}"[:100]))
    print(table(b.results))
    if device.type == "cuda":
        print("\nsdpa+bias: F.scaled_dot_product_attention given the explicit float bias, built before timing; "
              "sdpa+bias built: the relative bias built from q in every call, then SDPA.")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(), "device": card, "quick": args.quick,
                                         "attention_tuning": str(attention_mod.tuning()),
                                         "results": [asdict(r) for r in b.results]}, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
