import json

import pytest
import torch

import models.awd_lstm as awd
from models.awd_lstm import AWDLSTM, AWDLSTMConfig, embedding_dropout, locked_dropout
from models.base import Adapter
from models.registry import REGISTRY, build_model, config_from_dict

V, E, H = 23, 6, 10
NO_DROP = {"dropout": 0.0, "dropouth": 0.0, "dropouti": 0.0, "dropoute": 0.0, "wdrop": 0.0}


def _model(**kw: object) -> AWDLSTM:
    torch.manual_seed(0)
    fields: dict[str, object] = {"vocab_size": V, "emb_size": E, "hidden_size": H, "layers": 3, **kw}
    return AWDLSTM(AWDLSTMConfig(**fields)).double()  # type: ignore[arg-type]


def _raw(model: AWDLSTM, layer: int) -> torch.Tensor:
    """The raw recurrent weight U of a layer."""
    w = model.layers[layer].weight_hh_raw
    assert isinstance(w, torch.Tensor)
    return w


def _tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_registered_and_config_round_trips_through_json() -> None:
    assert REGISTRY["awd-lstm"] == (AWDLSTMConfig, AWDLSTM)
    cfg = AWDLSTMConfig(vocab_size=V, emb_size=E, hidden_size=H, adapt_layers=(0, -1))
    back = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and isinstance(back.adapt_layers, tuple) and hash(back) == hash(cfg)
    assert isinstance(build_model(back), AWDLSTM)
    with pytest.raises(ValueError):
        AWDLSTM(AWDLSTMConfig(wdrop=1.0))
    with pytest.raises(ValueError):
        AWDLSTM(AWDLSTMConfig(layers=2, adapt_layers=(2,)))


def test_eval_matches_stacked_nn_lstm_with_copied_weights() -> None:
    model = _model(tie_weights=False).eval()
    ref = torch.nn.LSTM(E, H, num_layers=3, batch_first=True).double()
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            getattr(ref, f"weight_ih_l{i}").copy_(layer.weight_ih)
            getattr(ref, f"weight_hh_l{i}").copy_(layer.weight_hh_raw)
            getattr(ref, f"bias_ih_l{i}").copy_(layer.bias_ih)
            getattr(ref, f"bias_hh_l{i}").copy_(layer.bias_hh)
    x = _tokens(2, 7)
    state = model.init_state(2)
    h0 = torch.randn(3, 2, H, dtype=torch.float64)
    c0 = torch.randn(3, 2, H, dtype=torch.float64)
    for i in range(3):
        state.tensors[f"h{i}"], state.tensors[f"c{i}"] = h0[i], c0[i]
    with torch.no_grad():
        out = model(x, state)
        hs, (hn, cn) = ref(model.embed(x), (h0, c0))
    assert model.decoder_weight is not None
    expect = hs @ model.decoder_weight.t() + model.decoder_bias
    torch.testing.assert_close(out.logits, expect, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.hidden, hs, rtol=0, atol=1e-12)
    for i in range(3):
        torch.testing.assert_close(out.state.tensors[f"h{i}"], hn[i], rtol=0, atol=1e-12)
        torch.testing.assert_close(out.state.tensors[f"c{i}"], cn[i], rtol=0, atol=1e-12)
    assert out.aux == {}


def test_tied_weights_share_storage_and_last_layer_is_embedding_sized() -> None:
    model = _model()
    assert model.decoder_weight is None
    assert model.output_weight() is model.embed.weight
    assert model.output_weight().data_ptr() == model.embed.weight.data_ptr()
    assert model.sizes == [H, H, E] and _raw(model, 2).shape == (4 * E, E)
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and not any(n.startswith("decoder_weight") for n in names)
    # a gradient from the decoder reaches the embedding: a token never seen at the input still gets one
    model.eval()
    x = torch.zeros(1, 3, dtype=torch.long)  # only token 0 as input
    model(x, model.init_state(1)).logits[0, -1, 5].backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad[5].abs().sum() > 0
    untied = _model(tie_weights=False)
    assert untied.sizes == [H, H, H] and untied.output_weight().shape == (V, H)


