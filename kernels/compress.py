"""Compressive-memory compression (Compressive Transformer, Rae et al. 2019, sec. 3.1; ALGORITHMS.md §7).

Layout: mem (B, N, D), N a multiple of `rate` c -> compressed (B, N / c, D).
mode "mean" / "max": pool each run of c slots; "conv": 1-D convolution, kernel = stride = c, weight (D, D, c) in
nn.Conv1d layout, bias (D,) optional.

Known limits: the reference only; no fused FIFO update yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["COMPRESS_MODES", "compress_memory", "compress_memory_ref"]

COMPRESS_MODES = ("conv", "mean", "max")


def compress_memory_ref(mem: torch.Tensor, *, rate: int, mode: str, weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch reference. Layout in the module docstring."""
    B, N, D = mem.shape
    if mode == "conv":
        assert weight is not None
        return F.conv1d(mem.transpose(1, 2), weight, bias, stride=rate).transpose(1, 2)  # (B, N/c, D)
    runs = mem.view(B, N // rate, rate, D)  # (B, N/c, c, D)
    return runs.mean(2) if mode == "mean" else runs.amax(2)  # (B, N/c, D)


def compress_memory(mem: torch.Tensor, *, rate: int, mode: str, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """Public op. `impl`: "triton" | "reference" (default: the implementation chosen at start)."""
    if mem.dim() != 3 or rate < 1 or mem.shape[1] % rate:
        raise ValueError(f"mem {tuple(mem.shape)}: expected (B, N, D) with N a multiple of rate {rate}")
    if mode not in COMPRESS_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPRESS_MODES)}")
    D = mem.shape[2]
    if mode == "conv" and (weight is None or weight.shape != (D, D, rate)):
        raise ValueError(f"mode 'conv' needs weight of shape ({D}, {D}, {rate})")
    return compress_memory_ref(mem, rate=rate, mode=mode, weight=weight, bias=bias)
