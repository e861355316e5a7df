"""Dynamic evaluation (full and sparse): no peeking, the update rules, batching, the guard, learning.

Tiny float64 models; the references are hand-rolled loops written here, not the module's code.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import string
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.adaptation import (
    DIVERGED_BITS,
    CacheConfig,
    DynEvalConfig,
    UpdateRule,
    adapted_parameter_names,
    evaluate,
    evaluate_many,
    score_step,
    sparse_step,
    split_documents,
)
from models.base import Adapter, State
from models.checkpoint import load_checkpoint, save_checkpoint
from models.mlstm import MLSTM, MLSTMConfig
from models.scoring import BOS, score_bytes
from trainer.evaluation import config_for

H = 16
RULES = ["sgd", "sgd_decay", "rms", "rms_decay"]
Update = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _model(seed: int = 0, hidden: int = H, embed_std: float = 0.1) -> MLSTM:
    torch.manual_seed(seed)
    model = MLSTM(MLSTMConfig(hidden=hidden, embed_dim=8, dropout_hidden=0.0)).double().eval()
    with torch.no_grad():
        model.embed.weight.normal_(0, embed_std)
    return model


def _text(n: int, seed: int = 0, alphabet: int = 256) -> bytes:
    g = torch.Generator().manual_seed(seed)
    symbols = torch.randperm(256, generator=g)[:alphabet]
    return bytes(symbols[torch.randint(0, alphabet, (n,), generator=g)].tolist())


def _stats(model: MLSTM, seed: int = 1) -> dict[str, torch.Tensor]:
    """Synthetic MS_g spread over four decades, so RMSnorm varies (and clips for large decay)."""
    g = torch.Generator().manual_seed(seed)
    stats = {f"param.{n}": 10 ** (torch.rand(p.shape, generator=g, dtype=torch.float64) * 4 - 6)
             for n, p in model.named_parameters()}
    H_ = model.config.hidden
    stats["adapter.h"] = 10 ** (torch.rand(H_, H_, generator=g, dtype=torch.float64) * 4 - 6)
    return stats


def _hand_rule(rule: str, lr: float, lam: float, eps: float, ms_g: dict[str, torch.Tensor]) -> Update:
    """The four rules written out (thesis eq. 4.3, 4.5, 4.7; RMSnorm eq. 4.6 over every adapted element)."""
    rms = {n: v.sqrt() for n, v in ms_g.items()}
    mean_rms = torch.cat([r.flatten() for r in rms.values()]).mean() if rms else torch.tensor(1.0)

    def update(name: str, theta: torch.Tensor, grad: torch.Tensor, theta_g: torch.Tensor) -> torch.Tensor:
        if rule == "sgd":
            return theta - lr * grad
        if rule == "sgd_decay":
            return theta - lr * grad + lam * (theta_g - theta)
        if rule == "rms":
            return theta - lr * grad / (rms[name] + eps) + lam * (theta_g - theta)
        rmsnorm = torch.clamp(rms[name] / mean_rms, max=1.0 / lam)
        return theta - lr * grad / (rms[name] + eps) + lam * rmsnorm * (theta_g - theta)

    return update


def _io(text: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(list(text))
    return torch.cat([torch.tensor([BOS]), ids[:-1]]), ids


def _hand_full(model: MLSTM, text: bytes, n: int, update: Update, *,
               peek: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full dynamic evaluation on a deep copy: score a segment under no_grad, then update on it."""
    m = copy.deepcopy(model)
    theta_g = {k: p.detach().clone() for k, p in model.named_parameters()}
    inputs, targets = _io(text)
    state, lps = m.init_state(1), []

    def step(x: torch.Tensor, y: torch.Tensor, state: State) -> None:
        out = m(x, state)
        params = dict(m.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(out.logits[0], y[0]), list(params.values()))
        with torch.no_grad():
            for (k, p), grad in zip(params.items(), grads, strict=True):
                p.copy_(update(k, p, grad, theta_g[k]))

    for s in range(0, len(text), n):
        x, y = inputs[None, s : s + n], targets[None, s : s + n]
        if peek:  # the leak the tests must catch: update on the segment, then score it
            step(x, y, state)
        with torch.no_grad():
            out = m(x, state)
            lps.append(torch.log_softmax(out.logits[0], -1).gather(-1, y[0, :, None])[:, 0])
        if not peek:
            step(x, y, state)
        state = out.state
    return torch.cat(lps), {k: p.detach() for k, p in m.named_parameters()}


