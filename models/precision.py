"""Inference precision: float32 everywhere, or bfloat16 for the recurrent matmuls (models/mlstm.py).

The server runs all of its model work (scoring, observes' sparse adaptation, generation, suggestions) under
`inference_precision(...)`: with "bfloat16" that is `torch.autocast(dtype=torch.bfloat16)`, which a model
reads as "the weights may be used in bf16 where it is safe" (the mLSTM: its two recurrent matmuls, on cached
bf16 copies; everything else in float32). The update path of sparse adaptation turns it off again
(models/adaptation/_sparse.py): in bf16 a session's adapter would depend on what else was batched with it.
"auto" picks bfloat16 where the hardware multiplies it natively
(a CPU with AVX-512 BF16 or AMX, through oneDNN; a CUDA GPU with bf16 support) and float32 elsewhere, where
bf16 would be emulated and slower.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

__all__ = ["PRECISIONS", "Precision", "inference_precision", "native_bf16", "resolve_precision"]

Precision = Literal["auto", "float32", "bfloat16"]
PRECISIONS: tuple[Precision, ...] = ("auto", "float32", "bfloat16")


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(device: torch.device) -> bool:
    """Does `device` multiply bf16 matrices natively (faster than float32)? oneDNN also runs bf16 on any
    AVX-512 CPU, but emulated (slower than float32) without AVX-512 BF16 or AMX: those are what count."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if device.type == "cpu":
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_precision(precision: str, device: torch.device, *, bf16_model: bool = True
                      ) -> Literal["float32", "bfloat16"]:
    """"auto" -> what `device` runs fastest; "float32" and "bfloat16" as they are. `bf16_model` False (a model
    without `LanguageModel.bf16_inference`: under autocast everything it does would run in bf16, logits included)
    makes "auto" float32 and "bfloat16" an error."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if not bf16_model:
        if precision == "bfloat16":
            raise ValueError("this model does not declare bf16 inference (LanguageModel.bf16_inference)")
        return "float32"
    if precision == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    return precision


def inference_precision(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The context the model work runs in (thread-local): bf16 autocast for "bfloat16", nothing for "float32"."""
    if resolve_precision(precision, device) == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
