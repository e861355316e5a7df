"""The start-up check of the Triton kernels (server/engine/_kernel_check.py): the model runs under both
implementations, and a server whose kernels disagree with the references, or fail, serves with the references.
Here the kernels run in the Triton interpreter on the CPU; a CUDA device is pretended where the server asks for one."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kernels import _dispatch
from kernels._dispatch import triton_available
from models.compressive import CompressiveConfig, CompressiveTransformer
from server.engine._kernel_check import PROMPT_TOKENS, check_model
from server.engine._loading import serving_kernels

pytestmark = [pytest.mark.interpreter,
              pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels in the Triton interpreter")]


@pytest.fixture(scope="module")
def model() -> CompressiveTransformer:
    # head dim 16 (the kernels' smallest), memory and compressed memory, conv compression: every kernel the
    # Compressive Transformer calls (attention with rel, in prompt and decoding tiles; the memory update)
    torch.manual_seed(0)
    config = CompressiveConfig(d_model=32, n_layer=2, n_head=2, d_ff=32, segment=9, mem_len=12, cmem_len=6, rate=3)
    return CompressiveTransformer(config).eval()


@pytest.fixture
def triton_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's choice reads "triton", as on a GPU machine; whatever the check switches back is undone after."""
    monkeypatch.setattr(_dispatch, "WANTED", "triton")
    monkeypatch.setattr(_dispatch, "choose_implementation", lambda wanted: (wanted, "pretended CUDA device"))
    _dispatch.kernel_implementation.cache_clear()
    yield
    _dispatch.kernel_implementation.cache_clear()


def _on_cuda(model: CompressiveTransformer) -> Any:
    return SimpleNamespace(model=model, name="tiny-compressive", device=torch.device("cuda"),
                           tokenizer=SimpleNamespace(vocab_size=256))


def _off_by(monkeypatch: pytest.MonkeyPatch, amount: float) -> list[int]:
    """The Triton attention forward, off by `amount` in its output (what a miscompiled kernel gives); -> its calls."""
    from kernels import attention

    real, calls = attention._memory_attention_fwd, []

    def wrong(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        out, lse = real(*args, **kwargs)
        return out + amount, lse
    monkeypatch.setattr(attention, "_memory_attention_fwd", wrong)
    return calls


def _checks(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """What each `check_model` the server runs returns (the check is the interpreter's costly part: run once a test)."""
    from server.engine import _loading

    real, problems = _loading.check_model, []

    def recorded(*args: Any) -> str | None:
        problems.append(real(*args))
        return problems[-1]
    monkeypatch.setattr(_loading, "check_model", recorded)
    return problems


def test_kernels_that_agree_serve(model: CompressiveTransformer, triton_default: None,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls, problems = _off_by(monkeypatch, 0.0), _checks(monkeypatch)
    assert serving_kernels(_on_cuda(model)) == ("triton", "")
    assert problems == [None]  # the server checked the model, and the check passed
    # every segment of the prompt and the decoding step ran the kernel in every layer
    segments = math.ceil(PROMPT_TOKENS / model.config.segment) + 1
    assert len(calls) == segments * model.config.n_layer
    assert _dispatch.kernel_implementation() == "triton"


def test_kernels_that_disagree_fall_back_to_the_references(model: CompressiveTransformer, triton_default: None,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    _off_by(monkeypatch, 0.05)
    problems = _checks(monkeypatch)
    with caplog.at_level(logging.ERROR):
        kernel, why = serving_kernels(_on_cuda(model))
    assert len(problems) == 1
    problem = problems[0]
    assert problem is not None and "off the references'" in problem
    assert kernel == "reference" and why == problem
    assert "serving with the references" in caplog.text
    assert _dispatch.kernel_implementation() == "reference"  # for the whole process: /metrics' label says so


def test_a_kernel_that_fails_falls_back(model: CompressiveTransformer, triton_default: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import compress

    def no_image(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
    monkeypatch.setattr(compress, "_fixed_update_triton", no_image)
    problem = check_model(model, 256)
    assert problem is not None and problem.startswith("RuntimeError: CUDA error: no kernel image")
    assert serving_kernels(_on_cuda(model)) == ("reference", problem)


def test_on_the_cpu_nothing_is_checked(model: CompressiveTransformer, triton_default: None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _off_by(monkeypatch, 0.5)
    cpu = SimpleNamespace(model=model, name="tiny", device=torch.device("cpu"), tokenizer=None)
    assert serving_kernels(cpu) == ("reference", "") and not calls