def _hand_sparse(model: MLSTM, text: bytes, n: int, k: int, update: Update) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = _io(text)
    M = torch.zeros(1, k, k, dtype=torch.float64)
    state, lps = model.init_state(1), []
    for s in range(0, len(text), n):
        x, y = inputs[None, s : s + n], targets[None, s : s + n]
        with torch.no_grad():
            out = model(x, state, Adapter({"h": M}))
            lps.append(torch.log_softmax(out.logits[0], -1).gather(-1, y[0, :, None])[:, 0])
        leaf = M.clone().requires_grad_(True)
        loss = F.cross_entropy(model(x, state, Adapter({"h": leaf})).logits[0], y[0])
        (grad,) = torch.autograd.grad(loss, [leaf])
        M = update("h", M, grad, torch.zeros_like(M))
        state = out.state
    return torch.cat(lps), M[0]


# -- static ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_static_equals_score_bytes(dtype: torch.dtype) -> None:
    model = _model().to(dtype)
    text = _text(700, seed=3)
    res = evaluate(model, text, DynEvalConfig(mode="static"))
    ref = score_bytes(model, text, logprobs=True)
    assert res.bits == pytest.approx(ref.bits, rel=1e-5)
    assert res.bytes == ref.bytes == len(text)
    assert res.bits_per_byte == pytest.approx(res.bits / res.bytes)
    np.testing.assert_allclose(res.logprobs, np.array(ref.logprobs), rtol=1e-5, atol=1e-6)
    assert res.params_adapted == res.state_bytes == 0


# -- no peeking --------------------------------------------------------------------------------------


def test_full_scores_each_segment_before_its_update() -> None:
    model = _model(embed_std=1.0)
    text, n, lr = _text(100, seed=1, alphabet=8), 10, 0.5
    res = evaluate(model, text, DynEvalConfig(mode="full", rule="sgd", lr=lr, segment=n))
    ref, _ = _hand_full(model, text, n, _hand_rule("sgd", lr, 0.0, 0.0, {}))
    np.testing.assert_allclose(res.logprobs, ref.numpy(), rtol=0, atol=1e-10)
    leaked, _ = _hand_full(model, text, n, _hand_rule("sgd", lr, 0.0, 0.0, {}), peek=True)
    assert np.abs(res.logprobs - leaked.numpy()).max() > 1e-3  # the comparison can see a leak
    static = evaluate(model, text, DynEvalConfig(mode="static"))
    np.testing.assert_allclose(res.logprobs[:n], static.logprobs[:n], rtol=0, atol=1e-12)  # no update yet


def test_sparse_scores_each_segment_before_its_update() -> None:
    model = _model(embed_std=1.0)
    text, n, lr = _text(100, seed=1, alphabet=8), 10, 2.0
    res = evaluate(model, text, DynEvalConfig(mode="sparse", rule="sgd", lr=lr, segment=n))
    ref, M = _hand_sparse(model, text, n, H, _hand_rule("sgd", lr, 0.0, 0.0, {}))
    np.testing.assert_allclose(res.logprobs, ref.numpy(), rtol=0, atol=1e-10)
    torch.testing.assert_close(res.adapted["h"], M, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_later_bytes_never_change_earlier_scores(mode: str) -> None:
    # causality through the updates: a change at byte 35 (inside segment 3) leaves bytes 0..34 alone
    model = _model(embed_std=1.0)
    a = _text(80, seed=2)
    b = a[:35] + _text(45, seed=9)
    cfg = DynEvalConfig(mode=mode, rule="sgd", lr=1.0, segment=10)
    ra, rb = evaluate(model, a, cfg), evaluate(model, b, cfg)
    np.testing.assert_array_equal(ra.logprobs[:35], rb.logprobs[:35])
    assert not np.allclose(ra.logprobs[35:], rb.logprobs[35:])


# -- update rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "expected"), [
    ("sgd", [0.95, -1.02]),
    ("sgd_decay", [0.77, -0.57]),
    ("rms", [0.57, -0.60]),
    ("rms_decay", [0.63, -0.55]),  # RMSnorm = [2/3, 4/3] clipped to [2/3, 1/0.9]
])
def test_one_step_by_hand(rule: str, expected: list[float]) -> None:
    theta = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    grad = {"w": torch.tensor([0.5, 0.2], dtype=torch.float64)}
    start = {"w": torch.tensor([0.8, -0.5], dtype=torch.float64)}
    ms_g = {"w": torch.tensor([0.04, 0.16], dtype=torch.float64)}
    rule_ = UpdateRule(DynEvalConfig(rule=rule, lr=0.1, decay=0.9, eps=0.0), ["w"], ms_g)
    new = rule_.step(theta, grad, start)["w"]
    torch.testing.assert_close(new, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", RULES)
def test_one_step_matches_formula_on_model_tensors(rule: str) -> None:
    model = _model()
    stats = _stats(model)
    g = torch.Generator().manual_seed(5)
    theta = {n: p.detach() + 0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype)
             for n, p in model.named_parameters()}
    grads = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in theta.items()}
    start = {n: p.detach() for n, p in model.named_parameters()}
    ms_g = {n: stats[f"param.{n}"] for n in theta}
    cfg = DynEvalConfig(rule=rule, lr=1e-3, decay=0.3, eps=1e-3)
    new = UpdateRule(cfg, list(theta), ms_g).step(theta, grads, start)
    hand = _hand_rule(rule, 1e-3, 0.3, 1e-3, ms_g)
    for n in theta:
        torch.testing.assert_close(new[n], hand(n, theta[n], grads[n], start[n]), rtol=1e-12, atol=1e-14)
    if rule == "rms_decay":  # the clip at 1/lambda is exercised
        mean = torch.cat([v.sqrt().flatten() for v in ms_g.values()]).mean()
        assert any(bool((v.sqrt() / mean > 1 / 0.3).any()) for v in ms_g.values())


