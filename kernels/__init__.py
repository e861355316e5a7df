"""Custom kernels, each beside its pure-PyTorch reference."""

from kernels.adapted_mlstm import adapted_mlstm, adapted_mlstm_ref
from kernels.adapter import (
                             AdapterSteps,
                             adapter_implementation,
                             apply_adapter,
                             apply_adapter_ref,
                             batched_adapter,
                             batched_adapter_ref,
)
from kernels.attention import memory_attention, memory_attention_ref
from kernels.compress import COMPRESS_MODES, compress_memory, compress_memory_ref

__all__ = ["COMPRESS_MODES", "AdapterSteps", "adapted_mlstm", "adapted_mlstm_ref", "adapter_implementation",
           "apply_adapter", "apply_adapter_ref", "batched_adapter", "batched_adapter_ref", "compress_memory",
           "compress_memory_ref", "memory_attention", "memory_attention_ref"]
