"""The adaptive-input transformer (models/adaptive_transformer.py; issue 13): causality across a slide, the logits
convention (log-probabilities in eval mode, none in training) and its agreement with `log_probs`, `target_logprobs`
and `loss`, the full-softmax variant, tying through save and load, the K/V state, the sparse site, and training
through the trainer.

References are computed in the same run; tolerances, not one machine's numbers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from models.adaptation import DynEvalConfig, evaluate
from models.adaptive_transformer import AdaptiveTransformer, AdaptiveTransformerConfig, resolve_cutoffs
from models.base import Adapter, Output
from models.checkpoint import load_checkpoint, save_checkpoint
from models.registry import REGISTRY, build_model, config_from_dict
from models.word_tokenizer import WordTokenizer
from tests._families import assert_rows_batch_like_each_alone
from trainer.config import make_config
from trainer.train import evaluate_bpb, train

DATA = Path(__file__).resolve().parent.parent / "data"
TRAIN, VALID = DATA / "train.txt", DATA / "valid.txt"
V = 300  # >= 256: the shared batching helper draws byte-valued ids
MODEL: dict[str, Any] = {"vocab_size": V, "d_model": 16, "n_layer": 2, "n_head": 2, "d_ff": 32, "context": 12,
                         "cutoffs": (0.1, 0.3)}


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, **overrides: Any) -> AdaptiveTransformer:
    torch.manual_seed(seed)
    return AdaptiveTransformer(AdaptiveTransformerConfig(**{**MODEL, **overrides})).eval()


def _tokens(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _block_params(cfg: AdaptiveTransformerConfig) -> int:
    D, F = cfg.d_model, cfg.d_ff
    per_block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (D * F + F) + (F * D + D)  # LNs, qkv, proj, FFN
    return cfg.n_layer * per_block + 2 * D  # + the final LN


def test_registered_config_round_trips_and_cutoffs_resolve() -> None:
    assert REGISTRY["adaptive-transformer"] == (AdaptiveTransformerConfig, AdaptiveTransformer)
    cfg = AdaptiveTransformerConfig(**MODEL)
    assert config_from_dict(cfg.to_dict()) == cfg
    assert config_from_dict({**cfg.to_dict(), "cutoffs": [0.1, 0.3]}) == cfg  # JSON gives a list
    assert _model().cutoffs == [30, 90]
    assert resolve_cutoffs((0.1, 0.3), 2000) == [200, 600]
    assert resolve_cutoffs((20, 60), 2000) == [20, 60]  # absolute ids as they are
    assert resolve_cutoffs((0.001, 0.5, 0.9999), 10) == [5]  # those on 0 or reaching V dropped: fewer bands
    for bad in ((0.1, 20), (0.0, 0.5), (True, 3)):
        with pytest.raises(ValueError, match="cutoffs must be"):
            resolve_cutoffs(bad, 100)
    with pytest.raises(ValueError, match="reach beyond the vocabulary"):
        AdaptiveTransformer(AdaptiveTransformerConfig(**{**MODEL, "cutoffs": (30, 300)}))
    tiny = make_config("tiny", {"arch": "adaptive-transformer"})
    assert tiny.tokenizer["kind"] == "words"
    model = build_model(config_from_dict({"arch": tiny.arch, **tiny.model, "vocab_size": 2000}))
    assert isinstance(model, AdaptiveTransformer) and model.cutoffs == [200, 600]


@pytest.mark.parametrize("training", [False, True])
def test_causal_gradient_of_output_t_wrt_later_inputs_is_zero(training: bool) -> None:
    """d log p_t / d input_s = 0 exactly for s > t, within the window and across slides (context 12, stride 6).
    The ids are distinct, so a probe added to the input's output at id x_s is input s, re-encodings included."""
    model = _model(softmax_dropout=0.2 if training else 0.0)
    model.train(training)
    T = 20
    x = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:T].view(1, T)
    probe = torch.zeros(V, MODEL["d_model"], requires_grad=True)
    assert model.input is not None
    hook = model.input.register_forward_hook(lambda _m, inp, out: out + probe[inp[0]])
    try:
        out = model(x, model.init_state(1))
    finally:
        hook.remove()
    lp = model.log_probs(out)  # (1, T, V)
    for t in range(T):
        (grad,) = torch.autograd.grad(lp[0, t].sum() + lp[0, t, t], probe, retain_graph=True)
        seen = (grad[x[0]].abs().sum(1) > 0).tolist()
        first = 0 if t < 12 else 6 if t < 18 else 12  # full at 12, slides by 6 (at t = 12 and t = 18)
        assert seen == [first <= s <= t for s in range(T)], t