def test_dropconnect_one_mask_per_forward_shared_over_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(**{**NO_DROP, "wdrop": 0.5, "alpha": 0.0, "beta": 0.0}).train()
    seen: list[torch.Tensor] = []
    cell = awd.lstm_cell

    def recording(xw: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
                  w_hh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(w_hh)
        return cell(xw, h, c, w_hh)

    monkeypatch.setattr(awd, "lstm_cell", recording)
    T = 5
    x = _tokens(2, T)
    torch.manual_seed(1)
    out = model(x, model.init_state(2))
    first = seen[:]
    assert len(first) == 3 * T
    for layer in range(3):
        steps = first[layer * T:(layer + 1) * T]
        assert all(torch.equal(w, steps[0]) for w in steps)  # the same effective weight at every step
        raw = _raw(model, layer)
        kept = steps[0] != 0
        frac = kept.double().mean().item()
        assert 0.3 < frac < 0.7
        torch.testing.assert_close(steps[0][kept], 2.0 * raw[kept], rtol=0, atol=0)  # rescaled by 1/(1-p)
    # the training output is the eval output of the same model with U := the masked weight
    same = _model(**NO_DROP).eval()
    same.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in range(3):
            _raw(same, layer).copy_(first[layer * T])
        torch.testing.assert_close(same(x, same.init_state(2)).logits, out.logits.detach(), rtol=0, atol=1e-12)
    # gradients reach the raw weights, zero where the mask dropped them
    out.logits.sum().backward()
    for layer in range(3):
        g = _raw(model, layer).grad
        assert g is not None and g.abs().sum() > 0
        assert torch.all(g[first[layer * T] == 0] == 0)
    # a second forward draws another mask
    seen.clear()
    model(x, model.init_state(2))
    assert not torch.equal(seen[0], first[0])
    # eval mode: the raw weight itself
    seen.clear()
    model.eval()
    with torch.no_grad():
        model(x, model.init_state(2))
    assert all(w is _raw(model, i // T) for i, w in enumerate(seen))


def test_locked_dropout_mask_shared_over_time() -> None:
    torch.manual_seed(0)
    x = torch.rand(3, 8, 16, dtype=torch.float64) + 0.5  # no zeros of its own
    y = locked_dropout(x, 0.5, training=True)
    ratio = y / x  # (B, T, D) in {0, 2}
    assert set(torch.unique(ratio).tolist()) == {0.0, 2.0}
    assert torch.equal(ratio, ratio[:, :1].expand_as(ratio))  # one mask per sequence
    assert not torch.equal(ratio[0], ratio[1])  # each row its own
    assert locked_dropout(x, 0.5, training=False) is x


def test_output_dropout_in_model_is_locked() -> None:
    model = _model(**{**NO_DROP, "dropout": 0.5})
    x = _tokens(2, 6)
    with torch.no_grad():
        ref = model.eval()(x, model.init_state(2)).hidden
        torch.manual_seed(3)
        got = model.train()(x, model.init_state(2)).hidden
    assert ref is not None and got is not None
    mask = (got != 0).double()  # (B, T, E)
    assert torch.equal(mask, mask[:, :1].expand_as(mask))
    torch.testing.assert_close(got, 2.0 * ref * mask, rtol=0, atol=1e-12)


def test_embedding_dropout_drops_whole_rows() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 7, dtype=torch.float64)
    d = embedding_dropout(w, 0.25, training=True)
    zero = (d == 0).all(dim=1)
    assert 0 < int(zero.sum()) < 40
    torch.testing.assert_close(d[~zero], w[~zero] / 0.75, rtol=0, atol=1e-15)
    assert embedding_dropout(w, 0.25, training=False) is w
    # in the model, every occurrence of a word shares its fate, across rows and positions
    model = _model(**{**NO_DROP, "dropoute": 0.5}).train()
    x = torch.tensor([[1, 2, 1, 3, 2], [3, 1, 2, 2, 1]])
    e = model.embed_tokens(x)
    for tok in (1, 2, 3):
        rows = e[x == tok]
        assert all(torch.equal(r, rows[0]) for r in rows)
        assert torch.equal(rows[0], torch.zeros(E, dtype=rows.dtype)) or torch.allclose(
            rows[0], 2.0 * model.embed.weight[tok], rtol=0, atol=1e-15)


def test_causal() -> None:
    model = _model(**NO_DROP).eval()
    T = 6
    x = _tokens(1, T)
    emb: torch.Tensor = model.embed(x).detach().requires_grad_(True)

    def embed_probe(tokens: torch.Tensor) -> torch.Tensor:
        return emb

    model.embed_tokens = embed_probe  # type: ignore[method-assign]
    out = model(x, model.init_state(1))
    for t in range(T):
        (g,) = torch.autograd.grad(out.logits[0, t].sum(), emb, retain_graph=True)
        dep = g[0].abs().sum(dim=1) > 0  # (T,)
        assert dep.tolist() == [s <= t for s in range(T)]


def test_state_carried_across_calls_equals_one_call() -> None:
    model = _model().eval()  # dropouts configured, but eval mode uses none
    x = _tokens(2, 9)
    with torch.no_grad():
        whole = model(x, model.init_state(2))
        a = model(x[:, :4], model.init_state(2))
        b = model(x[:, 4:], a.state)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], dim=1), whole.logits, rtol=0, atol=1e-12)
    for k, v in whole.state.tensors.items():
        torch.testing.assert_close(b.state.tensors[k], v, rtol=0, atol=1e-12)


