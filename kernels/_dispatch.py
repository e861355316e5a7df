"""Which implementation each kernel op runs: chosen once, logged once, overridable per call.

`ADAPTLM_KERNELS` = auto (default) | triton | reference. "auto" picks Triton when the package imports and a CUDA
device is present, the pure-PyTorch reference otherwise. The choice is made at the first call (never at import:
no CUDA query at import time) and reported by `kernel_implementation()` (the `kernel` label in /metrics).

Per call, `impl="triton" | "reference"` forces one (tests). Triton runs on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1` (the interpreter; float32/float16 only). A tensor on another device takes the reference
whatever the default says (a CPU-served model on a GPU machine).

Kernels are wrapped in `triton_kernel`, which hands them to `triton.jit` at their first launch rather than at
import: triton decides interpreter or compiler when it decorates, so a test's conftest that sets
TRITON_INTERPRET=1 takes effect whichever module imported `kernels` first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

try:  # optional (the gpu extra); kernel bodies name `tl`, resolved in their module's globals at the first launch
    import triton.language as tl
except ImportError:
    tl = None

__all__ = ["IMPLS", "kernel_implementation", "resolve_impl", "tl", "triton_available", "triton_kernel"]

IMPLS = ("triton", "reference")
log = logging.getLogger("adaptlm.kernels")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.cache
def triton_available() -> bool:
    """Triton imports (the package is optional: the `gpu` extra)."""
    return importlib.util.find_spec("triton") is not None


WANTED: str | None = None  # None: ADAPTLM_KERNELS, read at the first call; `use` sets it (the server's settings)
_FORCED: str | None = None  # `forced`'s implementation, for every call that names none


def use(wanted: str) -> None:
    """Make `wanted` (auto | triton | reference) the process default from the next call on."""
    global WANTED
    WANTED = wanted
    kernel_implementation.cache_clear()


@functools.cache
def kernel_implementation() -> str:
    """The default implementation of every op in this process: "triton" or "reference" (logged once)."""
    choice, why = choose_implementation(WANTED if WANTED is not None else os.environ.get("ADAPTLM_KERNELS", "auto"))
    log.info("kernels: %s (%s)", choice, why)
    return choice


def choose_implementation(wanted: str) -> tuple[str, str]:
    """ADAPTLM_KERNELS's value -> (implementation, why); ValueError for a value that cannot serve (unknown, or
    "triton" without triton or a CUDA device). The server's settings check it at start with this."""
    wanted = wanted.strip().lower() or "auto"
    if wanted not in ("auto", *IMPLS):
        raise ValueError(f"ADAPTLM_KERNELS must be auto, triton or reference, not {wanted!r}")
    if wanted == "reference":
        choice, why = "reference", "ADAPTLM_KERNELS=reference"
    elif not triton_available():
        choice, why = "reference", "triton is not installed"
    elif not torch.cuda.is_available():
        choice, why = "reference", "no CUDA device"
    else:
        choice, why = "triton", f"CUDA device {torch.cuda.get_device_name()}"
    if wanted == "triton" and choice != "triton":
        raise ValueError(f"ADAPTLM_KERNELS=triton, but {why}")
    return choice, why


@contextlib.contextmanager
def forced(impl: str) -> Iterator[None]:
    """Within the block every call that names no implementation runs `impl`, as if it named it (on CPU tensors
    "triton" then needs TRITON_INTERPRET=1). Process-wide: for the server's start-up check of the kernels
    (server/engine/_kernel_check.py) and tests, never while serving."""
    global _FORCED
    previous, _FORCED = _FORCED, impl
    try:
        yield
    finally:
        _FORCED = previous


def resolve_impl(impl: str | None, *tensors: torch.Tensor) -> str:
    """The implementation one call runs. `impl` forces one; None takes `forced`'s if in force, else the process
    default for CUDA tensors and the reference for others."""
    impl = impl if impl is not None else _FORCED
    if impl is not None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, not {impl!r}")
        if impl == "triton":
            if not triton_available():
                raise ValueError("impl='triton': triton is not installed")
            if not _interpreting() and not all(t.is_cuda for t in tensors):
                raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
        return impl
    if all(t.is_cuda for t in tensors) and kernel_implementation() == "triton":
        return "triton"
    return "reference"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Host code uses this, not `triton.cdiv`: that one is a `ConstexprFunction`, whose
    host call costs microseconds (a third of memory_attention's host time when it was used five times a launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1); the host-side `triton.next_power_of_2`, for the same reason."""
    return 1 << max(0, n - 1).bit_length()


class _LazyKernel:
    """`kernel[grid](*args, **meta)` like a `triton.jit` function, decorated at the first launch."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._jitted: Any = None

    def __getitem__(self, grid: Any) -> Any:
        if self._jitted is None:
            import triton

            self._jitted = triton.jit(self.fn)
        return self._jitted[grid]


def triton_kernel(fn: Callable[..., None]) -> _LazyKernel:
    """Decorator for a Triton kernel body (see the module docstring for why not `triton.jit` itself).
    A kernel calls no other jitted function through this wrapper: helpers are written inline."""
    return _LazyKernel(fn)
