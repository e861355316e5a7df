"""Custom kernels, each beside its pure-PyTorch reference."""

from kernels.adapter import apply_adapter, apply_adapter_ref

__all__ = ["apply_adapter", "apply_adapter_ref"]
