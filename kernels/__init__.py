"""Custom kernels, each beside its pure-PyTorch reference."""

from kernels.adapter import AdapterSteps, adapter_implementation, apply_adapter, apply_adapter_ref

__all__ = ["AdapterSteps", "adapter_implementation", "apply_adapter", "apply_adapter_ref"]
