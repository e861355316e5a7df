"""The Triton kernels compile for Hopper (sm_90: H100/H200) on a machine without a GPU: triton's own ptxas builds
the cubin. The interpreter runs the kernels' arithmetic but not the compiler's type checks and lowering; this
catches what only the compiler rejects, before anyone runs the GPU tests.

It runs in a subprocess without TRITON_INTERPRET: triton decorates its own library functions (tl.sum, tl.max, ...)
when triton.language is imported, for the interpreter or the compiler, and in this test process that import may
have happened under the conftest's TRITON_INTERPRET=1."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("fp16", "bf16", "fp32")
INDEX_POINTERS = {"count_ptr", "len_ptr", "rows_ptr", "tile_sess_ptr", "tile_lo_ptr", "tile_hi_ptr", "starts_ptr",
                  "ends_ptr", "idx_ptr", "nnew_ptr"}  # int64 tensors; every other pointer holds the data's dtype


def compile_all() -> None:
    """Compile each kernel in one configuration per dtype, as the launchers pick them for realistic shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import adapter, compress

    kernels = [
        (compress._compress_kernel, {"RATE": 3, "BLOCK_J": 16, "BLOCK_D": 256, "MODE": 0}),
        (compress._compress_kernel, {"RATE": 3, "BLOCK_J": 16, "BLOCK_D": 256, "MODE": 1}),
        (compress._ring_conv_kernel, {"RATE": 3, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "HAS_BIAS": True}),
        (compress._fixed_update_kernel, {"BLOCK_S": 16, "BLOCK_D": 256, "HAS_COMP": True}),
        (compress._fixed_update_kernel, {"BLOCK_S": 16, "BLOCK_D": 256, "HAS_COMP": False}),
        (compress._ring_conv_kernel, {"RATE": 3, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "HAS_BIAS": False}),
        (compress._memory_update_kernel, {"RATE": 3, "BLOCK_C": 4, "BLOCK_D": 512, "MODE": 0}),
        (compress._memory_update_kernel, {"RATE": 3, "BLOCK_C": 4, "BLOCK_D": 128, "MODE": 1}),
        (compress._memory_update_kernel, {"RATE": 3, "BLOCK_C": 4, "BLOCK_D": 128, "MODE": 2}),
        (adapter._adapter_scan_kernel, {"BLOCK_N": 16, "BLOCK_J": 64, "BLOCK_K": 64}),
        (adapter._adapter_scan_kernel, {"BLOCK_N": 64, "BLOCK_J": 64, "BLOCK_K": 64}),
        (adapter._adapter_scan_grad_m_kernel, {"BLOCK_N": 16, "BLOCK_J": 64, "BLOCK_K": 64}),
        (adapter._batched_adapter_kernel, {"BLOCK_N": 16, "BLOCK_J": 64, "BLOCK_K": 64}),
        (adapter._adapter_grad_m_kernel, {"BLOCK_N": 32, "BLOCK_J": 64, "BLOCK_K": 64}),
    ]
    for dtype in DTYPES:
        for lazy, constexprs in kernels:
            params = inspect.signature(lazy.fn).parameters
            consts = {**constexprs, **({"IEEE": dtype == "fp32"} if "IEEE" in params else {})}
            sig = {name: "constexpr" if name in consts else
                   ("*i64" if name in INDEX_POINTERS else "*i1" if name == "done_ptr" else f"*{dtype}")
                   if name.endswith("_ptr") else "i32"
                   for name in params}
            src = ASTSource(triton.jit(lazy.fn), sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            assert compiled.asm.get("cubin"), f"{lazy.fn.__name__} {dtype}: no cubin"
    compile_attention()


ATTENTION_FP32 = {"LSE", "DELTA", "DQ", "DQR", "DR", "DRP"}  # float32 buffers; KL is int32; other capitals: the dtype
ATTENTION_FLOATS = {"qk_scale", "scale"}


def compile_attention() -> None:
    """kernels.attention: every kernel at the launcher's GPU tiles, with rel and key_lengths in each dtype, and in
    float16 also without rel, decoding (Lq = 1) and head dim 128; then run 2's rewrite (`Tuning.parse("rewrite")`:
    its tiles, 16-bit gathers, half ranges and the dr kernel) in float16 and bfloat16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import attention

    attention._triton()  # binds tl, wraps the kernels
    kernels = {"fwd": attention._memory_attention_kernel, "dq": attention._memory_attention_bwd_dq_kernel,
               "dkdv": attention._memory_attention_bwd_dkdv_kernel, "dr": attention._memory_attention_bwd_dr_kernel}
    shipped, rewrite = attention.Tuning(), attention.Tuning.parse("rewrite")
    runs = []  # (dtype, D, Lq, rel, key_lengths, tuning)
    for dtype in DTYPES:
        runs.append((dtype, 64, 512, True, True, shipped))
        if dtype == "fp16":
            runs += [(dtype, 64, 512, False, False, shipped), (dtype, 64, 1, True, False, shipped),
                     (dtype, 128, 256, True, True, shipped)]
        if dtype != "fp32":
            runs += [(dtype, 64, 512, True, True, rewrite), (dtype, 128, 256, True, True, rewrite)]
    for dtype, D, Lq, rel, kl, tune in runs:
        for which, kernel in kernels.items():
            if which == "dr" and (not rel or tune.dr != "diagonal"):
                continue
            bm, bn, warps, stages = attention._block_sizes(D, Lq, True, rel, which, tune.tiles)
            params = inspect.signature(kernel.fn).parameters
            consts = {"HEAD_D": D, "HAS_KL": kl, "PREC": "ieee" if dtype == "fp32" else "tf32",
                      "GATHER16": tune.gather16}
            if which == "dr":
                consts.update(BLOCK=bn, BLOCK_W=2 * bn)
            else:
                consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=triton.next_power_of_2(bm + bn - 1), HAS_REL=rel)
            if which == "fwd":
                consts["HALF_RANGE"] = tune.half_range and bm == bn
            if which == "dq":
                consts["DR_ATOMIC"] = tune.dr == "atomic"
            sig = {name: "constexpr" if name in consts else "*fp32" if name in ATTENTION_FP32 else
                   "*i32" if name == "KL" else f"*{dtype}" if name.isupper() and name not in ("B", "H") else
                   "fp32" if name in ATTENTION_FLOATS else "i32" for name in params}
            src = ASTSource(kernel, sig, constexprs=consts)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages})
            assert compiled.asm.get("cubin"), f"{kernel.fn.__name__} {dtype} D{D} Lq{Lq} {tune}: no cubin"


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", "from tests.kernels.test_compile import compile_all; compile_all()"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
