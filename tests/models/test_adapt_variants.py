"""Variants of the session's adaptation (models/adaptation/_variants.py): the served settings score as the engine does,
no byte's score sees that byte or later ones, the divergence guard holds, and the output parts learn.

Tiny float64 mLSTMs, frozen as a loaded checkpoint is, with synthetic MS_g statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from models.adaptation import DIVERGED_BITS, DynEvalConfig, VariantConfig, VariantStream, evaluate
from models.copymodel import CopyConfig, CopyModel
from models.mlstm import MLSTM
from models.tokenizer import ByteTokenizer
from tests.models.conftest import tiny_mlstm

H = 16
EVERY_PART = {"units": 8, "lr": 0.05, "bias_lr": 0.05, "out_rank": 4, "out_lr": 0.05, "decay": 0.0, "segment": 10}


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny matrices (tests/models/conftest.py)."""


def _model(seed: int = 0) -> MLSTM:
    return tiny_mlstm(seed, H)


def _stats(model: MLSTM, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stats = {f"param.{n}": 10 ** (torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 5)
             for n, p in model.named_parameters()}
    stats["adapter.h"] = 10 ** (torch.rand(H, H, generator=g, dtype=torch.float64) * 2 - 5)
    return stats


def _text(n: int, seed: int = 0, alphabet: int = 8) -> bytes:
    g = torch.Generator().manual_seed(seed)
    symbols = torch.randperm(256, generator=g)[:alphabet]
    return bytes(symbols[torch.randint(0, alphabet, (n,), generator=g)].tolist())


def _run(model: MLSTM, text: bytes, config: VariantConfig, copy: CopyModel | None = None
         ) -> tuple[np.ndarray, np.ndarray | None, VariantStream]:
    stream = VariantStream(model, config, _stats(model), copy)
    inputs, targets = ByteTokenizer().stream(text, None, torch.device("cpu"))
    net, mixed = stream.run(inputs, targets)
    return net.numpy(), None if mixed is None else mixed.numpy(), stream


def test_the_session_settings_score_as_the_engine_does() -> None:
    """The M-only variant is the served session: the same log-probs as `evaluate` in sparse mode (the engine's
    batched step), and with every rate 0 the static model's."""
    model, text = _model(), _text(120, seed=3)
    cfg = DynEvalConfig(mode="sparse", rule="rms_decay", lr=0.02, decay=0.01, eps=1e-6, segment=10, adapter_units=12)
    ref = evaluate(model, text, cfg, stats=_stats(model))
    net, _, stream = _run(model, text, VariantConfig.from_session(cfg))
    np.testing.assert_allclose(net, ref.logprobs, rtol=0, atol=1e-10)
    assert stream.updates == 12 and float(stream.params["M.h"].abs().max()) > 0
    static = evaluate(model, text, DynEvalConfig(mode="static"))
    frozen, _, _ = _run(model, text, VariantConfig(units=0, bias_lr=0.0, segment=10))
    np.testing.assert_allclose(frozen, static.logprobs, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("early", "mixed_loss"), [(0.0, False), (3.0, False), (0.0, True)])
def test_no_byte_is_scored_after_learning_from_itself_or_later_bytes(early: float, mixed_loss: bool) -> None:
    """A change at byte 35 (inside the fourth segment) leaves the scores of bytes 0..34 and the whole distribution at
    byte 35 alone, with every part adapting at large rates; the network's scores and the copy model's mixture alike."""
    model = _model()
    a = _text(80, seed=2)
    b = a[:35] + _text(45, seed=9)
    assert a[35] != b[35]
    rate = 0.05 / (1 + early)  # as large at the start either way
    cfg = VariantConfig(**{**EVERY_PART, "lr": rate, "bias_lr": rate, "out_lr": rate},  # type: ignore[arg-type]
                        early=early, mixed_loss=mixed_loss)
    copy = CopyModel(CopyConfig(), 256)
    net_a, mix_a, stream = _run(model, a, cfg, copy)
    net_b, mix_b, _ = _run(model, b, cfg, copy)
    assert stream.updates == 8 and stream.resets == 0
    np.testing.assert_array_equal(net_a[:35], net_b[:35])
    assert mix_a is not None and mix_b is not None
    np.testing.assert_array_equal(mix_a[:35], mix_b[:35])
    assert not np.allclose(net_a[36:], net_b[36:])  # the comparison can see a change
    # byte 35 itself: its distribution must be the one every continuation of the prefix gets
    stream_a = VariantStream(model, cfg, _stats(model), copy)
    ins, outs = ByteTokenizer().stream(a, None, torch.device("cpu"))
    for i in range(0, 30, 10):
        stream_a.step(ins[None, i : i + 10], outs[None, i : i + 10])
    p_a = math.exp(float(net_a[35]))
    log_dist, _, _, _ = stream_a._score(ins[None, 30:36], outs[None, 30:36])
    assert p_a == pytest.approx(math.exp(float(log_dist[0, 5, a[35]])), rel=1e-9)
    assert math.exp(float(net_b[35])) == pytest.approx(math.exp(float(log_dist[0, 5, b[35]])), rel=1e-9)


def test_the_divergence_guard_holds_for_every_part() -> None:
    """Rates far too large on random text: the parts' scores blow up, are reset to the shipped weights and the segment
    scored again, so the text stays scored like a model's; at a sane rate the guard never fires."""
    model = _model()
    text = _text(400, seed=5, alphabet=64)
    static, _, _ = _run(model, text, VariantConfig(units=0, segment=10))
    static_bits = -static.sum() / math.log(2) / len(text)
    for wild in ({"units": 0, "bias_lr": 1e4}, {"units": 0, "out_rank": 4, "out_lr": 1e4},
                 {**EVERY_PART, "lr": 1e4, "bias_lr": 1e4, "out_lr": 1e4}):
        net, _, stream = _run(model, text, VariantConfig(**{"segment": 10, **wild}))  # type: ignore[arg-type]
        bits = -net.sum() / math.log(2) / len(text)
        assert stream.resets > 0, wild
        assert np.isfinite(net).all() and bits < DIVERGED_BITS and bits < 3 * static_bits, wild
    _, _, calm = _run(model, text, VariantConfig(**EVERY_PART))  # type: ignore[arg-type]
    assert calm.resets == 0 and calm.dropped == 0


def test_the_output_parts_learn_a_repeated_text() -> None:
    """The output bias and the low-rank output update alone (no M) lower the loss on a text that repeats, each starting
    at the static model's scores, and the decay pulls them back to the shipped weights."""
    model = _model()
    text = _text(40, seed=4, alphabet=6) * 6
    static, _, _ = _run(model, text, VariantConfig(units=0, segment=10))
    for part in ({"bias_lr": 0.02}, {"out_rank": 4, "out_lr": 0.02}):
        net, _, stream = _run(model, text, VariantConfig(units=0, segment=10, decay=0.0, **part))  # type: ignore[arg-type]
        np.testing.assert_allclose(net[:10], static[:10], rtol=0, atol=1e-12)  # nothing learned before the first step
        assert net[-80:].sum() > static[-80:].sum() + 5.0, part  # more than 5 nats better over the last 80 bytes
        assert set(stream.params) == ({"bias"} if "bias_lr" in part else {"B"})
        decayed, _, stream2 = _run(model, text, VariantConfig(units=0, segment=10, decay=0.5, **part))  # type: ignore[arg-type]
        size = float(next(iter(stream.params.values())).abs().sum())
        assert float(next(iter(stream2.params.values())).abs().sum()) < 0.5 * size


def test_bad_settings_are_refused() -> None:
    for bad in ({"lr": -1.0}, {"decay": 2.0}, {"segment": 0}, {"units": 1.5}, {"out_rank": 4}, {"eps": float("nan")}):
        with pytest.raises(ValueError):
            VariantConfig(**bad)
    assert VariantConfig(units=256, bias_lr=1.0, out_rank=32, out_lr=1.0).state_bytes(768, 256) == \
        4 * (256 * 256 + 256 + 256 * 32)


def test_learning_from_the_mixture_weighs_bytes_by_what_the_copy_model_misses() -> None:
    """With `mixed_loss` the parts learn from the network mixed with the copy model: on a text that repeats exactly, the
    copy model predicts the repeats and the adapter learns less from them than from its own loss; without a copy model
    the mixture is the network and the two losses are one."""
    model = _model()
    text = _text(50, seed=6, alphabet=6) * 4
    copy = CopyModel(CopyConfig(), 256)
    cfg = VariantConfig(**EVERY_PART)  # type: ignore[arg-type]
    mixed_cfg = VariantConfig(**EVERY_PART, mixed_loss=True)  # type: ignore[arg-type]
    _, _, own = _run(model, text, cfg, copy)
    _, _, mixed = _run(model, text, mixed_cfg, copy)
    assert float(mixed.params["M.h"].norm()) < 0.9 * float(own.params["M.h"].norm())
    alone, _, _ = _run(model, text, cfg)
    alone_mixed, _, _ = _run(model, text, mixed_cfg)
    np.testing.assert_allclose(alone_mixed, alone, rtol=0, atol=1e-12)


def test_the_whole_output_matrix_is_its_own_update() -> None:
    """out_rank = the output layer's input size adapts W itself (no projection): its first step is the RMS rule's step
    on the output matrix's gradient, sum over the segment of (p - onehot) h'^T."""
    model = _model()
    text = _text(10, seed=7)
    cfg = VariantConfig(units=0, out_rank=H, out_lr=0.01, decay=0.0, segment=10)
    stream = VariantStream(model, cfg, _stats(model))
    inputs, targets = ByteTokenizer().stream(text, None, torch.device("cpu"))
    stream.step(inputs[None], targets[None])
    with torch.no_grad():
        out = model(inputs[None], model.init_state(1))
        grad = ((out.logits.softmax(-1) - torch.nn.functional.one_hot(targets[None], 256)).transpose(1, 2)
                @ out.hidden)[0] / 10  # (V, H), of the segment's mean loss
    v, g = model.head.v, model.head.g
    assert g is not None
    ms_w = _stats(model)["param.head.v"] * ((v.norm(dim=1) / g) ** 2).unsqueeze(1)
    torch.testing.assert_close(stream.params["B"], -0.01 * grad / (ms_w.sqrt() + cfg.eps), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="exceeds"):
        VariantStream(model, VariantConfig(units=0, out_rank=H + 1, out_lr=0.01), _stats(model))


def test_turning_the_output_rows_is_full_dynamic_evaluation_of_their_direction() -> None:
    """out_norm with the whole matrix adapts v of W = g v / |v| (row norms kept): the same scores as full dynamic
    evaluation of `head.v` alone, with the same rule and rates."""
    model = _model()
    text = _text(60, seed=8)
    full = DynEvalConfig(mode="full", rule="rms_decay", lr=0.01, decay=0.05, eps=1e-6, segment=10, params=("head.v",))
    ref = evaluate(model, text, full, stats=_stats(model))
    cfg = VariantConfig(units=0, out_rank=H, out_lr=0.01, decay=0.05, eps=1e-6, segment=10, out_norm=True)
    net, _, stream = _run(model, text, cfg)
    np.testing.assert_allclose(net, ref.logprobs, rtol=0, atol=1e-9)
    assert float(stream.params["B"].abs().max()) > 1e-3
    low, _, _ = _run(model, text, VariantConfig(units=0, out_rank=4, out_lr=0.01, segment=10, out_norm=True))
    assert np.isfinite(low).all() and not np.allclose(low, net)