def test_ar_tar_in_aux_only_in_training() -> None:
    model = _model(**{**NO_DROP, "dropout": 0.5, "alpha": 2.0, "beta": 1.0})
    x = _tokens(2, 6)
    with torch.no_grad():
        assert model.eval()(x, model.init_state(2)).aux == {}
        torch.manual_seed(4)
        out = model.train()(x, model.init_state(2))
        ref = model.eval()(x, model.init_state(2)).hidden  # the undropped final output (no other dropout)
    assert set(out.aux) == {"ar", "tar"} and out.hidden is not None and ref is not None
    torch.testing.assert_close(out.aux["ar"], 2.0 * out.hidden.pow(2).mean(), rtol=0, atol=1e-14)
    torch.testing.assert_close(out.aux["tar"], 1.0 * (ref[:, 1:] - ref[:, :-1]).pow(2).mean(), rtol=0, atol=1e-14)
    loss = model.loss(out, _tokens(2, 6, seed=1))
    nll = -model.target_logprobs(out, _tokens(2, 6, seed=1)).mean()
    torch.testing.assert_close(loss, nll + out.aux["ar"] + out.aux["tar"], rtol=0, atol=1e-14)
    assert set(_model(alpha=0.0, beta=0.0).train()(x, model.init_state(2)).aux) == set()


def test_adapter_zero_is_identity_and_nonzero_changes_output() -> None:
    model = _model(adapt_layers=(0, -1), adapter_units=4).eval()
    sites = model.adaptation_sites()
    assert [(s.name, s.dim, s.layer, s.per_step, s.adapter_size()) for s in sites] == [
        ("h0", H, 0, True, 4), ("h2", E, 2, True, 4)]
    x = _tokens(2, 5)
    with torch.no_grad():
        plain = model(x, model.init_state(2))
        zero = model(x, model.init_state(2), Adapter.zeros({"h0": 4, "h2": 4}, 2, dtype=torch.float64))
        torch.testing.assert_close(zero.logits, plain.logits, rtol=0, atol=0)
        m = Adapter.zeros({"h0": 4, "h2": 4}, 2, dtype=torch.float64)
        m.mats["h0"][0] = 0.5 * torch.eye(4, dtype=torch.float64)  # row 0 only, layer 0 only
        moved = model(x, model.init_state(2), m)
        assert (moved.state.tensors["h0"][0] - plain.state.tensors["h0"][0]).abs().max() > 1e-2
        assert (moved.logits[0] - plain.logits[0]).abs().max() > 1e-5  # small: the init's logits are ~1e-2
        torch.testing.assert_close(moved.logits[1], plain.logits[1], rtol=0, atol=0)
        # closed form at the first step from a zero state: h' = h + 0.5 h on the first 4 units, the rest as is
        one, one_plain = model(x[:, :1], model.init_state(2), m), model(x[:, :1], model.init_state(2))
        h, h_plain = one.state.tensors["h0"][0], one_plain.state.tensors["h0"][0]
        torch.testing.assert_close(h[:4], 1.5 * h_plain[:4], rtol=0, atol=1e-15)
        torch.testing.assert_close(h[4:], h_plain[4:], rtol=0, atol=0)
    # gradients reach M
    mats = {k: v.clone().requires_grad_(True) for k, v in m.mats.items()}
    model(x, model.init_state(2), Adapter(mats)).logits.sum().backward()
    assert all(v.grad is not None and v.grad.abs().sum() > 0 for v in mats.values())


