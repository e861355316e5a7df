"""kernels.adapted_mlstm: the hand-written backward against plain autograd (float64, small odd shapes)."""

from __future__ import annotations

import pytest
import torch

from kernels.adapted_mlstm import adapted_mlstm, adapted_mlstm_ref
from models.base import Adapter
from models.mlstm import MLSTM, MLSTMConfig

B, T, H = 3, 7, 12


def _inputs(k: int, seed: int = 0, steps: int = T) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g, dtype=torch.float64)

    return {"mx": r(B, steps, H), "zx": r(B, steps, 4 * H), "h0": r(B, H, scale=0.5), "c0": r(B, H),
            "w_mh": r(H, H, scale=0.4), "w_m": r(4 * H, H, scale=0.4), "m": r(B, k, k, scale=0.2)}


def _loss(hs: torch.Tensor, h: torch.Tensor, c: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Uses every output, non-linearly, so each gradient path (direct, through time, final state) counts."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (hs, h, c)]
    return (hs * w[0]).sum() + (hs ** 2).sum() + (h * w[1]).sum() + (c * w[2]).sum()


@pytest.mark.parametrize(("k", "steps"), [(5, T), (H, T), (5, 1)])
def test_gradients_match_plain_autograd(k: int, steps: int) -> None:
    x = _inputs(k, steps=steps)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("h0", "c0", "m")}
    fast = adapted_mlstm(**{**x, **leaves})
    ref_leaves = {n: x[n].clone().requires_grad_(True) for n in ("h0", "c0", "m")}
    ref = adapted_mlstm_ref(**{**x, **ref_leaves})
    for a, b in zip(fast, ref, strict=True):
        assert torch.equal(a, b)  # the forward is the plain path's arithmetic, op for op
    got = torch.autograd.grad(_loss(*fast), list(leaves.values()))
    want = torch.autograd.grad(_loss(*ref), list(ref_leaves.values()))
    for a, b in zip(got, want, strict=True):
        assert b.abs().max() > 1e-3  # a real gradient
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_gradient_of_m_alone_and_of_hs_alone() -> None:
    x = _inputs(8, seed=2)
    m = x["m"].clone().requires_grad_(True)
    hs, _, _ = adapted_mlstm(**{**x, "m": m})
    (got,) = torch.autograd.grad(hs.sum(), [m])  # final state unused: its gradients are None
    m2 = x["m"].clone().requires_grad_(True)
    (want,) = torch.autograd.grad(adapted_mlstm_ref(**{**x, "m": m2})[0].sum(), [m2])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("leaf", ["h0", "c0"])
def test_gradient_of_one_initial_state_tensor(leaf: str) -> None:
    # the backward skips step 0's matmuls when h0 needs no gradient: each state tensor alone must still be right
    x = _inputs(7, seed=4)
    got_leaves = {leaf: x[leaf].clone().requires_grad_(True), "m": x["m"].clone().requires_grad_(True)}
    want_leaves = {leaf: x[leaf].clone().requires_grad_(True), "m": x["m"].clone().requires_grad_(True)}
    got = torch.autograd.grad(_loss(*adapted_mlstm(**{**x, **got_leaves})), list(got_leaves.values()))
    want = torch.autograd.grad(_loss(*adapted_mlstm_ref(**{**x, **want_leaves})), list(want_leaves.values()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_chained_calls_carry_the_gradient_through_the_state() -> None:
    # forward_rows splits a batch at row lengths: the second call's h0, c0 are the first call's outputs
    x = _inputs(6, seed=3)
    m = x["m"].clone().requires_grad_(True)
    first = adapted_mlstm(x["mx"][:, :3], x["zx"][:, :3], x["h0"], x["c0"], x["w_mh"], x["w_m"], m)
    second = adapted_mlstm(x["mx"][:, 3:], x["zx"][:, 3:], first[1], first[2], x["w_mh"], x["w_m"], m)
    (got,) = torch.autograd.grad(_loss(torch.cat([first[0], second[0]], 1), second[1], second[2]), [m])
    m2 = x["m"].clone().requires_grad_(True)
    (want,) = torch.autograd.grad(_loss(*adapted_mlstm_ref(**{**x, "m": m2})), [m2])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_weights_that_need_gradients_are_refused() -> None:
    x = _inputs(4)
    with pytest.raises(ValueError, match="adapted_mlstm_ref"):
        adapted_mlstm(**{**x, "w_m": x["w_m"].requires_grad_(True)})
    with pytest.raises(ValueError, match="shapes"):
        adapted_mlstm(**{**x, "m": torch.zeros(B, H + 1, H + 1, dtype=torch.float64)})


def test_model_uses_it_when_the_weights_are_frozen() -> None:
    """MLSTM.forward with frozen weights takes the kernel; same logits and dL/dM as the plain autograd path."""
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=H, embed_dim=8, dropout_hidden=0.0)).double().eval()
    tokens = torch.randint(0, 256, (B, T))
    m0 = 0.1 * torch.randn(B, 9, 9, dtype=torch.float64)

    def run() -> tuple[torch.Tensor, torch.Tensor, str]:
        m = m0.clone().requires_grad_(True)
        out = model(tokens, model.init_state(B), Adapter({"h": m}))
        assert out.hidden is not None
        (grad,) = torch.autograd.grad(torch.log_softmax(out.logits, -1)[..., 7].sum(), [m])
        return out.logits.detach(), grad, type(out.hidden.grad_fn).__name__

    plain_logits, plain_grad, plain_node = run()
    model.freeze()
    fast_logits, fast_grad, fast_node = run()
    assert plain_node != fast_node == "_AdaptedMLSTMBackward"
    # frozen weights also look the input projections up (MLSTM._input_tables): equal up to summation order
    torch.testing.assert_close(fast_logits, plain_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast_grad, plain_grad, rtol=0, atol=1e-10)
