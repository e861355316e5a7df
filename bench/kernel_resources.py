"""Registers and spills of memory_attention's compiled kernels, per `Tuning`, without a GPU.

Triton compiles for Hopper (sm_90) on any machine; `cuobjdump --dump-resource-usage` (shipped with triton) reads
each cubin's registers a thread (REG, at most 255) and its stack (STACK: bytes a thread spilled to local memory, read
and written in the kernel's inner loop), and `cuobjdump -sass` its instructions, counted once each (the inner loop
dominates them), with the warp shuffles among them. Spills and code length are the speed signals a CPU can give:
every setting the GPU probe (`bench.attention_variants`) times is listed here (the shipped kernel and its forward
in key splits, with the combine kernel that merges them).

The figures are the installed triton's. The GPU machine's image had triton 3.6.0; to see its code here:

    python -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. python -m bench.kernel_resources

    python -m bench.kernel_resources [--json PATH]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compiled code only (read when triton is imported)

# float32 buffers; KL is int32; other capitals: the dtype
FP32_BUFFERS = {"LSE", "L", "DELTA", "DQ", "DQR", "DR", "OP", "MP", "LP"}
FLOATS = {"qk_scale", "scale"}
SETTINGS = ["shipped", "splits=0"]


def compile_attention_kernel(which: str, dtype: str, D: int, Lq: int, rel: bool, key_lengths: bool,
                             tune: Any) -> Any:
    """Compile one of kernels.attention's kernels ("fwd", "dq", "dkdv", and "combine" which merges the forward's key
    splits) for sm_90 at the launcher's tiles for these shapes and `tune` (a kernels.attention.Tuning). dtype:
    "fp16", "bf16" or "fp32". The forward is compiled as it runs split when `tune.splits` is not 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import attention

    attention._triton()  # binds tl, wraps the kernels
    kernel = {"fwd": attention._memory_attention_kernel, "dq": attention._memory_attention_bwd_dq_kernel,
              "dkdv": attention._memory_attention_bwd_dkdv_kernel,
              "combine": attention._memory_attention_combine_kernel}[which]
    bm, bn, warps, stages = attention._block_sizes(D, Lq, True)
    consts: dict[str, Any] = {"HEAD_D": D, "HAS_KL": key_lengths, "PREC": "ieee" if dtype == "fp32" else "tf32",
                              "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_W": triton.next_power_of_2(bm + bn - 1),
                              "HAS_REL": rel}
    if which == "combine":
        consts = {"HEAD_D": D, "BLOCK": 16}
        warps = 4 if D <= 64 else 8
    if which == "fwd":
        consts["SPLIT"] = tune.splits != 1
    params = inspect.signature(kernel.fn).parameters
    fp32 = FP32_BUFFERS | ({"O"} if which == "fwd" and consts["SPLIT"] else set())  # split: partial sums in O
    sig = {name: "constexpr" if name in consts else "*fp32" if name in fp32 else
           "*i32" if name == "KL" else f"*{dtype}" if name.isupper() and name != "H" else
           "fp32" if name in FLOATS else "i32" for name in params}
    attrs, ints = {}, launch_ints(D, Lq)
    for i, name in enumerate(params):  # what a launch tells the compiler of its arguments (triton's specialisation)
        if sig[name].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-byte aligned
        elif sig[name] == "i32":
            value = ints.get(name)
            if value == 1:  # an integer 1 is compiled in as a constant
                sig[name] = "constexpr"
                consts[name] = 1
            elif value is not None and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def launch_ints(D: int, Lq: int, B: int = 8, H: int = 8, Lk: int = 4096) -> dict[str, int]:
    """The integer arguments of a launch at these shapes (contiguous tensors; r holds Lk + 3 distances): a launch
    compiles its kernel for what they are (divisible by 16, or 1), so the figures here must too. Without it the loads
    compile unaligned (element by element, never asynchronous copies): code no launch runs."""
    q = {"b": H * Lq * D, "h": Lq * D, "m": D}
    k = {"b": H * Lk * D, "h": Lk * D, "n": D}
    ints = {f"sq{a}": v for a, v in q.items()} | {f"sd{a}": v for a, v in q.items()}
    ints |= {f"sk{a}": v for a, v in k.items()} | {f"sv{a}": v for a, v in k.items()}
    return ints | {"srl": H * D, "srh": D, "H": H, "Lq": Lq, "Lk": Lk, "keys_per_split": Lk, "rows": B * H * Lq,
                   "n_split": 2}


def _cuobjdump(compiled: Any, flag: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def instructions(compiled: Any) -> tuple[int, int]:
    """(SASS instructions, of which warp shuffles) in a compiled kernel, counted statically: each instruction of the
    code once, however often a loop runs it (a proxy for the inner loop's length, which dominates the kernel)."""
    ops = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", _cuobjdump(compiled, "-sass"),
                     re.MULTILINE)
    return len(ops), sum(op == "SHFL" for op in ops)


def resources(compiled: Any) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread) of a compiled kernel's cubin."""
    out = _cuobjdump(compiled, "--dump-resource-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-300:]}")
    return int(m.group(1)), int(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    import triton

    from kernels import attention

    print(f"# memory_attention kernels compiled for sm_90 (triton {triton.__version__}), float16\n")
    print("| setting | D | Lq | rel | kernel | tiles | warps | registers | spilled bytes a thread | instructions | "
          "shuffles |")
    print("| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for setting in SETTINGS:
        tune = attention.Tuning.parse(setting)
        for D, Lq, rel in [(64, 512, True), (64, 512, False), (64, 1, True), (128, 256, True)]:
            # the key splits change the forward alone, and add the combine kernel
            for which in ("fwd", "dq", "dkdv") if tune.splits == 1 else ("fwd", "combine"):
                if Lq == 1 and which not in ("fwd", "combine"):
                    continue  # decoding serves without gradients
                bm, bn, warps, _ = attention._block_sizes(D, Lq, True)
                if which == "combine":
                    bm, bn, warps = 16, D, 4 if D <= 64 else 8  # rows x head dim
                compiled = compile_attention_kernel(which, "fp16", D, Lq, rel, True, tune)
                regs, stack = resources(compiled)
                count, shuffles = instructions(compiled)
                rows.append({"setting": setting, "D": D, "Lq": Lq, "rel": rel, "kernel": which, "tiles": [bm, bn],
                             "warps": warps, "registers": regs, "spill_bytes": stack, "instructions": count,
                             "shuffles": shuffles})
                print(f"| {setting} | {D} | {Lq} | {'yes' if rel else 'no'} | {which} | {bm} x {bn} | {warps} | "
                      f"{regs} | {stack} | {count} | {shuffles} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
