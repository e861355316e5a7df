"""Custom kernels, each beside its pure-PyTorch reference."""

from kernels.adapted_mlstm import adapted_mlstm, adapted_mlstm_ref
from kernels.adapter import AdapterSteps, adapter_implementation, apply_adapter, apply_adapter_ref

__all__ = ["AdapterSteps", "adapted_mlstm", "adapted_mlstm_ref", "adapter_implementation", "apply_adapter",
           "apply_adapter_ref"]
