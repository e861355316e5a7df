import pytest
import torch

from models.base import Adapter, State
from models.mlstm import MLSTM, MLSTMConfig, mlstm_cell


def _model(**kw: object) -> MLSTM:
    torch.manual_seed(0)
    return MLSTM(MLSTMConfig(hidden=12, embed_dim=5, **kw)).double().eval()  # type: ignore[arg-type]


def _lstm_from(w_x: torch.Tensor, b: torch.Tensor, w_m: torch.Tensor) -> torch.nn.LSTMCell:
    """nn.LSTMCell with gates (i, f, g, o) copied from our (i, f, o, u) blocks."""
    H = w_m.shape[1]
    blocks = [torch.arange(0, H), torch.arange(H, 2 * H), torch.arange(3 * H, 4 * H), torch.arange(2 * H, 3 * H)]
    order = torch.cat(blocks)
    cell = torch.nn.LSTMCell(w_x.shape[1], H).double()
    with torch.no_grad():
        cell.weight_ih.copy_(w_x[order])
        cell.bias_ih.copy_(b[order])
        cell.weight_hh.copy_(w_m[order])
        cell.bias_hh.zero_()
    return cell


def test_cell_reduces_to_lstm_in_closed_form_case() -> None:
    # thesis ch. 3 (docs/algorithms.md §1): with W_mh = I and W_mx x = 1 the mLSTM is an LSTM with W_hh = W_m
    torch.manual_seed(1)
    B, E, H = 3, 4, 6
    w_x, b, w_m = torch.randn(4 * H, E).double(), torch.randn(4 * H).double(), torch.randn(4 * H, H).double()
    cell = _lstm_from(w_x, b, w_m)
    x = torch.randn(B, E).double()
    h, c = torch.randn(B, H).double(), torch.randn(B, H).double()
    ours = mlstm_cell(torch.ones(B, H).double(), x @ w_x.t() + b, h, c, torch.eye(H).double(), w_m)
    ref = cell(x, (h, c))
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=1e-12)


def test_model_reduces_to_lstm_over_a_sequence() -> None:
    model = _model(weight_norm=False)
    E, H = 5, 12
    with torch.no_grad():
        model.w_mh.v.copy_(torch.eye(H))
        model.embed.weight[:, -1] = 1.0  # last embedding unit is constant 1 ...
        model.w_mx.v.zero_()
        model.w_mx.v[:, -1] = 1.0  # ... and W_mx reads only it: W_mx x = 1
    tokens = torch.randint(0, 256, (2, 9))
    out = model(tokens, model.init_state(2))
    cell = _lstm_from(model.w_x.v, model.w_x.bias, model.w_m.v)  # type: ignore[arg-type]
    h = c = torch.zeros(2, H).double()
    for t in range(tokens.shape[1]):
        h, c = cell(model.embed(tokens[:, t]), (h, c))
    torch.testing.assert_close(out.state.tensors["h"], h, rtol=0, atol=1e-12)
    assert E == model.config.embed_dim


def test_forget_gate_bias_and_orthogonal_init() -> None:
    model = _model()
    H = model.config.hidden
    assert model.w_x.bias is not None
    assert torch.all(model.w_x.bias[H : 2 * H] == 3.0)
    assert torch.all(model.w_x.bias[:H] == 0.0)
    w = model.w_mh.weight().detach()
    torch.testing.assert_close(w @ w.t(), 0.49 * torch.eye(H).double(), atol=1e-6, rtol=0)  # scale 0.7


def test_causal() -> None:
    model = _model()
    a = torch.randint(0, 256, (1, 20))
    b = a.clone()
    b[0, 12:] = torch.randint(0, 256, (8,))
    la = model(a, model.init_state(1)).logits
    lb = model(b, model.init_state(1)).logits
    torch.testing.assert_close(la[:, :12], lb[:, :12], rtol=0, atol=0)
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


def test_state_carries_across_chunks() -> None:
    model = _model()
    x = torch.randint(0, 256, (2, 16))
    whole = model(x, model.init_state(2))
    first = model(x[:, :7], model.init_state(2))
    second = model(x[:, 7:], first.state)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole.logits, rtol=0, atol=1e-12)


def test_adapter_zero_changes_nothing() -> None:
    model = _model()
    x = torch.randint(0, 256, (3, 10))
    base = model(x, model.init_state(3))
    zero = Adapter.zeros({"h": 8}, 3, dtype=torch.float64)
    out = model(x, model.init_state(3), zero)
    assert torch.equal(out.logits, base.logits)


def test_per_row_adapter_only_affects_its_row() -> None:
    model = _model()
    x = torch.randint(0, 256, (3, 10))
    base = model(x, model.init_state(3))
    adapter = Adapter.zeros({"h": 8}, 3, dtype=torch.float64)
    adapter.mats["h"][1] = 0.3 * torch.randn(8, 8).double()
    out = model(x, model.init_state(3), adapter)
    assert torch.equal(out.logits[0], base.logits[0])
    assert torch.equal(out.logits[2], base.logits[2])
    assert not torch.allclose(out.logits[1], base.logits[1])
    # h' = h + M h: units past k pass through, so a batch-1 run of row 1 gives the same row
    single = model(x[1:2], model.init_state(1), adapter.select(1))
    torch.testing.assert_close(single.logits[0], out.logits[1], rtol=0, atol=1e-12)


def test_adapter_bad_shape_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="does not fit"):
        model(torch.zeros(1, 3, dtype=torch.long), model.init_state(1), Adapter.zeros({"h": 13}, 1, torch.float64))


def test_state_stack_and_select() -> None:
    model = _model()
    s = State.stack([model.init_state(1), model.init_state(2)])
    assert s.batch == 3
    assert s.select(2).batch == 1