def test_parameter_layer() -> None:
    model = _model(tie_weights=False)
    layers = {n: model.parameter_layer(n) for n, _ in model.named_parameters()}
    assert layers["embed.weight"] == -1
    assert layers["layers.1.weight_hh_raw"] == 1 and layers["layers.2.bias_ih"] == 2
    assert layers["decoder_weight"] == 3 and layers["decoder_bias"] == 3


def test_trainable_copy_and_state_dict_have_no_shared_tensors() -> None:
    model = _model()
    sd = model.state_dict()
    ptrs = [v.data_ptr() for v in sd.values()]
    assert len(ptrs) == len(set(ptrs))  # safetensors-safe
    copy = model.trainable_copy()
    x = _tokens(1, 4)
    with torch.no_grad():
        torch.testing.assert_close(copy(x, copy.init_state(1)).logits,
                                   model.eval()(x, model.init_state(1)).logits, rtol=0, atol=0)


def test_checkpoint_round_trip_and_dynamic_evaluation(tmp_path: object) -> None:
    from pathlib import Path

    from models.adaptation import DynEvalConfig, evaluate
    from models.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = AWDLSTM(AWDLSTMConfig(vocab_size=256, emb_size=8, hidden_size=12, adapt_layers=(0, -1))).eval()
    save_checkpoint(Path(str(tmp_path)), model)  # tied weights: each tensor stored once
    ckpt = load_checkpoint(Path(str(tmp_path)), expect_arch="awd-lstm")
    x = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ckpt.model(x, ckpt.model.init_state(1)).logits,
                                   model(x, model.init_state(1)).logits, rtol=1e-6, atol=1e-6)
    text = bytes(range(60, 90)) * 2
    static = evaluate(ckpt.model, text, DynEvalConfig(mode="static"))
    sparse = evaluate(ckpt.model, text, DynEvalConfig(mode="sparse", rule="sgd", lr=0.5, segment=5))
    full = evaluate(model, text, DynEvalConfig(mode="full", rule="sgd", lr=0.5, segment=5, layers_from=2))
    assert sparse.params_adapted == 12 * 12 + 8 * 8  # both sites, whole width
    assert full.params_adapted == sum(p.numel() for n, p in model.named_parameters()
                                      if n.startswith("layers.2.") or n == "decoder_bias")
    # the first segment is scored before any update: equal there, different after
    torch.testing.assert_close(sparse.logprobs[:5], static.logprobs[:5], rtol=0, atol=1e-5)
    assert abs(sparse.logprobs[5:] - static.logprobs[5:]).max() > 1e-4
    assert abs(full.logprobs[5:] - static.logprobs[5:]).max() > 1e-4


def test_rows_batch_like_each_alone() -> None:
    from tests._families import assert_rows_batch_like_each_alone

    torch.manual_seed(0)
    model = AWDLSTM(AWDLSTMConfig(vocab_size=256, emb_size=8, hidden_size=12, layers=2)).eval()
    assert_rows_batch_like_each_alone(model)