def test_log_probs_normalise_and_target_logprobs_gather_from_them() -> None:
    model = _model(seed=1)
    x, y = _tokens(15, batch=2), _tokens(15, batch=2, seed=1)
    with torch.no_grad():
        out = model(x, model.init_state(2))
        lp = model.log_probs(out)
        assert out.logits.shape == lp.shape == (2, 15, V)  # eval mode: the logits are the log-probabilities
        torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2, 15), rtol=0, atol=1e-5)
        gathered = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (2, 15)
        torch.testing.assert_close(model.target_logprobs(out, y), gathered, rtol=1e-5, atol=1e-5)  # via hidden
        # an Output rebuilt from logits alone (sparse dynamic evaluation) gathers from them
        bare = Output(logits=out.logits, state=out.state)
        torch.testing.assert_close(model.target_logprobs(bare, y), gathered, rtol=0, atol=0)
        torch.testing.assert_close(torch.log_softmax(out.logits, -1), lp, rtol=0, atol=1e-5)  # normalising: a no-op
        assert float(model.loss(out, y)) == pytest.approx(-float(gathered.mean()), rel=1e-5)
        # training mode: no distribution in the forward; the loss goes through the hidden states, same numbers
        model.train()
        train_out = model(x, model.init_state(2))
        assert train_out.logits.shape == (2, 15, 0)
        torch.testing.assert_close(model.log_probs(train_out), lp, rtol=1e-5, atol=1e-5)
        assert float(model.loss(train_out, y)) == pytest.approx(float(model.loss(out, y)), rel=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_full_softmax_variant_is_an_ordinary_transformer(tie: bool) -> None:
    cfg = AdaptiveTransformerConfig(**{**MODEL, "adaptive": False, "tie_weights": tie})
    torch.manual_seed(0)
    model = AdaptiveTransformer(cfg).eval()
    D = cfg.d_model
    assert sum(p.numel() for p in model.parameters()) == _block_params(cfg) + V * D * (1 if tie else 2)
    assert model.input is None and model.softmax is None and model.embed is not None
    x = _tokens(10, batch=2)
    with torch.no_grad():
        out = model(x, model.init_state(2))
        assert out.hidden is not None
        weight = model.embed.weight if tie else model.out_weight
        assert weight is not None
        torch.testing.assert_close(out.logits, out.hidden @ weight.T, rtol=1e-5, atol=1e-5)  # no bias
        torch.testing.assert_close(model.log_probs(out), torch.log_softmax(out.logits, -1), rtol=0, atol=0)
        assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}  # each tensor once
    # the adaptive model's count, tied: bands + all projections + the cluster rows, nothing of the softmax's own
    ada = _model()
    dims, cuts = [16, 4, 1], [0, 30, 90, V]
    bands = sum((b - a) * d for a, b, d in zip(cuts, cuts[1:], dims, strict=False))
    assert sum(p.numel() for p in ada.parameters()) == _block_params(cfg) + bands + D * sum(dims) + 2 * D
    untied = _model(tie_weights=False)  # + a second copy of the bands and the tail projections
    assert sum(p.numel() for p in untied.parameters()) == _block_params(cfg) + 2 * bands + D * sum(dims) + \
        D * sum(dims[1:]) + 2 * D