@pytest.mark.parametrize("rule", RULES)
def test_full_rules_over_several_steps(rule: str) -> None:
    model = _model(embed_std=1.0)
    stats = _stats(model)
    text, n = _text(60, seed=4, alphabet=8), 12
    cfg = DynEvalConfig(mode="full", rule=rule, lr=1e-3, decay=0.3, eps=1e-3, segment=n)
    res = evaluate(model, text, cfg, stats=stats)
    ms_g = {k: stats[f"param.{k}"] for k, _ in model.named_parameters()}
    ref, params = _hand_full(model, text, n, _hand_rule(rule, 1e-3, 0.3, 1e-3, ms_g))
    np.testing.assert_allclose(res.logprobs, ref.numpy(), rtol=0, atol=1e-10)
    assert set(res.adapted) == set(params)
    for k, p in params.items():
        torch.testing.assert_close(res.adapted[k], p, rtol=1e-10, atol=1e-12)
    assert res.params_adapted == sum(p.numel() for p in model.parameters())
    assert res.state_bytes == 8 * res.params_adapted


@pytest.mark.parametrize("rule", RULES)
def test_sparse_rules_over_several_steps(rule: str) -> None:
    model = _model(embed_std=1.0)
    stats = _stats(model)
    text, n, k = _text(60, seed=4, alphabet=8), 12, 8
    cfg = DynEvalConfig(mode="sparse", rule=rule, lr=1e-3, decay=0.3, eps=1e-3, segment=n, adapter_units=k)
    res = evaluate(model, text, cfg, stats=stats)
    ms_g = {"h": stats["adapter.h"][:k, :k]}  # a k-unit adapter uses the top-left block
    ref, M = _hand_sparse(model, text, n, k, _hand_rule(rule, 1e-3, 0.3, 1e-3, ms_g))
    np.testing.assert_allclose(res.logprobs, ref.numpy(), rtol=0, atol=1e-10)
    torch.testing.assert_close(res.adapted["h"], M, rtol=1e-10, atol=1e-12)
    assert res.params_adapted == k * k and res.state_bytes == 8 * k * k


def test_rms_rules_need_statistics() -> None:
    with pytest.raises(ValueError, match="MS_g"):
        evaluate(_model(), b"abc", DynEvalConfig(mode="full", rule="rms"))
    with pytest.raises(ValueError, match="MS_g"):
        evaluate(_model(), b"abc", DynEvalConfig(mode="sparse", rule="rms_decay"), stats={})


