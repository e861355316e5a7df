"""Kernel tests. Without a CUDA device the Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 is set
here, before any test of this package launches a kernel (triton reads it when it decorates a kernel, and
kernels/_dispatch.py's `triton_kernel` decorates at the first launch, so it does not matter which module imported
`kernels` first). With a CUDA device the same tests run compiled on it, and the `gpu` tests run too."""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def kdev() -> torch.device:
    """Where `interpreter` tests put their tensors: the CPU under the interpreter, else the CUDA device."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")