def _assert_tied(model: AdaptiveTransformer) -> None:
    inp, sm = model.input, model.softmax
    assert inp is not None and sm is not None
    assert sm.head_weight is inp.embeddings[0]
    for i in range(2):
        assert sm.tail_weights[i] is inp.embeddings[i + 1]
        assert sm.tail_projections[i] is inp.projections[i + 1]
        assert sm.tail_projections[i].data_ptr() == inp.projections[i + 1].data_ptr()
    own = {id(p) for p in sm.parameters()}
    assert id(inp.projections[0]) not in own  # the head projection is never tied (the softmax has none)
    assert id(sm.cluster_weight) not in {id(p) for p in inp.parameters()}
    # the state dict has each tensor once, under the input's names; named_parameters likewise
    keys = set(model.state_dict())
    assert keys == {n for n, _ in model.named_parameters()}
    assert [k for k in keys if k.startswith("softmax.")] == ["softmax.cluster_weight"]
    ptrs = [v.data_ptr() for v in model.state_dict().values()]
    assert len(ptrs) == len(set(ptrs))


def test_tied_tensors_are_shared_and_the_head_projection_is_not() -> None:
    model = _model()
    _assert_tied(model)
    # a gradient step moves the shared tensor once, for both its uses
    model.train()
    x = _tokens(10, batch=2)
    model.loss(model(x, model.init_state(2)), _tokens(10, batch=2, seed=3)).backward()
    assert model.input is not None and model.softmax is not None
    grad = model.input.embeddings[0].grad
    assert grad is not None and model.softmax.head_weight.grad is grad
    untied = _model(tie_weights=False)
    assert untied.softmax is not None and untied.input is not None
    assert untied.softmax.head_weight is not untied.input.embeddings[0]
    assert "softmax.head_weight" in untied.state_dict()
    copy = model.trainable_copy()
    assert isinstance(copy, AdaptiveTransformer)
    _assert_tied(copy)


def test_checkpoint_round_trip_keeps_the_weights_tied(tmp_path: Path) -> None:
    tok = WordTokenizer.build(TRAIN.read_text(encoding="utf-8"), max_size=V)
    assert tok.vocab_size == V
    model = _model(seed=2)
    x = _tokens(14, batch=2)
    with torch.no_grad():
        ref = model(x, model.init_state(2)).logits
    save_checkpoint(tmp_path / "ck", model, tokenizer=tok)
    for trainable in (False, True):
        ck = load_checkpoint(tmp_path / "ck", trainable=trainable)
        loaded = ck.model
        assert isinstance(loaded, AdaptiveTransformer) and ck.tokenizer == tok
        _assert_tied(loaded)
        assert all(p.requires_grad == trainable for p in loaded.parameters())
        with torch.no_grad():
            torch.testing.assert_close(loaded(x, loaded.init_state(2)).logits, ref, rtol=0, atol=0)
    # saved again from the loaded model: the same file contents
    save_checkpoint(tmp_path / "again", ck.model, tokenizer=tok)
    saved = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("ck", "again")]
    assert saved[0] == saved[1]


@pytest.mark.parametrize("cuts", [[1, 2, 3], [5, 11, 12], [7, 19, 30], [40]])
def test_state_carried_across_pieces_equals_one_forward(cuts: list[int]) -> None:
    """Within the window and past several slides: pieces with the K/V state equal one forward."""
    model = _model()
    x = _tokens(40, batch=3)
    adapter = Adapter({"resid": 0.1 * torch.randn(3, 10, 10, generator=torch.Generator().manual_seed(1))})
    with torch.no_grad():
        whole = model(x, model.init_state(3), adapter)
        state, parts, hidden = model.init_state(3), [], []
        for a, b in zip([0, *cuts], [*cuts, 40], strict=True):
            if b > a:
                out = model(x[:, a:b], state, adapter)
                state = out.state
                parts.append(out.logits)
                hidden.append(out.hidden)
    torch.testing.assert_close(torch.cat(parts, 1), whole.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(hidden, 1), whole.hidden, rtol=1e-5, atol=1e-5)
    for k, v in whole.state.tensors.items():
        torch.testing.assert_close(state.tensors[k], v, rtol=1e-5, atol=1e-5)