def test_sparse_with_zero_lr_equals_static() -> None:
    model = _model()
    text = _text(300, seed=6)
    static = evaluate(model, text, DynEvalConfig(mode="static"))
    sparse = evaluate(model, text, DynEvalConfig(mode="sparse", lr=0.0), stats=_stats(model))
    np.testing.assert_array_equal(sparse.logprobs, static.logprobs)  # M = 0 is bit-identical to no adapter
    assert torch.count_nonzero(sparse.adapted["h"]) == 0


@pytest.mark.parametrize("rule", ["sgd_decay", "rms", "rms_decay"])
def test_decay_alone_pulls_back_to_the_start(rule: str) -> None:
    model = _model()
    stats = _stats(model)
    names = [n for n, _ in model.named_parameters()]
    ms_g = {n: stats[f"param.{n}"] for n in names}
    start = {n: p.detach() for n, p in model.named_parameters()}
    theta = {n: p + 0.1 for n, p in start.items()}
    zero = {n: torch.zeros_like(p) for n, p in start.items()}
    r = UpdateRule(DynEvalConfig(rule=rule, decay=0.3), names, ms_g)
    for _ in range(3):
        new = r.step(theta, zero, start)
        for n in names:
            before, after = (theta[n] - start[n]).abs(), (new[n] - start[n]).abs()
            assert bool((after <= before).all()) and float(after.sum()) < float(before.sum())
        theta = new
    m_rule = UpdateRule(DynEvalConfig(rule=rule, decay=0.3), ["h"], {"h": stats["adapter.h"]})
    M = {"h": torch.full((2, H, H), 0.5, dtype=torch.float64)}
    M2 = m_rule.step(M, {"h": torch.zeros_like(M["h"])})  # theta_g = 0 for adapters
    assert float(M2["h"].abs().sum()) < float(M["h"].abs().sum())


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_decay_keeps_adaptation_closer_to_the_start(mode: str) -> None:
    model = _model(embed_std=1.0)
    text = _text(200, seed=7, alphabet=8)
    runs = [evaluate(model, text, DynEvalConfig(mode=mode, rule=rule, lr=0.5, decay=0.2, segment=10))
            for rule in ("sgd", "sgd_decay")]
    start = dict(model.named_parameters()) if mode == "full" else {"h": torch.zeros(H, H, dtype=torch.float64)}

    def distance(adapted: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float(((adapted[k] - start[k].detach()) ** 2).sum()) for k in adapted))

    assert distance(runs[1].adapted) < 0.7 * distance(runs[0].adapted)


# -- batching, documents, the guard ---------------------------------------------------------------


@pytest.mark.parametrize("cache", [None, CacheConfig(window=30, theta=2.0, lam=0.2)])
def test_batched_sparse_equals_separate_runs(cache: CacheConfig | None) -> None:
    model = _model(embed_std=1.0)
    stats = _stats(model)
    texts = [_text(137, 1, 8), _text(60, 2), _text(251, 3, 16), _text(20, 4), _text(1, 5), _text(75, 6, 8)]
    cfg = DynEvalConfig(mode="sparse", rule="rms_decay", lr=1e-3, decay=0.01, eps=1e-3, segment=20,
                        adapter_units=12, cache=cache)
    batched = evaluate_many(model, texts, cfg, stats=stats, max_streams=4)
    for text, res in zip(texts, batched, strict=True):
        alone = evaluate(model, text, cfg, stats=stats)
        assert res.bytes == len(text)
        np.testing.assert_allclose(res.logprobs, alone.logprobs, rtol=1e-5, atol=1e-10)
        assert res.bits == pytest.approx(alone.bits, rel=1e-5)
        torch.testing.assert_close(res.adapted["h"], alone.adapted["h"], rtol=1e-5, atol=1e-10)
        assert res.state is not None and alone.state is not None
        for key, value in res.state.tensors.items():
            torch.testing.assert_close(value, alone.state.tensors[key], rtol=1e-5, atol=1e-10)


def test_batched_static_equals_separate_runs() -> None:
    model = _model()
    texts = [_text(1500, 1), _text(30, 2), _text(1100, 3)]
    for text, res in zip(texts, evaluate_many(model, texts, DynEvalConfig(mode="static")), strict=True):
        np.testing.assert_allclose(res.logprobs, evaluate(model, text, DynEvalConfig(mode="static")).logprobs,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["full", "sparse"])
