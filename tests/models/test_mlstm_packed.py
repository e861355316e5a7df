"""The mLSTM's recurrent products on weights packed once for oneDNN (`models.mlstm.packed_product`): the same numbers
as the plain bf16 matmul, for any count of rows, and the model's inference steps unchanged by them."""

import pytest
import torch

import models.mlstm as mlstm
from models.base import State
from models.mlstm import MLSTM, MLSTMConfig, packed_product

PACKS = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.skipif(not PACKS, reason="this CPU's oneDNN has no bf16 kernels")
def test_packed_product_is_the_plain_product_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    times = packed_product(w)
    assert callable(times) and not isinstance(times, torch.Tensor)  # packed here (a CPU with bf16 kernels)
    for rows in (1, 2, 5, 8, 13, 31, 64, 100):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(times(x), x @ w.t()), rows


def test_packed_product_keeps_weights_it_cannot_pack() -> None:
    w = torch.randn(8, 4)
    assert packed_product(w) is w  # float32: the plain product
    assert packed_product(w.double()).dtype == torch.float64


def _frozen_model() -> MLSTM:
    torch.manual_seed(0)
    return MLSTM(MLSTMConfig(hidden=48, embed_dim=8)).eval().freeze()  # type: ignore[return-value]


def test_bf16_inference_steps_are_unchanged_by_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen model's steps under bf16 autocast (the search's and generation's) give the same logits and states
    with the packed products as with the plain weights, for a batch of any rows."""
    model = _frozen_model()
    torch.manual_seed(1)
    for rows in (1, 7, 24):
        tokens = torch.randint(0, 256, (rows, 3))
        state = State({"h": torch.randn(rows, 48), "c": torch.randn(rows, 48)})
        outs = []
        for pack in (True, False):
            if not pack:
                monkeypatch.setattr(mlstm, "packed_product", lambda w: w)
            for layer in (model.w_mh, model.w_m):
                layer._product = None  # made again, packed or not
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(model(tokens, state))
            if pack and PACKS:  # the packed products ran
                assert model.w_m._product is not None and not isinstance(model.w_m._product[1], torch.Tensor)
            monkeypatch.undo()
        packed, plain = outs
        assert torch.equal(packed.logits, plain.logits)
        assert all(torch.equal(packed.state.tensors[k], plain.state.tensors[k]) for k in ("h", "c"))