def test_rows_at_different_fills_batch_like_each_alone() -> None:
    assert_rows_batch_like_each_alone(_model())


@pytest.mark.parametrize("adapt_layer", [0, -1])
def test_sparse_adapter_zero_equals_none(adapt_layer: int) -> None:
    model = _model(adapt_layer=adapt_layer, adapter_units=8)
    (site,) = model.adaptation_sites()
    assert (site.name, site.dim, site.per_step, site.adapter_size()) == ("resid", 16, False, 8)
    x = _tokens(20, batch=2)
    with torch.no_grad():
        none = model(x, model.init_state(2))
        zero = model(x, model.init_state(2), Adapter.zeros({"resid": 8}, 2))
        some = model(x, model.init_state(2), Adapter({"resid": 0.2 * torch.ones(2, 8, 8)}))
    torch.testing.assert_close(zero.logits, none.logits, rtol=0, atol=0)
    for k, v in none.state.tensors.items():
        torch.testing.assert_close(zero.state.tensors[k], v, rtol=0, atol=0)
    assert float((some.logits - none.logits).abs().max()) > 1e-3  # the site is read


def test_parameter_layers() -> None:
    model = _model()
    layers = {n: model.parameter_layer(n) for n, _ in model.named_parameters()}
    assert layers["input.embeddings.0"] == layers["input.projections.2"] == -1
    assert layers["blocks.1.qkv.weight"] == 1 and layers["ln_f.weight"] == layers["softmax.cluster_weight"] == 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adaptive") / "ck"
    train(make_config("tiny", {"arch": "adaptive-transformer", "threads": 1}), [TRAIN], out, valid_path=VALID,
          progress=False)
    return out


def test_tiny_preset_trains_end_to_end(trained: Path) -> None:
    ck = load_checkpoint(trained)
    model, tok = ck.model, ck.tokenizer
    assert isinstance(model, AdaptiveTransformer) and isinstance(tok, WordTokenizer)
    assert tok.vocab_size == 2000 == model.config.vocab_size and model.cutoffs == [200, 600]
    _assert_tied(model)
    ids = tok.encode_tensor(VALID.read_text(encoding="utf-8"))
    torch.manual_seed(0)
    untrained = AdaptiveTransformer(model.config).eval()
    before = evaluate_bpb(untrained, ids, streams=4)  # bits per word
    assert before > math.log2(2000) - 1.0  # near uniform (10.97 bits)
    metrics = ck.meta["metrics"]
    assert metrics["valid_perplexity"] == pytest.approx(2 ** metrics["valid_bits_per_word"])
    assert metrics["valid_bits_per_word"] < before - 2.0  # perplexity down by more than 4x
    assert evaluate_bpb(model, ids, streams=4) == pytest.approx(metrics["valid_bits_per_word"], rel=1e-4)
    assert ck.stats["adapter.resid"].shape == (32, 32) and float(ck.stats["adapter.resid"].sum()) > 0


def test_dynamic_evaluation_adapts_through_the_adaptive_softmax(trained: Path) -> None:
    """Sparse (logits rebuilt without hidden states: gathered from the log-probabilities) and full dynamic evaluation
    (gradients through the full distribution) lower the cost of a repeated text."""
    ck = load_checkpoint(trained)
    text = VALID.read_bytes()[:2500] * 2
    static = evaluate(ck.model, text, DynEvalConfig(mode="static"), tokenizer=ck.tokenizer)
    assert static.tokens == len(ck.tokenizer.encode(text))
    for mode, lr in (("sparse", 1e-2), ("full", 1e-3)):
        adapted = evaluate(ck.model, text, DynEvalConfig(mode=mode, rule="sgd", lr=lr, segment=10), stats=ck.stats,
                           tokenizer=ck.tokenizer)
        assert adapted.tokens == static.tokens
        assert adapted.bits < static.bits, mode
