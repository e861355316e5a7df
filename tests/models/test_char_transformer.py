"""The deep character transformer with auxiliary losses (models/char_transformer.py) through the whole stack:
causality, the auxiliary-loss schedule, training-only heads, the sliding-window K/V state, cached generation,
training with a checkpoint and MS_g statistics, sparse dynamic evaluation and an HTTP session.

References are computed in the same run (the model's own forward); no numbers from one machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from models.adaptation import (
    DynEvalConfig,
    DynEvalSettings,
    FullStream,
    adapted_parameter_names,
    evaluate,
    evaluate_many,
)
from models.base import Adapter
from models.char_transformer import CharTransformer, CharTransformerConfig
from models.checkpoint import Checkpoint, load_checkpoint
from models.registry import REGISTRY, build_model, config_from_dict
from tests._families import (
    assert_greedy_generation_equals_recomputation,
    assert_rows_batch_like_each_alone,
    create_session,
    input_dependence,
    observe_text,
    served,
)
from tests._training import repetitive, sparse_bits_on_repeats, train_on_test_data
from trainer.config import make_config

DATA = Path(__file__).resolve().parent.parent / "data"
TRAIN, VALID = DATA / "train.txt", DATA / "valid.txt"
MODEL = {"d_model": 32, "n_layer": 3, "n_head": 2, "d_ff": 64, "context": 12}
# 16 validation streams: the final validation reads the whole validation file a byte at a time per stream
TRAINING = {"batch_size": 8, "bptt": 16, "lr": 3e-3, "lr_final": 1e-3, "max_steps": 60, "valid_every": 30,
            "valid_bytes": 2000, "valid_streams": 16, "stats_batches": 2, "stats_batch_size": 4, "log_every": 10,
            "threads": 1}
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."


def _model(seed: int = 0, **overrides: Any) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(CharTransformerConfig(**{**MODEL, **overrides})).eval()


def _tokens(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- the model itself -------------------------------------------------------------------------------------


def test_registered_and_config_round_trips() -> None:
    assert REGISTRY["char-transformer"] == (CharTransformerConfig, CharTransformer)
    cfg = CharTransformerConfig(**MODEL)
    assert config_from_dict(cfg.to_dict()) == cfg
    assert isinstance(build_model(cfg), CharTransformer)
    # `--arch char-transformer --preset tiny` has model settings of its own
    tiny = make_config("tiny", {"arch": "char-transformer"})
    assert isinstance(build_model(config_from_dict({"arch": tiny.arch, **tiny.model})), CharTransformer)


@pytest.mark.parametrize("training", [False, True])
def test_causal_gradient_of_output_t_wrt_later_inputs_is_zero(training: bool) -> None:
    """Within one window and across a slide (T > context): d logits_t / d input_s = 0 exactly for s > t.

    The bytes are distinct, so a probe added to the embedding of byte value x_s is input s, wherever the model
    embeds it (the first pass and the re-encoding of a slide)."""
    model = _model()
    model.train(training)
    T = 20  # past the first slide (context 12, stride 6)
    for t, seen in enumerate(input_dependence(model, T)):
        # causal, and the window as documented: full at 12 bytes, it slides by 6 (at t = 12 and t = 18)
        first = 0 if t < 12 else 6 if t < 18 else 12
        assert seen == [first <= s <= t for s in range(T)], t


def test_aux_weights_follow_the_schedule() -> None:
    model = _model()  # N = 3: block l's own loss stops at (l+1)/6 of training; two-ahead 0.5 x its layer's weight
    assert model.aux_weights(0.0) == {"layer0": 1.0, "layer1": 1.0, "two0": 0.5, "two1": 0.5, "two2": 0.5}
    assert model.aux_weights(0.17) == {"layer0": 0.0, "layer1": 1.0, "two0": 0.0, "two1": 0.5, "two2": 0.5}
    assert model.aux_weights(0.34) == {"layer0": 0.0, "layer1": 0.0, "two0": 0.0, "two1": 0.0, "two2": 0.5}
    assert model.aux_weights(0.9) == model.aux_weights(0.5) == model.aux_weights(0.34)
    # the forward returns exactly the live terms, each the weight times a cross-entropy
    model.train()
    x = _tokens(16, batch=2)
    for fraction, live in [(0.0, 5), (0.2, 3), (0.6, 1)]:
        model.set_training_progress(fraction)
        torch.manual_seed(0)
        out = model(x, model.init_state(2))
        assert sorted(out.aux) == sorted(k for k, w in model.aux_weights().items() if w > 0) and len(out.aux) == live
        assert all(v.dim() == 0 and v > 0 for v in out.aux.values())
    ablated = _model(aux_layers=False, aux_two_ahead=False).train()
    assert ablated(x, ablated.init_state(2)).aux == {}


def test_aux_losses_equal_the_papers_targets_computed_by_hand() -> None:
    """Paper, "Auxiliary Losses": block l's own classifier predicts the next byte and its extra classifier the byte
    two ahead, at every position, the latter weighted 0.5; written out over one fresh window (positions 0..T-1)."""
    model = _model().train()
    model.set_training_progress(0.0)
    x = _tokens(10, batch=2, seed=1)
    T, D, H = x.shape[1], MODEL["d_model"], MODEL["n_head"]
    out = model(x, model.init_state(2))
    h, outs = model.embed(x), []
    for l, block in enumerate(model.blocks):
        h = h + model.pos[l][:T]  # the layer's own positional embedding
        q, k, v = (t.view(2, T, H, D // H).transpose(1, 2) for t in block.qkv(block.ln1(h)).split(D, -1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (2, H, T, D/H)
        h = h + block.proj(att.transpose(1, 2).reshape(2, T, D))
        h = h + block.mlp(block.ln2(h))
        outs.append(h)
    torch.testing.assert_close(out.logits, model.head(model.ln_f(h)))
    for l in range(MODEL["n_layer"]):
        if l < MODEL["n_layer"] - 1:
            nxt = F.cross_entropy(model.aux["next"][l](outs[l][:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            torch.testing.assert_close(out.aux[f"layer{l}"], nxt)
        two = F.cross_entropy(model.aux["two"][l](outs[l][:, :-2]).flatten(0, 1), x[:, 2:].flatten())
        torch.testing.assert_close(out.aux[f"two{l}"], 0.5 * two)


def test_training_only_heads_are_not_needed_to_score() -> None:
    model = _model()
    names = model.training_only_parameters()
    assert names and all(n.startswith("aux.") for n in names)
    assert "aux.next.0.1.weight" in names and "aux.two.2.1.weight" in names and "head.weight" not in names
    x = _tokens(30, batch=2)
    assert model(x, model.init_state(2)).aux == {}  # evaluation: no auxiliary output
    inference = {k: v for k, v in model.state_dict().items() if not k.startswith("aux.")}
    served = CharTransformer(model.config).eval()
    missing, unexpected = served.load_state_dict(inference, strict=False)
    assert sorted(missing) == sorted(names) and not unexpected
    with torch.no_grad():
        for p in served.aux.parameters():
            p.fill_(float("nan"))  # were they read, the logits would be NaN
        torch.testing.assert_close(served(x, served.init_state(2)).logits, model(x, model.init_state(2)).logits,
                                   rtol=0, atol=0)


def test_feed_forward_dropout_falls_on_the_relu_activations() -> None:
    """Al-Rfou et al.: "dropout in the attention and ReLU layers". In training a share p of the ReLU activations
    reaching the second linear layer are zeroed (the rest scaled by 1 / (1 - p)); in evaluation it is the plain
    Linear -> ReLU -> Linear, under nn.Sequential's tensor names. The compressive blocks use the same module."""
    from models.base import FeedForward
    from models.compressive import CompressiveConfig, CompressiveTransformer

    torch.manual_seed(0)
    ff = FeedForward(16, 256, dropout=0.5)
    assert sorted(ff.state_dict()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    x = torch.randn(64, 16)
    relu = torch.relu(ff[0](x))
    seen: list[torch.Tensor] = []
    ff[2].register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    ff.train()(x)
    dropped = (seen[-1] == 0) & (relu > 0)
    assert 0.4 < float(dropped.sum() / (relu > 0).sum()) < 0.6  # about p of the active units
    kept = seen[-1] != 0
    torch.testing.assert_close(seen[-1][kept], relu[kept] * 2)
    with torch.no_grad():
        torch.testing.assert_close(ff.eval()(x), ff[2](relu))
    assert isinstance(_model(dropout=0.3).blocks[0].mlp, FeedForward)
    compressive = CompressiveTransformer(CompressiveConfig(d_model=16, n_layer=1, n_head=2, d_ff=32, segment=4,
                                                           mem_len=4, cmem_len=2, rate=2, dropout=0.3))
    assert isinstance(compressive.layers[0].mlp, FeedForward) and compressive.layers[0].mlp.dropout == 0.3


@pytest.mark.parametrize("cuts", [[1, 2, 3], [5, 11, 12], [7, 19, 30], [40]])
def test_state_carried_across_pieces_equals_one_forward(cuts: list[int]) -> None:
    """Within the window and past several slides: pieces with the K/V state equal one forward."""
    model = _model()
    x = _tokens(40, batch=3)
    adapter = Adapter({"resid": 0.1 * torch.randn(3, 20, 20, generator=torch.Generator().manual_seed(1))})
    with torch.no_grad():
        whole = model(x, model.init_state(3), adapter)
        state, parts = model.init_state(3), []
        for a, b in zip([0, *cuts], [*cuts, 40], strict=True):
            if b > a:
                out = model(x[:, a:b], state, adapter)
                state = out.state
                parts.append(out.logits)
    torch.testing.assert_close(torch.cat(parts, 1), whole.logits, rtol=1e-5, atol=1e-5)
    for k, v in whole.state.tensors.items():
        torch.testing.assert_close(state.tensors[k], v, rtol=1e-5, atol=1e-5)


def test_rows_at_different_fills_batch_like_each_alone() -> None:
    """Sessions with different histories slide at different times; a batch of them equals each row alone, state
    included."""
    assert_rows_batch_like_each_alone(_model())


@pytest.mark.parametrize("adapters", ["none", "one", "per row"])
def test_rows_that_slide_together_encode_their_common_start_once(adapters: str) -> None:
    """Rows of one history that differ in their last bytes (a keyboard search's branches, a prompt's choices) slide
    their windows together: the start they share is encoded once (under one adapter; rows under different adapters
    each alone), and every row's output and window equal its own forward alone."""
    model = _model(adapt_layer=0)  # a site after the first block: the adapter shapes later blocks' keys and values
    C, S, B = model.config.context, model.stride, 5
    history = _tokens(C - 3)
    tails = _tokens(4, B, seed=1)  # 3 bytes fill each window, the 4th slides it
    k = model.adaptation_sites()[0].adapter_size()
    gen = torch.Generator().manual_seed(2)
    mats = {"none": None, "one": 0.1 * torch.randn(1, k, k, generator=gen).expand(B, k, k),
            "per row": 0.1 * torch.randn(B, k, k, generator=gen)}[adapters]
    adapter = None if mats is None else Adapter({"resid": mats})
    with torch.no_grad():
        root = model(history, model.init_state(1)).state
        encoded: list[int] = []
        append = model._append

        def counting(tokens: torch.Tensor, *args: Any) -> Any:
            encoded.append(tokens.numel())
            return append(tokens, *args)

        model._append = counting  # type: ignore[method-assign]
        out = model(tails, root.take(torch.zeros(B, dtype=torch.long)), adapter)
        del model._append
        slid = sum(encoded) - B * tails.shape[1]  # the positions the slide re-encoded
        for b in range(B):
            alone = model(tails[b : b + 1], root, None if mats is None else Adapter({"resid": mats[b : b + 1]}))
            torch.testing.assert_close(out.logits[b : b + 1], alone.logits, rtol=1e-4, atol=1e-5)
            for name, value in alone.state.tensors.items():
                torch.testing.assert_close(out.state.tensors[name][b : b + 1], value, rtol=1e-4, atol=1e-5)
    kept = C - S  # each row's window keeps this many, of which all but its 3 own bytes are the history's
    assert slid == (B * kept if adapters == "per row" else kept - 3 + B * 3)


def test_generation_with_the_cache_equals_recomputation() -> None:
    """Greedy generation (one position per byte through the cache) is the argmax of a fresh forward over the whole
    text each time, past several slides of the window."""
    assert_greedy_generation_equals_recomputation(_model())


# -- trained: checkpoint, statistics, dynamic evaluation, server ------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("chartf_checkpoint")
    return out, train_on_test_data(make_config(None, {"arch": "char-transformer", "model": MODEL, **TRAINING}), out)


@pytest.fixture(scope="module")
def ckpt(trained: tuple[Path, Any]) -> Checkpoint:
    return load_checkpoint(trained[0])


def test_training_lowers_the_loss_and_the_checkpoint_loads_back(trained: tuple[Path, Any], ckpt: Checkpoint) -> None:
    import json

    out, result = trained
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    losses = [r["train_bpb"] for r in log if "train_bpb" in r]
    assert losses[-1] < losses[0], losses
    valid = [r["valid_bpb"] for r in log if "valid_bpb" in r]
    assert valid and math.isfinite(result.best_valid_bpb) and result.best_valid_bpb < 8.0
    assert isinstance(ckpt.model, CharTransformer) and ckpt.model.frozen
    # the checkpoint keeps the training-only heads (resumable) and loads back to identical logits
    assert all(n in dict(ckpt.model.named_parameters()) for n in ckpt.model.training_only_parameters())
    listed = json.loads((out / "config.json").read_text())["training_only_parameters"]
    assert listed == ckpt.model.training_only_parameters() and all(n.startswith("aux.") for n in listed)
    again = load_checkpoint(out).model
    x = _tokens(30, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(again(x, again.init_state(2)).logits, ckpt.model(x, ckpt.model.init_state(2)).logits,
                                   rtol=0, atol=0)
    ms_g = ckpt.stats["adapter.resid"]
    assert ms_g.shape == (32, 32) and bool((ms_g > 0).any()) and bool(torch.isfinite(ms_g).all())


def test_sparse_dynamic_evaluation_lowers_the_bits_of_a_repetitive_text(ckpt: Checkpoint) -> None:
    static_later, sparse_later, static, sparse = sparse_bits_on_repeats(ckpt.model)
    assert sparse_later < 0.9 * static_later, (static_later, sparse_later)
    assert sparse.adapted["resid"].shape == (32, 32)


def test_evaluate_many_equals_each_text_alone(ckpt: Checkpoint) -> None:
    """Batched sparse dynamic evaluation: rows whose windows slide at different times equal each text alone."""
    texts = [repetitive(57, seed=1), TEXT.encode(), repetitive(13, seed=2), b"x"]
    cfg = DynEvalConfig(mode="sparse", rule="sgd", lr=0.3, segment=10, adapter_units=20)
    for res, text in zip(evaluate_many(ckpt.model, texts, cfg, max_streams=3), texts, strict=True):
        alone = evaluate(ckpt.model, text, cfg)
        assert res.bytes == len(text)
        torch.testing.assert_close(torch.as_tensor(res.logprobs), torch.as_tensor(alone.logprobs), rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(res.adapted["resid"], alone.adapted["resid"], rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def client(trained: tuple[Path, Any]) -> Iterator[TestClient]:
    with served(trained[0]) as c:
        yield c


def test_session_observes_suggests_and_generates(client: TestClient) -> None:
    sid = create_session(client, adaptation={"lr": 0.03, "decay": 0.0})["id"]
    text = repetitive(100, seed=9).decode()
    seen = [observe_text(client, sid, text) for _ in range(3)]
    # the window (12 bytes) cannot see the repeat; the adapter learns it (RMS steps: lr 0.03 suits this model)
    assert seen[2]["bits"] < seen[0]["bits"] and seen[2]["bits"] < 0.9 * seen[2]["static_bits"], seen
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "a tru", "k": 3, "n_chars": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert all(w["text"].startswith("tru") for w in body["completions"]) and body["next_chars"]
    gen = client.post("/v1/generate", json={"prompt": " It", "max_tokens": 20, "temperature": 0.8, "seed": 3,
                                            "session_id": sid})
    assert gen.status_code == 200, gen.text
    assert len(gen.json()["text"]) > 0


# -- full dynamic evaluation, of every layer or the later ones only (thesis ch. 6) ----------------------------


def test_parameter_layers() -> None:
    model = _model()  # 3 blocks
    layers = {n: model.parameter_layer(n) for n, _ in model.named_parameters()}
    assert layers["embed.weight"] == -1 and layers["pos"] == 0
    assert layers["blocks.0.qkv.weight"] == 0 and layers["blocks.2.mlp.2.bias"] == 2
    assert layers["ln_f.weight"] == layers["head.weight"] == 3
    assert all(layers[n] is None for n in model.training_only_parameters())
    from models.mlstm import MLSTM, MLSTMConfig  # one layer: the interface's default

    mlstm = MLSTM(MLSTMConfig(hidden=8, embed_dim=4))
    assert {mlstm.parameter_layer(n) for n, _ in mlstm.named_parameters()} == {0}
    with pytest.raises(ValueError, match="layers_from 1 leaves no parameter"):
        evaluate(mlstm, b"abc", DynEvalConfig(mode="full", layers_from=1))


def test_full_dynamic_evaluation_adapts_without_the_training_only_heads() -> None:
    """The training-only heads get no gradient from the scored loss: full mode leaves them out (it failed on them)."""
    model = _model()
    res = evaluate(model, TEXT.encode(), DynEvalConfig(mode="full", rule="sgd", lr=0.1, segment=10))
    inference = {n: p.numel() for n, p in model.named_parameters() if not n.startswith("aux.")}
    assert set(res.adapted) == set(inference) and res.params_adapted == sum(inference.values())
    assert res.skipped_updates == 0 and math.isfinite(res.bits)


def test_full_dynamic_evaluation_of_the_later_layers_only() -> None:
    model = _model()
    text = repetitive(60, seed=4) * 2
    cfg = DynEvalConfig(mode="full", rule="sgd", lr=0.3, segment=12)
    every = evaluate(model, text, cfg)
    later = evaluate(model, text, replace(cfg, layers_from=2))
    names = adapted_parameter_names(model, replace(cfg, layers_from=2))
    assert names == [n for n, _ in model.named_parameters() if n.startswith(("blocks.2.", "ln_f.", "head."))]
    assert set(later.adapted) == set(names) and later.params_adapted < every.params_adapted
    # the copy FullStream adapts: block 2 and the output layers moved, everything below stayed where it was
    stream = FullStream(model, replace(cfg, layers_from=2))
    x, y = torch.tensor([list(text[:-1])]), torch.tensor([list(text[1:])])
    for i in range(0, x.shape[1], 12):
        stream.step(x[:, i : i + 12], y[:, i : i + 12])
    original, adapted = dict(model.named_parameters()), dict(stream.model.named_parameters())
    for n, p in adapted.items():
        if n in names:
            assert not torch.equal(p, original[n]), n
        else:
            assert torch.equal(p, original[n]), n
    # the first segment is scored before any update (the same bits), the later ones differ from adapting every layer
    assert later.logprobs[:12] == pytest.approx(every.logprobs[:12], abs=1e-6)
    assert abs(later.bits - every.bits) > 1e-3
    # through dyneval.json's full section
    settings = DynEvalSettings({"full": {"rule": "sgd", "lr": 0.3, "segment": 12, "layers_from": 2}})
    assert settings.config("dynamic").layers_from == 2
    assert DynEvalConfig.from_dict(later_cfg := replace(cfg, layers_from=2).to_dict()) == replace(cfg, layers_from=2)
    assert later_cfg["layers_from"] == 2
    with pytest.raises(ValueError, match="layers_from must be >= 0"):
        DynEvalConfig(layers_from=-1)
    with pytest.raises(ValueError, match="sit in layers up to 3"):
        evaluate(model, text, replace(cfg, layers_from=4))


def test_shipped_without_the_training_only_heads_loads_to_the_same_logits(ckpt: Checkpoint, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from models.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "full", ckpt.model, stats=ckpt.stats, dyneval=dict(ckpt.dyneval), card="# c\n")
    save_checkpoint(tmp_path / "slim", ckpt.model, stats=ckpt.stats, dyneval=dict(ckpt.dyneval), card="# c\n",
                    training_only=False)
    aux = ckpt.model.training_only_parameters()
    slim_weights = load_file(str(tmp_path / "slim" / "model.safetensors"))
    assert not set(aux) & set(slim_weights) and set(aux) <= set(load_file(str(tmp_path / "full" / "model.safetensors")))
    assert not any(k.startswith("param.aux.") for k in load_file(str(tmp_path / "slim" / "stats.safetensors")))
    slim, full = load_checkpoint(tmp_path / "slim"), load_checkpoint(tmp_path / "full")
    assert slim.meta["training_only_parameters"] == aux and slim.meta["training_only_parameters_shipped"] is False
    x = _tokens(30, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(slim.model(x, slim.model.init_state(2)).logits,
                                   full.model(x, full.model.init_state(2)).logits, rtol=0, atol=0)
    cfg = DynEvalConfig(mode="full", rule="sgd", lr=0.1, segment=10)
    assert evaluate(slim.model, TEXT.encode(), cfg).bits == evaluate(full.model, TEXT.encode(), cfg).bits


def test_tune_and_eval_full_and_sparse_from_the_command_line(trained: tuple[Path, Any], tmp_path: Path) -> None:
    """`adaptlm tune` on a transformer checkpoint (its MS_g statistics cover every inference weight), then `adaptlm
    eval` with the tuned settings and with the later layers only."""
    import json
    import shutil

    from tests._cli import run_cli

    ck = tmp_path / "ck"
    shutil.copytree(trained[0], ck)

    def run(*args: str) -> Any:
        r = run_cli(*args)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    tuned = run("tune", "--checkpoint", str(ck), "--valid", str(VALID), "--bytes", "600", "--max-trials", "5",
                "--device", "cpu", "--layers-from", "1")
    dyneval = json.loads((ck / "dyneval.json").read_text())
    assert dyneval["full"]["layers_from"] == 1 and tuned["full"]["trials"] <= 5
    assert dyneval["full"]["valid_bpb"] <= dyneval["full"]["valid_static_bpb"]
    assert dyneval["sparse"]["valid_bpb"] <= dyneval["sparse"]["valid_static_bpb"]
    base = ("eval", "--checkpoint", str(ck), str(VALID), "--limit", "600", "--device", "cpu", "--json")
    full, sparse = run(*base, "--mode", "dynamic,sparse")
    assert full["layers_from"] == 1 and full["bits_per_byte"] == pytest.approx(dyneval["full"]["valid_bpb"])
    assert sparse["bits_per_byte"] == pytest.approx(dyneval["sparse"]["valid_bpb"])
    every = run(*base, "--mode", "dynamic", "--layers-from", "0")
    assert "layers_from" not in every and every["params_adapted"] > full["params_adapted"]