def test_reset_at_separator_scores_documents_afresh(mode: str) -> None:
    model = _model(embed_std=1.0)
    sep = b"\n\n"
    a, b = _text(55, 1, 8) + sep, _text(40, 2, 8)
    cfg = DynEvalConfig(mode=mode, rule="sgd", lr=0.5, segment=10)
    joined = evaluate(model, a + b, dataclasses.replace(cfg, reset=sep))
    parts = [evaluate(model, a, cfg), evaluate(model, b, cfg)]
    np.testing.assert_allclose(joined.logprobs, np.concatenate([p.logprobs for p in parts]), rtol=0, atol=1e-12)
    assert joined.bits == pytest.approx(parts[0].bits + parts[1].bits, rel=1e-12)
    assert not np.allclose(evaluate(model, a + b, cfg).logprobs, joined.logprobs)
    assert split_documents(b"x\n\ny\n\n\n\nz", sep) == [b"x\n\n", b"y\n\n", b"\n\n", b"z"]


@pytest.mark.parametrize("broken", ["adapter", "state"])
def test_sparse_step_guard_keeps_a_failing_row(broken: str) -> None:
    model = _model(embed_std=1.0)
    cfg = DynEvalConfig(mode="sparse", rule="sgd", lr=0.5)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 256, (3, 10), generator=g)
    targets = torch.randint(0, 256, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[2, 7:] = False
    state = model(inputs, model.init_state(3)).state
    mats = 0.01 * torch.randn(3, H, H, generator=g, dtype=torch.float64)
    if broken == "adapter":
        mats[1] = 1e200  # the forward stays finite, the gradient of row 1 overflows
    else:
        state.tensors["h"][1, 0] = math.inf  # the forward of row 1 turns to NaN
    step = sparse_step(model, inputs, targets, mask, state, Adapter({"h": mats}), None, cfg)
    assert step.failed.tolist() == [False, True, False]
    assert torch.equal(step.adapter.mats["h"][1], mats[1])
    for key, value in step.state.tensors.items():
        if broken == "state":  # rewound: the previous state
            assert torch.equal(value[1], state.tensors[key][1])
        else:  # the state the old M produced stands
            assert bool(torch.isfinite(value[1]).all()) and not torch.equal(value[1], state.tensors[key][1])
    keep = torch.tensor([0, 2])
    ref = sparse_step(model, inputs[keep], targets[keep], mask[keep], state.select(keep), Adapter({"h": mats[keep]}),
                      None, cfg)
    assert not ref.failed.any()
    torch.testing.assert_close(step.adapter.mats["h"][keep], ref.adapter.mats["h"], rtol=0, atol=1e-12)
    torch.testing.assert_close(step.logprobs[keep], ref.logprobs, rtol=0, atol=1e-12)
    assert not torch.equal(step.adapter.mats["h"][0], mats[0])  # healthy rows did update
    for key, value in step.state.tensors.items():
        torch.testing.assert_close(value[keep], ref.state.tensors[key], rtol=0, atol=1e-12)


def test_sparse_step_row_without_tokens_is_untouched_and_padding_ends_its_state() -> None:
    model = _model(embed_std=1.0)
    cfg = DynEvalConfig(mode="sparse", rule="sgd_decay", lr=0.5, decay=0.1)
    inputs = torch.randint(0, 256, (2, 8))
    mask = torch.tensor([[True] * 5 + [False] * 3, [False] * 8])
    mats = torch.full((2, H, H), 0.01, dtype=torch.float64)
    state = model.init_state(2)
    step = sparse_step(model, inputs, inputs, mask, state, Adapter({"h": mats}), None, cfg)
    assert torch.equal(step.adapter.mats["h"][1], mats[1])  # no tokens: no step, not even decay
    short = model(inputs[:1, :5], model.init_state(1), Adapter({"h": mats[:1]})).state
    for key, value in step.state.tensors.items():
        torch.testing.assert_close(value[0], short.tensors[key][0], rtol=0, atol=1e-12)
        assert torch.equal(value[1], state.tensors[key][1])
    with pytest.raises(ValueError, match="prefix"):
        sparse_step(model, inputs, inputs, mask.flip(1), state, Adapter({"h": mats}), None, cfg)


def test_sparse_step_rows_of_different_lengths_match_plain_autograd() -> None:
    """Each row's update equals a plain-autograd step on that row alone (the weights requiring grad there), though
    sparse_step freezes the weights, cuts the batch at each row length and runs the hand-written backward; the
    weights require grad again afterwards."""
    model = _model(embed_std=1.0)
    g = torch.Generator().manual_seed(7)
    lengths = [9, 4, 6]
    inputs = torch.randint(0, 256, (3, 9), generator=g)
    targets = torch.randint(0, 256, (3, 9), generator=g)
    mask = torch.arange(9).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    state = model(inputs, model.init_state(3)).state
    mats = 0.05 * torch.randn(3, H, H, generator=g, dtype=torch.float64)
    lr = 0.5
    step = sparse_step(model, inputs, targets, mask, state, Adapter({"h": mats}), None,
                       DynEvalConfig(mode="sparse", rule="sgd", lr=lr))
    assert all(p.requires_grad for p in model.parameters())
    for b, n in enumerate(lengths):
        leaf = mats[b : b + 1].clone().requires_grad_(True)
        out = model(inputs[b : b + 1, :n], state.select(b), Adapter({"h": leaf}))
        (grad,) = torch.autograd.grad(F.cross_entropy(out.logits[0], targets[b, :n]), [leaf])
        torch.testing.assert_close(step.adapter.mats["h"][b], (mats[b] - lr * grad[0]), rtol=0, atol=1e-10)
        for key, value in out.state.tensors.items():
            torch.testing.assert_close(step.state.tensors[key][b], value[0].detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("rule", RULES)
def test_stacked_rule_steps_each_row_like_its_own_rule(rule: str) -> None:
    """Rows of different adapter sizes, learning rates and decays in one padded batch (the server's case)."""
    model = _model()
    stats = _stats(model)
    g = torch.Generator().manual_seed(5)
    sizes, lrs, decays = [4, 16, 9], [0.1, 0.02, 0.5], [0.01, 0.2, 0.0]
    rules = [UpdateRule(DynEvalConfig(mode="sparse", rule=rule, lr=lr, decay=lam), ["h"],
                        {"h": stats["adapter.h"][:k, :k]}) for k, lr, lam in zip(sizes, lrs, decays, strict=True)]
    K = max(sizes)
    theta = torch.zeros(4, K, K, dtype=torch.float64)
    grads = torch.randn(4, K, K, generator=g, dtype=torch.float64)
    for b, k in enumerate(sizes):
        theta[b, :k, :k] = torch.randn(k, k, generator=g, dtype=torch.float64)
    theta[3] = torch.randn(K, K, generator=g, dtype=torch.float64)  # a fixed row
    rows = [(r, {"h": (k, k)}) for r, k in zip(rules, sizes, strict=True)] + [None]
    stacked = UpdateRule.stack(rows, {"h": (K, K)}, dtype=torch.float64)
    out = stacked.step({"h": theta}, {"h": grads})["h"]
    for b, (r, k) in enumerate(zip(rules, sizes, strict=True)):
        own = r.step({"h": theta[b : b + 1, :k, :k]}, {"h": grads[b : b + 1, :k, :k]})["h"][0]
        torch.testing.assert_close(out[b, :k, :k], own, rtol=1e-12, atol=1e-15)
        assert not out[b, k:].any() and not out[b, :, k:].any()  # padding stays zero
    assert torch.equal(out[3], theta[3])


def test_score_step_equals_sparse_step_scores() -> None:
    model = _model(embed_std=1.0)
    g = torch.Generator().manual_seed(2)
    inputs = torch.randint(0, 256, (3, 9), generator=g)
    targets = torch.randint(0, 256, (3, 9), generator=g)
    mask = torch.arange(9).unsqueeze(0) < torch.tensor([[9], [4], [7]])
    state = model(inputs, model.init_state(3)).state
    mats = 0.05 * torch.randn(3, H, H, generator=g, dtype=torch.float64)
    cfg = DynEvalConfig(mode="sparse", rule="sgd", lr=0.5)
    ref = sparse_step(model, inputs, targets, mask, state, Adapter({"h": mats}), None, cfg)
    got = score_step(model, inputs, targets, mask, state, Adapter({"h": mats}))
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-12)
    for key, value in got.state.tensors.items():
        torch.testing.assert_close(value, ref.state.tensors[key], rtol=0, atol=1e-12)
    plain = score_step(model, inputs, targets, mask, state)
    zero = score_step(model, inputs, targets, mask, state, Adapter({"h": torch.zeros_like(mats)}))
    assert torch.equal(plain.logprobs, zero.logprobs)


def test_full_guard_drops_non_finite_updates() -> None:
    model = _model()
    stats = _stats(model)
    stats["param.head.bias"] = torch.zeros(256, dtype=torch.float64)  # eps = 0: a step of lr / 0
    text = _text(50, 3)
    res = evaluate(model, text, DynEvalConfig(mode="full", rule="rms", eps=0.0, lr=1e-3, segment=10), stats=stats)
    assert res.skipped_updates == 5
    np.testing.assert_allclose(res.logprobs, evaluate(model, text, DynEvalConfig(mode="static")).logprobs,
                               rtol=1e-12, atol=1e-12)


# -- the model stays pristine; parameter subsets ------------------------------------------------


def test_full_mode_never_mutates_the_model() -> None:
    model = _model(embed_std=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = evaluate(model, _text(80, 1, 8), DynEvalConfig(mode="full", rule="sgd", lr=1.0, segment=10))
    assert any(not torch.equal(res.adapted[k], before[k]) for k in before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert not model.training


def test_parameter_subsets() -> None:
    model = _model(embed_std=1.0)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert adapted_parameter_names(model, DynEvalConfig(params=("w_m",))) == ["w_m.v", "w_m.g"]
    no_embed = adapted_parameter_names(model, DynEvalConfig(frozen=("embed",)))
    assert no_embed == [n for n in sizes if n != "embed.weight"]
    res = evaluate(model, _text(40, 1), DynEvalConfig(mode="full", rule="sgd", lr=0.5, frozen=("embed",)))
    assert set(res.adapted) == set(no_embed)
    assert res.params_adapted == sum(sizes.values()) - sizes["embed.weight"]
    with pytest.raises(ValueError, match="no parameter matches"):
        adapted_parameter_names(model, DynEvalConfig(params=("nope",)))


# -- learning ----------------------------------------------------------------------------------


def test_adaptation_learns_a_repeated_random_string() -> None:
    # One pass of small steps cannot memorise 256-way random bytes in a 32-unit random model, so the
    # string's bytes come from a random 8-byte alphabet: adaptation learns that, and the repeat.
    model = _model(hidden=32, embed_std=1.0)
    s = _text(400, seed=0, alphabet=8)
    text = s + s

    def second_copy_bpb(cfg: DynEvalConfig) -> float:
        return float(-evaluate(model, text, cfg).logprobs[len(s):].sum() / len(s) / math.log(2))

    static = second_copy_bpb(DynEvalConfig(mode="static"))
    full = second_copy_bpb(DynEvalConfig(mode="full", rule="sgd", lr=0.5, segment=20))
    sparse = second_copy_bpb(DynEvalConfig(mode="sparse", rule="sgd", lr=2.0, segment=10))
    assert static > 7.5
    assert full < static - 3.5, (static, full)
    assert sparse < static - 1.5, (static, sparse)


# -- config ------------------------------------------------------------------------------------


def test_config_from_dyneval_dict_and_overrides() -> None:
    saved = {"tuned": False, "rule": "rms_decay", "segment": 20, "lr": 1e-4, "decay": 0.002, "eps": 1e-8,
             "adapter_units": 64}
    cfg = DynEvalConfig.from_dict(saved, mode="sparse", lr=3e-4)
    assert (cfg.mode, cfg.rule, cfg.lr, cfg.decay, cfg.segment, cfg.adapter_units) == (
        "sparse", "rms_decay", 3e-4, 0.002, 20, 64)
    assert DynEvalConfig.from_dict({"eta": 0.1, "lambda": 0.01}).lr == 0.1
    full = DynEvalConfig(mode="full", frozen=("embed",), reset=b"\x00\n", cache=CacheConfig(100, 0.5, 0.2))
    assert DynEvalConfig.from_dict(full.to_dict()) == full
    assert DynEvalConfig.from_dict({}, reset="\n\n").reset == b"\n\n"
    with pytest.raises(ValueError, match="unknown"):
        DynEvalConfig.from_dict(saved, learning_rate=1.0)
    for bad in ({"rule": "adam"}, {"mode": "dynamic"}, {"lr": -1.0}, {"segment": 0}, {"reset": b""}):
        with pytest.raises(ValueError):
            DynEvalConfig(**bad)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    from trainer.stats import gradient_stats

    model = _model().float()
    data = (Path(__file__).resolve().parents[1] / "data" / "train.txt").read_bytes()[:4000]
    stats = gradient_stats(model, data, batches=2, batch_size=2, segment=20)
    dyneval = {"tuned": False, "rule": "rms_decay", "segment": 20, "lr": 1e-3, "decay": 0.002, "eps": 1e-8,
               "adapter_units": H}
    ck = load_checkpoint(save_checkpoint(tmp_path / "ck", model, stats=stats, dyneval=dyneval, card="# t\n"))
    text = data[:300]
    pristine = {k: v.clone() for k, v in ck.model.state_dict().items()}
    static = evaluate(ck.model, text, DynEvalConfig.from_dict(ck.dyneval, mode="static"))
    assert static.bits == pytest.approx(score_bytes(ck.model, text).bits, rel=1e-5)
    for mode, extra in (("full", {}), ("sparse", {"adapter_units": 8})):
        res = evaluate(ck.model, text, DynEvalConfig.from_dict(ck.dyneval, mode=mode, **extra), stats=ck.stats)
        assert np.isfinite(res.logprobs).all() and res.skipped_updates == 0
        assert res.bits != static.bits
    assert all(torch.equal(v, pristine[k]) for k, v in ck.model.state_dict().items())


def test_callers_under_inference_mode_still_adapt() -> None:
    model = _model(embed_std=1.0)
    text = _text(50, 1, 8)
    cfg = DynEvalConfig(mode="sparse", rule="sgd", lr=1.0, segment=10)
    outside = [evaluate(model, text, dataclasses.replace(cfg, mode=m)) for m in ("full", "sparse")]
    x = torch.randint(0, 256, (2, 6))
    mats = torch.zeros(2, H, H, dtype=torch.float64)
    ref = sparse_step(model, x, x, torch.ones(2, 6, dtype=torch.bool), model.init_state(2), Adapter({"h": mats}),
                      None, cfg)
    with torch.inference_mode():
        inside = [evaluate(model, text, dataclasses.replace(cfg, mode=m)) for m in ("full", "sparse")]
        step = sparse_step(model, x.clone(), x.clone(), torch.ones(2, 6, dtype=torch.bool), model.init_state(2),
                           Adapter({"h": mats.clone()}), None, cfg)
    for a, b in zip(outside, inside, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert torch.equal(step.adapter.mats["h"], ref.adapter.mats["h"])
    assert torch.count_nonzero(step.adapter.mats["h"]) > 0


@pytest.mark.parametrize("mode", ["sparse", "dynamic"])
def test_offline_evaluation_has_the_divergence_guard(tiny_checkpoint: Path, mode: str) -> None:
    """A learning rate far too large on random text: without the guard the adapter explodes and bits per byte run
    into the billions (finite, so no non-finite check catches it).

    sparse: offline evaluation runs the engine's step, so the diverged adapter is reset (the server's guard) and the
    text stays scored like a model, not like an explosion.
    dynamic (full mode): weights under which a segment scores worse than DIVERGED_BITS a token are put back to the
    unadapted ones and the segment scored again (the compressive checkpoint's untuned eta reached 98 bits per byte
    on C code before the guard).
    Either way, at the checkpoint's own learning rate the guard never fires."""
    ckpt = load_checkpoint(tiny_checkpoint)
    rng = random.Random(0)
    text = "".join(rng.choice(string.printable[:95]) for _ in range(600)).encode()
    static = evaluate(ckpt.model, text, DynEvalConfig(mode="static"))
    wild = evaluate(ckpt.model, text, config_for(mode, ckpt.dyneval, lr=1.0), stats=ckpt.stats)
    assert wild.adapter_resets > 0
    assert wild.bits_per_byte < DIVERGED_BITS
    assert wild.bits_per_byte < 3 * static.bits_per_byte
    calm = evaluate(ckpt.model, text, config_for(mode, ckpt.dyneval), stats=ckpt.stats)
    assert calm.adapter_resets == 0 and calm.skipped_updates == 0


def test_segment_and_adapter_units_are_whole_numbers() -> None:
    """A segment of 20.5 used to pass the checkpoint's validation and fail every text step later (a 500 each)."""
    assert DynEvalConfig.from_dict({"segment": 20.0, "adapter_units": 64.0}).segment == 20
    for bad in ({"segment": 20.5}, {"adapter_units": 1.5}, {"segment": True}):
        with pytest.raises(ValueError, match="whole number"):
            DynEvalConfig.from_dict(bad)
