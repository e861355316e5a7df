"""kernels._dispatch: the process default (ADAPTLM_KERNELS, chosen once) and the per-call override."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels._dispatch import kernel_implementation, resolve_impl


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from kernels import _dispatch

    monkeypatch.setattr(_dispatch, "WANTED", None)  # a server in this process handed it its setting: the env's turn
    kernel_implementation.cache_clear()
    yield
    kernel_implementation.cache_clear()


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="what auto and triton resolve to without CUDA")


@pytest.mark.parametrize(
    ("setting", "expected", "error"),
    [
        ("reference", "reference", None),
        ("fastest", None, "ADAPTLM_KERNELS"),
        pytest.param("auto", "reference", None, marks=_NO_CUDA),
        pytest.param("triton", None, "no CUDA device|not installed", marks=_NO_CUDA),
    ],
)
def test_default_is_chosen_from_the_environment(fresh_choice: None, monkeypatch: pytest.MonkeyPatch, setting: str,
                                                expected: str | None, error: str | None) -> None:
    monkeypatch.setenv("ADAPTLM_KERNELS", setting)
    if error is None:
        assert kernel_implementation() == expected
    else:
        with pytest.raises(ValueError, match=error):
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
