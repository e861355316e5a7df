"""The Triton kernels compile for Hopper (sm_90: H100/H200) on a machine without a GPU: triton's own ptxas builds
the cubin. The interpreter runs the kernels' arithmetic but not the compiler's type checks and lowering; this
catches what only the compiler rejects, before anyone runs the GPU tests.

It runs in a subprocess without TRITON_INTERPRET: triton decorates its own library functions (tl.sum, tl.max, ...)
when triton.language is imported, for the interpreter or the compiler, and in this test process that import may
have happened under the conftest's TRITON_INTERPRET=1.

bfloat16, the precision the server runs on a GPU (`ADAPTLM_PRECISION=auto`), compiles in `make test`; float16 and
float32 are marked slow and `make compile-kernels` compiles every dtype. float32 (the IEEE `tl.dot` of the exact
mode) lowers every dot product to scalar FMAs: LLVM and ptxas take over a minute on 2 cores for the attention and
ring-convolution kernels alone; float16 takes as long as bfloat16 and catches little more."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("fp16", "bf16", "fp32")
INDEX_POINTERS = {"count_ptr", "len_ptr", "rows_ptr", "tile_sess_ptr", "tile_lo_ptr", "tile_hi_ptr", "starts_ptr",
                  "ends_ptr", "idx_ptr", "nnew_ptr"}  # int64 tensors; every other pointer holds the data's dtype


def compile_all(dtypes: tuple[str, ...] = DTYPES) -> None:
    """Compile each kernel in one configuration per dtype of `dtypes`, as the launchers pick them for realistic
    shapes."""
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
    for dtype in dtypes:
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
    compile_attention(dtypes)


def compile_attention(dtypes: tuple[str, ...] = DTYPES) -> None:
    """kernels.attention: every kernel at the launcher's GPU tiles, with rel and key_lengths in each dtype, and in
    float16 and bfloat16 also without rel, decoding (Lq = 1) and head dim 128, and decoding's key splits (the split
    forward and the combine kernel)."""
    from bench.kernel_resources import compile_attention_kernel
    from kernels import attention

    shipped, split = attention.Tuning(), attention.Tuning(splits=0)
    runs = []  # (dtype, D, Lq, rel, key_lengths, tuning)
    for dtype in dtypes:
        runs.append((dtype, 64, 512, True, True, shipped))
        if dtype != "fp32":
            runs += [(dtype, 64, 512, False, False, shipped), (dtype, 64, 1, True, False, shipped),
                     (dtype, 128, 256, True, True, shipped), (dtype, 64, 1, True, True, split),
                     (dtype, 128, 1, False, True, split)]
    for dtype, D, Lq, rel, kl, tune in runs:
        for which in ("fwd", "combine") if tune is split else ("fwd", "dq", "dkdv"):
            compiled = compile_attention_kernel(which, dtype, D, Lq, rel, kl, tune)
            assert compiled.asm.get("cubin"), f"{which} {dtype} D{D} Lq{Lq} {tune}: no cubin"


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Triton cache for the module's compiler runs: a kernel the resource test reads is compiled once."""
    return tmp_path_factory.mktemp("triton-cache")


def _env(cache: Path) -> dict[str, str]:
    """A compiling subprocess's environment: no interpreter, the module's Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(cache), TRITON_DEFAULT_FP_FUSION="1")
    return env


@pytest.mark.parametrize("dtypes", [pytest.param(("bf16",), id="bf16"),
                                    pytest.param(("fp16", "fp32"), id="fp16-fp32", marks=pytest.mark.slow)])
def test_kernels_compile_for_sm90(triton_cache: Path, dtypes: tuple[str, ...]) -> None:
    pytest.importorskip("triton")
    code = f"from tests.kernels.test_compile import compile_all; compile_all({dtypes!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(triton_cache), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]


def _compiled(cache: Path, kernels: tuple[str, ...]) -> dict[str, list[int]]:
    """{kernel: [registers, spilled bytes, instructions, shuffles]} of the attention kernels compiled for sm_90
    (bfloat16, D = 64, Lq = 512, rel, key lengths), in a subprocess (compiled, not interpreted). bfloat16: the
    configuration `test_kernels_compile_for_sm90[bf16]` compiles into the module's cache, so these are read from it,
    not compiled again (float16 compiles to the same registers, spills and shuffles: both are 16-bit mma operands)."""
    code = ("import json, sys; from bench.kernel_resources import compile_attention_kernel as c, resources as r, "
            "instructions as n; from kernels.attention import Tuning as T; "
            "print(json.dumps({k: [*r(x), *n(x)] for k in sys.argv[1].split(';') "
            "for x in [c(k, 'bf16', 64, 512, True, True, T())]}))")
    r = subprocess.run([sys.executable, "-c", code, ";".join(kernels)], cwd=ROOT, env=_env(cache),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_positional_skew_compiles_without_shuffles_and_spills_little(triton_cache: Path) -> None:
    # the positional term's skew is one gather over the flattened tile, through shared memory: with rel at D = 64
    # the forward spills nothing and the dq kernel well under a kilobyte a thread (sm_90: 0 and 576 bytes on triton
    # 3.6, 0 and 640 on 3.9), with the few shuffles of the row reductions (8 and 0). The skew by warp shuffles it
    # replaced had 264 and 512 shuffles and spilled 128 and 1,408 bytes (3.9); bench.kernel_resources prints them all
    pytest.importorskip("triton")
    got = _compiled(triton_cache, ("fwd", "dq"))
    (_, fwd_spill, _, fwd_shuffles), (_, dq_spill, _, dq_shuffles) = got["fwd"], got["dq"]
    assert fwd_spill <= 64 and dq_spill <= 1024, got
    assert fwd_shuffles <= 32 and dq_shuffles <= 32, got
