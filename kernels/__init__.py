"""Custom kernels, each beside its pure-PyTorch reference; `kernel_implementation()` is the process's choice."""

from kernels._dispatch import kernel_implementation
from kernels.adapted_mlstm import adapted_mlstm, adapted_mlstm_ref
from kernels.adapter import (
    AdapterSteps,
    apply_adapter,
    apply_adapter_positions,
    apply_adapter_ref,
    batched_adapter,
    batched_adapter_ref,
)
from kernels.attention import memory_attention, memory_attention_ref
from kernels.compress import (
    COMPRESS_MODES,
    MemoryRing,
    compress_memory,
    compress_memory_ref,
    fixed_memory_update,
    fixed_memory_update_ref,
    memory_update_ref,
)

__all__ = ["COMPRESS_MODES", "AdapterSteps", "MemoryRing", "adapted_mlstm", "adapted_mlstm_ref", "apply_adapter",
           "apply_adapter_positions", "apply_adapter_ref", "batched_adapter", "batched_adapter_ref", "compress_memory",
           "compress_memory_ref", "fixed_memory_update", "fixed_memory_update_ref", "kernel_implementation",
           "memory_attention", "memory_attention_ref", "memory_update_ref"]
