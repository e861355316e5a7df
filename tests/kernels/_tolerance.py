"""The kernel tolerance rule (flash-attention's): a kernel's error against a float64 reference must not exceed twice
the error of the same computation done by PyTorch in the kernel's dtype, plus a tiny absolute floor. A kernel need be
no more exact than its dtype allows, and a fixed tolerance would be too loose for float32 or too tight for bfloat16."""

from __future__ import annotations

import torch

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def _errors(kernel: torch.Tensor, truth: torch.Tensor, torch_same_dtype: torch.Tensor) -> tuple[float, float, float]:
    """-> the kernel's error, PyTorch's error (both max abs against truth) and the floor."""
    truth = truth.double().cpu()
    err = (kernel.double().cpu() - truth).abs().max().item() if kernel.numel() else 0.0
    base = (torch_same_dtype.double().cpu() - truth).abs().max().item() if kernel.numel() else 0.0
    floor = FLOOR[kernel.dtype] * max(1.0, truth.abs().max().item() if truth.numel() else 0.0)
    return err, base, floor


def kernel_error_ratio(kernel: torch.Tensor, truth: torch.Tensor, torch_same_dtype: torch.Tensor) -> float:
    """The kernel's error over what the rule allows it: <= 1 passes (bench.attention_variants' column)."""
    if kernel.shape != truth.shape or kernel.shape != torch_same_dtype.shape or not bool(torch.isfinite(kernel).all()):
        return float("inf")
    err, base, floor = _errors(kernel, truth, torch_same_dtype)
    return err / (2 * base + floor)


def assert_kernel_close(kernel: torch.Tensor, truth: torch.Tensor, torch_same_dtype: torch.Tensor,
                        what: str = "") -> None:
    """kernel and torch_same_dtype: the kernel's and PyTorch's results in the kernel's dtype; truth: float64."""
    assert kernel.shape == truth.shape == torch_same_dtype.shape, what
    err, base, floor = _errors(kernel, truth, torch_same_dtype)
    assert err <= 2 * base + floor, f"{what}: kernel error {err:.3g} > 2 x PyTorch's {base:.3g} + {floor:.1g}"