def test_adapter_gradient_matches_plain_autograd() -> None:
    # kernels.adapter.AdapterSteps forms dL/dM once per sequence; it must equal per-step autograd
    from kernels.adapter import apply_adapter_ref

    model = _model()
    x = torch.randint(0, 256, (3, 9))
    m = (0.1 * torch.randn(3, 8, 8)).double().requires_grad_(True)
    out = model(x, model.init_state(3), Adapter({"h": m}))
    (g_fast,) = torch.autograd.grad(out.logits.logsumexp(-1).sum(), [m])

    m2 = m.detach().clone().requires_grad_(True)
    import models.mlstm as mlstm_mod

    class Plain:
        def __init__(self, mat: torch.Tensor) -> None:
            self.mat = mat

        def __call__(self, h: torch.Tensor) -> torch.Tensor:
            return apply_adapter_ref(h, self.mat)

    orig = mlstm_mod.AdapterSteps
    mlstm_mod.AdapterSteps = Plain  # type: ignore[misc,assignment]
    try:
        out2 = model(x, model.init_state(3), Adapter({"h": m2}))
        (g_ref,) = torch.autograd.grad(out2.logits.logsumexp(-1).sum(), [m2])
    finally:
        mlstm_mod.AdapterSteps = orig  # type: ignore[misc]
    torch.testing.assert_close(out.logits, out2.logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-10, atol=1e-12)
    # gradient w.r.t. the input state flows through (I + M) too
    h0 = torch.randn(3, 12).double().requires_grad_(True)
    st = State({"h": h0, "c": torch.zeros(3, 12).double()})
    (gh,) = torch.autograd.grad(model(x, st, Adapter({"h": m.detach()})).logits.sum(), [h0])
    assert torch.isfinite(gh).all() and gh.abs().sum() > 0


def test_stack_padded_adapters_change_nothing() -> None:
    """Zero-padding an adapter to a larger k (and M = 0 for rows without one) leaves every output as it was."""
    from models.base import Adapter

    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=16, embed_dim=8, dropout_hidden=0.0)).double().eval()
    x = torch.randint(0, 256, (3, 7))
    small = Adapter({"h": 0.1 * torch.randn(1, 5, 5, dtype=torch.float64)})
    large = Adapter({"h": 0.1 * torch.randn(1, 12, 12, dtype=torch.float64)})
    stacked = Adapter.stack_padded([small, None, large])
    assert stacked is not None and stacked.mats["h"].shape == (3, 12, 12)
    assert Adapter.stack_padded([None, None]) is None
    out = model(x, model.init_state(3), stacked)
    for b, adapter in enumerate([small, None, large]):
        alone = model(x[b : b + 1], model.init_state(1), adapter)
        torch.testing.assert_close(out.logits[b], alone.logits[0], rtol=0, atol=1e-12)


def test_inference_weight_cache_follows_updates() -> None:
    model = _model()
    x = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        a = model(x, model.init_state(1)).logits
        assert torch.equal(model(x, model.init_state(1)).logits, a)  # cached path, same result
        model.w_m.g.mul_(1.5)  # an in-place update must invalidate the cache
        model.w_x.bias.add_(0.25)  # and the input tables
        b = model(x, model.init_state(1)).logits
        rebuilt = MLSTM(model.config).to(next(model.parameters()).dtype).eval()
        rebuilt.load_state_dict(model.state_dict())
        fresh = rebuilt(x, rebuilt.init_state(1)).logits  # caches made from the new weights
    direct = model(x, model.init_state(1)).logits  # grad enabled: computed without any cache
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, fresh, rtol=0, atol=0)
    # the input tables are the same products row by row, up to the matmul's summation order
    torch.testing.assert_close(b, direct.detach(), rtol=1e-12, atol=1e-12)


def test_weight_cache_serves_frozen_weights_under_autograd() -> None:
    # sparse adaptation runs with autograd on and the weights frozen: no gradient can reach v or g, so the cache serves
    model = _model()
    assert model.w_m.weight() is not model.w_m.weight() and model.w_m.weight().requires_grad
    model.requires_grad_(False)
    try:
        w = model.w_m.weight()
        assert model.w_m.weight() is w and not w.requires_grad
        with torch.no_grad():
            model.w_m.v.mul_(2.0)
        assert model.w_m.weight() is not w
    finally:
        model.requires_grad_(True)


def test_states_whose_memories_fill_up_batch_by_left_padding() -> None:
    """A memory (B, L, D) with a validity mask (B, L): rows of different lengths stack (and merge with `where`) by
    left-padding the shorter, zeros and False, so each row's own slots keep their places at the recent end."""
    from models.base import State

    short = State({"kv": torch.ones(1, 2, 3), "mask": torch.ones(1, 2, dtype=torch.bool)})
    long = State({"kv": 2 * torch.ones(1, 4, 3), "mask": torch.ones(1, 4, dtype=torch.bool)})
    both = State.stack([short, long])
    assert both.tensors["kv"].shape == (2, 4, 3)
    assert both.tensors["mask"].tolist() == [[False, False, True, True], [True] * 4]
    assert both.tensors["kv"][0, :2].abs().sum() == 0 and bool((both.tensors["kv"][0, 2:] == 1).all())
    assert both.row_bytes == 4 * 3 * 4 + 4
    merged = short.where(torch.tensor([False]), long)
    assert merged.tensors["kv"].shape == (1, 4, 3) and bool((merged.tensors["kv"] == 2).all())
    restored = State.from_tensors(both.to_tensors("s."), "s.")
    assert all(torch.equal(restored.tensors[k], v) for k, v in both.tensors.items())
