"""kernels._dispatch: the process default (ADAPTLM_KERNELS, chosen once) and the per-call override."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels._dispatch import kernel_implementation, resolve_impl


@pytest.fixture
def fresh_choice() -> Iterator[None]:
    kernel_implementation.cache_clear()
    yield
    kernel_implementation.cache_clear()


def test_default_is_chosen_from_the_environment(fresh_choice: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTLM_KERNELS", "reference")
    assert kernel_implementation() == "reference"
    kernel_implementation.cache_clear()
    monkeypatch.setenv("ADAPTLM_KERNELS", "fastest")
    with pytest.raises(ValueError, match="ADAPTLM_KERNELS"):
        kernel_implementation()
    if not torch.cuda.is_available():
        kernel_implementation.cache_clear()
        monkeypatch.setenv("ADAPTLM_KERNELS", "auto")
        assert kernel_implementation() == "reference"
        kernel_implementation.cache_clear()
        monkeypatch.setenv("ADAPTLM_KERNELS", "triton")
        with pytest.raises(ValueError, match="no CUDA device|not installed"):
            kernel_implementation()


def test_per_call_override(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2)
    assert resolve_impl("reference", x) == "reference"
    assert resolve_impl(None, x) == "reference"  # CPU tensors take the reference whatever the default
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("cuda", x)
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA tensors"):
        resolve_impl("triton", x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", x) == "triton"
