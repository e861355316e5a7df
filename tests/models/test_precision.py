"""bf16 inference (models/precision.py, models/mlstm.py): which work runs in bf16, how close it stays to float32,
and that training under autocast and every path without it are untouched."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kernels.adapted_mlstm import adapted_mlstm
from models.adaptation import DynEvalConfig, evaluate_many
from models.checkpoint import load_checkpoint
from models.mlstm import MLSTM, MLSTMConfig
from models.precision import inference_precision, native_bf16, resolve_precision
from models.scoring import score_bytes

TEXT = (b"It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        b"want of a wife. However little known the feelings or views of such a man may be on his first entering "
        b"a neighbourhood, this truth is so well fixed in the minds of the surrounding families.")
BF16 = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Path) -> Any:
    ckpt = load_checkpoint(tiny_checkpoint)
    ckpt.model.eval()
    return ckpt


def test_precision_names_resolve() -> None:
    cpu = torch.device("cpu")
    assert resolve_precision("float32", cpu) == "float32"
    assert resolve_precision("bfloat16", cpu) == "bfloat16"
    assert resolve_precision("auto", cpu) == ("bfloat16" if native_bf16(cpu) else "float32")
    with pytest.raises(ValueError, match="precision must be one of auto, float32, bfloat16"):
        resolve_precision("fp8", cpu)
    with inference_precision("bfloat16", cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with inference_precision("float32", cpu):
        assert not torch.is_autocast_enabled("cpu")


def test_auto_needs_bf16_in_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN runs bf16 on any AVX-512 CPU, emulated (slower) without AVX-512 BF16 or AMX: "auto" asks the flags."""
    import models.precision as precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw"}))
    assert not native_bf16(cpu) and resolve_precision("auto", cpu) == "float32"
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert native_bf16(cpu) == torch.backends.mkldnn.is_available()
    assert not native_bf16(torch.device("meta"))


def test_bf16_scoring_stays_close_to_float32(ckpt: Any) -> None:
    model = ckpt.model
    exact = score_bytes(model, TEXT, logprobs=True)
    with inference_precision("bfloat16", BF16):
        low = score_bytes(model, TEXT, logprobs=True)
    assert low.bits != exact.bits  # the bf16 path ran
    assert low.bits == pytest.approx(exact.bits, rel=2e-3)
    assert np.abs(np.asarray(low.logprobs) - np.asarray(exact.logprobs)).max() < 0.05  # nats, any byte
    with torch.no_grad():  # the recurrent weights have bf16 copies, made once and kept
        assert model.w_m.weight(torch.bfloat16).dtype == torch.bfloat16
        assert model.w_m.weight(torch.bfloat16) is model.w_m.weight(torch.bfloat16)
    # and float32 work afterwards is float32 again, bit for bit
    assert score_bytes(model, TEXT, logprobs=True).bits == exact.bits


def test_bf16_copies_follow_the_weights(ckpt: Any) -> None:
    model = copy.deepcopy(ckpt.model)
    with torch.no_grad():
        before = model.w_mh.weight(torch.bfloat16).float()
        model.w_mh.g.mul_(2)  # in place: the cache key's version changes
        after = model.w_mh.weight(torch.bfloat16).float()
    assert torch.allclose(after, 2 * before, rtol=1e-2, atol=0)
    model.w_mh.v.requires_grad_(True)  # as in training (the loaded model is frozen)
    with pytest.raises(RuntimeError, match="without gradients"):
        model.w_mh.weight(torch.bfloat16)  # v requires grad and grad mode is on: not for training


def test_sparse_adaptation_runs_in_float32_under_bf16(ckpt: Any) -> None:
    """The update path keeps float32 under a bf16 autocast (a session's adapter must not depend on its batch:
    tests/models/test_batch_invariance.py): the same bits and adapters as in float32."""
    config = DynEvalConfig.from_dict(ckpt.dyneval.get("sparse", {}), mode="sparse", cache=None)
    config = DynEvalConfig(mode="sparse", rule=config.rule, lr=1e-3, decay=0.0, eps=config.eps, segment=20)
    texts = [TEXT, TEXT[::-1], TEXT[40:] + TEXT[:40]]
    exact = evaluate_many(ckpt.model, texts, config, stats=ckpt.stats)
    with inference_precision("bfloat16", BF16):
        low = evaluate_many(ckpt.model, texts, config, stats=ckpt.stats)
    for a, b in zip(exact, low, strict=True):
        assert b.bits == a.bits
        for site, m in a.adapted.items():
            torch.testing.assert_close(b.adapted[site], m, rtol=0, atol=0)


def test_adapted_mlstm_with_bf16_weights_gives_close_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    B, T, H, k = 3, 12, 32, 16
    mx, zx = torch.randn(B, T, H, generator=gen), torch.randn(B, T, 4 * H, generator=gen)
    h0, c0 = torch.randn(B, H, generator=gen) * 0.1, torch.randn(B, H, generator=gen) * 0.1
    w_mh, w_m = torch.randn(H, H, generator=gen) / H**0.5, torch.randn(4 * H, H, generator=gen) / H**0.5
    m = (torch.randn(B, k, k, generator=gen) * 0.05).requires_grad_(True)
    target = torch.randn(B, T, H, generator=gen)
    results = []
    for weights in ((w_mh, w_m), (w_mh.bfloat16(), w_m.bfloat16())):
        hs, _, _ = adapted_mlstm(mx, zx, h0, c0, *weights, m)
        (grad,) = torch.autograd.grad((hs * target).sum(), [m])
        assert hs.dtype == grad.dtype == torch.float32
        results.append((hs.detach(), grad))
    (hs32, g32), (hs16, g16) = results
    assert not torch.equal(hs16, hs32)
    assert (hs16 - hs32).abs().max() < 0.03
    assert torch.linalg.norm(g16 - g32) < 0.03 * torch.linalg.norm(g32)
    with pytest.raises(ValueError, match="one for w_mh and w_m"):
        adapted_mlstm(mx, zx, h0, c0, w_mh.bfloat16(), w_m, m)


def test_training_under_autocast_is_not_the_inference_path() -> None:
    """An unfrozen model (training, and the trainer's validation without gradients) keeps autocast's usual
    meaning, every matmul it covers in bf16; only a model frozen for inference (`freeze`, as the checkpoint loader
    leaves it) takes the inference path, whatever the grad mode."""
    model = MLSTM(MLSTMConfig(hidden=16, embed_dim=8))
    tokens = torch.randint(0, 256, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        training = model(tokens, model.init_state(2))
        with torch.no_grad():
            validation = model(tokens, model.init_state(2))
        model.freeze()
        inference = model(tokens, model.init_state(2))
    assert training.logits.dtype == validation.logits.dtype == torch.bfloat16  # the output layer under autocast
    assert inference.logits.dtype == torch.float32  # only the recurrent matmuls in bf16
    assert training.logits.requires_grad and not inference.logits.requires_grad


def test_a_model_without_bf16_inference_runs_in_float32() -> None:
    """bf16 is a capability a model declares (`bf16_inference`): without it, under autocast everything would run
    in bf16, logits and handed-back state included, so "auto" resolves to float32 and "bfloat16" is refused."""
    cpu = torch.device("cpu")
    assert MLSTM.bf16_inference
    assert resolve_precision("auto", cpu, bf16_model=False) == "float32"
    assert resolve_precision("float32", cpu, bf16_model=False) == "float32"
    with pytest.raises(ValueError, match="bf16 inference"):
        resolve_precision("bfloat16", cpu, bf16_model=False)
