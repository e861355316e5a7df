"""The Compressive Transformer (models/compressive.py) through the whole stack: causality across memories, relative
attention against a reference that builds the full score matrix, the FIFO and its compression, the gradient
isolation of the reconstruction loss, stream invariance (pieces equal one forward), checkpoints, training, sparse
and full dynamic evaluation, and sessions over HTTP (suggest, generate, export/import, the Redis store).

References are computed in the same run (the model's own forward, independent code); no numbers from one machine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from safetensors.torch import load as safetensors_load

from kernels.compress import compress_memory_ref
from models.adaptation import DynEvalConfig, evaluate
from models.base import Adapter, State
from models.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from models.compressive import COMPRESSIONS, CompressiveConfig, CompressiveTransformer
from models.registry import REGISTRY, build_model, config_from_dict
from models.sampling import SamplingParams, generate
from models.scoring import BOS, score_bytes
from models.suggest import advance, suggest
from tests._families import (
    assert_evaluate_many_equals_each_text_alone,
    assert_greedy_generation_equals_recomputation,
    assert_rows_batch_like_each_alone,
    assert_states_close,
    create_session,
    input_dependence,
    observe_text,
    served,
)
from tests._training import repetitive, sparse_bits_on_repeats, train_on_test_data
from trainer.config import make_config
from trainer.train import evaluate_bpb

DATA = Path(__file__).resolve().parent.parent / "data"
VALID = DATA / "valid.txt"
# S = 6, n_m = 9 (not a multiple of S: the first eviction is partial), n_cm = 4, c = 3
MODEL = {"d_model": 16, "n_layer": 2, "n_head": 2, "d_ff": 32, "segment": 6, "mem_len": 9, "cmem_len": 4, "rate": 3}
# 40 steps: validation 4.5 bits per byte against the untrained 8.4 (1 bit asked), train_bpb down 1.6 (0.5 asked)
TRAINING = {"max_steps": 40, "valid_every": 20, "valid_bytes": 2000, "stats_batches": 2, "stats_batch_size": 4,
            "log_every": 10, "threads": 1}
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."
MORE = "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this"


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed: int = 0, **overrides: Any) -> CompressiveTransformer:
    torch.manual_seed(seed)
    return CompressiveTransformer(CompressiveConfig(**{**MODEL, **overrides})).eval()


def _tokens(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _run(model: CompressiveTransformer, x: torch.Tensor, cuts: list[int], state: State | None = None,
         adapter: Adapter | None = None) -> tuple[torch.Tensor, State]:
    """x fed in pieces ending at `cuts` (and at its end), the state carried -> logits (B, T, V), final state."""
    state = model.init_state(x.shape[0]) if state is None else state
    parts, start = [], 0
    for cut in [*cuts, x.shape[1]]:
        if cut > start:
            out = model(x[:, start:cut], state, adapter)
            state, start = out.state, cut
            parts.append(out.logits)
    return torch.cat(parts, 1), state


def _record_inputs(model: CompressiveTransformer) -> tuple[list[list[torch.Tensor]], list[Any]]:
    """Forward pre-hooks that record every block's layer inputs x (B, m, D), piece by piece."""
    seen: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    hooks = [b.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(args[0].detach()))
             for i, b in enumerate(model.blocks)]
    return seen, hooks


# -- the model itself -------------------------------------------------------------------------------------


def test_registered_config_round_trips_and_invalid_configs_are_refused() -> None:
    assert REGISTRY["compressive"] == (CompressiveConfig, CompressiveTransformer)
    for mode in COMPRESSIONS:
        cfg = CompressiveConfig(**MODEL, compression=mode)
        assert config_from_dict(cfg.to_dict()) == cfg
        assert isinstance(build_model(cfg), CompressiveTransformer)
    tiny = make_config("tiny", {"arch": "compressive"})
    model = build_model(config_from_dict({"arch": tiny.arch, **tiny.model}))
    assert isinstance(model, CompressiveTransformer) and model.training_only_parameters() == []
    for bad in ({"segment": 7}, {"mem_len": 8}, {"cmem_len": -1}, {"compression": "zip"}, {"adapt_layer": 2},
                {"n_head": 3}):
        with pytest.raises(ValueError):
            CompressiveTransformer(CompressiveConfig(**{**MODEL, **bad}))


@pytest.mark.parametrize("training", [False, True])
def test_causal_gradient_of_output_t_wrt_later_inputs_is_zero(training: bool) -> None:
    """d logits_t / d input_s = 0 exactly for s > t, over several segments with evictions and compression. Memories
    are stop-gradient, so the gradient reaches exactly the inputs s <= t of t's own segment. The bytes are distinct,
    so a probe added to the embedding of byte x_s is input s."""
    model = _model(compression="conv").train(training)
    T, S = 31, model.config.segment  # 5 segments of 6 and one byte: evictions at 12, 18, 24, 30
    for t, seen in enumerate(input_dependence(model, T)):
        assert seen == [t // S * S <= s <= t for s in range(T)], t


@pytest.mark.parametrize("mode", COMPRESSIONS)
def test_causal_values_across_memory(mode: str) -> None:
    """A changed input s leaves every output before s bit-identical and changes outputs long after it, reached only
    through the memory and, later, the compressed memory."""
    model = _model(compression=mode)
    T, s = 60, 10
    x = _tokens(T)
    y = x.clone()
    y[0, s] = (y[0, s] + 1) % 256
    with torch.no_grad():
        a, b = model(x, model.init_state(1)).logits, model(y, model.init_state(1)).logits
    torch.testing.assert_close(a[:, :s], b[:, :s], rtol=0, atol=0)
    # input 10 sits in segment 1 (bytes 6..11); it is evicted from the fine memory at 24 (n_m = 9) and lives on in
    # the compressed memory until four more compressed slots push it out
    assert not torch.allclose(a[:, 12:24], b[:, 12:24])
    assert not torch.allclose(a[:, 24:30], b[:, 24:30])


def _sinusoid_ref(d: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer-XL's R for a tensor of distances d (...) -> (..., dim): sin then cos of d / 10000^(2i/dim)."""
    freq = torch.tensor([10000.0 ** (-2 * i / dim) for i in range(dim // 2)])
    ang = d.unsqueeze(-1).float() * freq  # (..., dim/2)
    return torch.cat([ang.sin(), ang.cos()], -1)


def _reference_logits(model: CompressiveTransformer, state: State, tokens: torch.Tensor) -> torch.Tensor:
    """One row, a piece within one segment, written from the definitions: the keys are the valid compressed slots,
    the valid fine slots and the piece; every (query, key) score is built in full, with the positional term of the
    sinusoid of their distance (Transformer-XL sec. 3.3), masked where the key is later. -> logits (m, V)."""
    cfg = model.config
    S, Nm, c, D, H = cfg.segment, cfg.mem_len, cfg.rate, cfg.d_model, cfg.n_head
    Dh = D // H
    seen = int(state.tensors["seen"])
    p = seen % S
    assert p + tokens.shape[1] <= S
    n_f, n_c = min(seen, Nm + p), min(cfg.cmem_len, max(0, seen - p - Nm) // c)
    x = model.embed(tokens[0])  # (m, D)
    m = x.shape[0]
    for i, blk in enumerate(model.blocks):
        mem = state.tensors[f"mem{i}"][0]
        cmem = state.tensors[f"cmem{i}"][0]
        keys = torch.cat([cmem[cmem.shape[0] - n_c :], mem[mem.shape[0] - n_f :], x])  # (Lk, D)
        assert bool((cmem[: cmem.shape[0] - n_c] == 0).all()) and bool((mem[: mem.shape[0] - n_f] == 0).all())
        Lk = keys.shape[0]
        h = blk.ln1(keys)
        q = blk.q(h[Lk - m :]).view(m, H, Dh)
        k, v = (t.view(Lk, H, Dh) for t in blk.kv(h).chunk(2, -1))
        dist = torch.arange(Lk - m, Lk).view(m, 1) - torch.arange(Lk).view(1, Lk)  # (m, Lk) query pos - key pos
        r = blk.r_net(_sinusoid_ref(dist.clamp(min=0), D)).view(m, Lk, H, Dh)  # (m, Lk, H, Dh)
        scores = torch.einsum("ihd,jhd->hij", q + blk.u, k) + torch.einsum("ihd,ijhd->hij", q + blk.v, r)
        scores = (scores / math.sqrt(Dh)).masked_fill(dist < 0, -math.inf)  # (H, m, Lk)
        att = torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v).reshape(m, D)
        x = x + blk.proj(att)
        x = x + blk.mlp(blk.ln2(x))
    return model.head(model.ln_f(x))


@pytest.mark.parametrize(("histories", "m"), [((0, 3, 11, 13, 29, 40), 1), ((0, 12, 30), 4), ((6, 24), 6),
                                               ((26, 33), 3)])
def test_relative_attention_by_distance_equals_a_full_score_reference(histories: tuple[int, ...], m: int) -> None:
    """Rows at different fills (empty, filling, pending bytes, full compressed memory), batched: each row's logits
    equal the reference built from the definitions. u and v are drawn away from their zero initialisation, so that
    the global content and positional biases (Transformer-XL terms (c), (d)) are checked too."""
    model = _model()
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for blk in model.layers:
            blk.u.copy_(torch.randn(blk.u.shape, generator=g))
            blk.v.copy_(2 * torch.randn(blk.v.shape, generator=g))
        states = [model(_tokens(n, seed=n), model.init_state(1)).state if n else model.init_state(1)
                  for n in histories]
        x = _tokens(m, batch=len(histories), seed=99)
        batched = model(x, State.stack(states)).logits
        for r, st in enumerate(states):
            torch.testing.assert_close(batched[r], _reference_logits(model, st, x[r : r + 1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["mean", "max", "conv", "dilated"])
@pytest.mark.parametrize("n", [5, 14, 23, 47])
def test_the_fifo_keeps_the_last_inputs_and_compresses_exactly_the_evicted_slots(mode: str, n: int) -> None:
    """After n bytes (fed in uneven pieces), each layer's fine memory is exactly its last min(n, n_m + p) inputs
    (p = n mod S) and its compressed memory exactly f of the evicted ones, c at a time from the stream's start, the
    newest n_cm kept; zeros elsewhere."""
    model = _model(compression=mode)
    cfg = model.config
    S, Nm, c, Ncm = cfg.segment, cfg.mem_len, cfg.rate, cfg.cmem_len
    inputs, hooks = _record_inputs(model)
    try:
        with torch.no_grad():
            _, state = _run(model, _tokens(n, batch=2), [1, 2, 9, 10, 20])
    finally:
        for h in hooks:
            h.remove()
    evicted = max(0, n // S * S - Nm)
    for i, block in enumerate(model.blocks):
        h = torch.cat(inputs[i], 1)  # (2, n, D) layer i's inputs, in stream order
        mem, cmem = state.tensors[f"mem{i}"], state.tensors[f"cmem{i}"]
        fine = h[:, evicted:]
        torch.testing.assert_close(mem[:, mem.shape[1] - fine.shape[1] :], fine, rtol=0, atol=0)
        assert bool((mem[:, : mem.shape[1] - fine.shape[1]] == 0).all())
        kept = min(Ncm, evicted // c)
        if kept:
            with torch.no_grad():
                if mode == "dilated":  # f on each eviction's window (S slots, zero padding where the memory filled)
                    windows = []
                    for end in range(S * (Nm // S + 1), n // S * S + 1, S):
                        start, stop = end - Nm - S, end - Nm
                        win = h[:, max(0, start) : stop]
                        win = F.pad(win, (0, 0, S - win.shape[1], 0))
                        windows.append(block.compressor(win)[:, (S - (stop - max(0, start))) // c :])
                    comp = torch.cat(windows, 1)
                else:
                    w = block.compressor.weight if mode == "conv" else None
                    b = block.compressor.bias if mode == "conv" else None
                    comp = compress_memory_ref(h[:, :evicted], rate=c, mode=mode, weight=w, bias=b)  # (2, e/c, D)
            torch.testing.assert_close(cmem[:, Ncm - kept :], comp[:, -kept:], rtol=1e-5, atol=1e-6)
        assert bool((cmem[:, : Ncm - kept] == 0).all())
        assert state.tensors["seen"].tolist() == [n, n]


@pytest.mark.parametrize("mode", ["conv", "max"])
def test_without_a_compressed_memory_evictions_drop_and_nothing_compresses(mode: str) -> None:
    """cmem_len 0 is Transformer-XL's memory: no f (no parameters), no compressed slots, the fine memory the last
    inputs as ever; the same weights give the compressive model's logits exactly until its first compressed slot
    is attended (the first n_m + S bytes), and different ones after; pieces equal one forward; no recon loss."""
    none = _model(compression=mode, cmem_len=0)
    assert all(b.compressor is None for b in none.blocks)
    assert not any("compressor" in name for name, _ in none.named_parameters())
    full = _model(compression=mode)
    full.load_state_dict(none.state_dict(), strict=False)  # everything but f
    S, Nm = none.config.segment, none.config.mem_len
    n = 47
    x = _tokens(n, batch=2)
    inputs, hooks = _record_inputs(none)
    try:
        with torch.no_grad():
            logits, state = _run(none, x, [1, 2, 9, 10, 20])
    finally:
        for h in hooks:
            h.remove()
    for i in range(none.config.n_layer):
        assert state.tensors[f"cmem{i}"].shape == (2, 0, none.config.d_model)
        fine = torch.cat(inputs[i], 1)[:, max(0, n // S * S - Nm) :]
        mem = state.tensors[f"mem{i}"]
        torch.testing.assert_close(mem[:, mem.shape[1] - fine.shape[1] :], fine, rtol=0, atol=0)
    with torch.no_grad():
        whole = none(x, none.init_state(2))
        ref = full(x, full.init_state(2)).logits
    torch.testing.assert_close(logits, whole.logits, rtol=1e-5, atol=1e-5)
    first = (Nm // S + 1) * S  # the first segment end past n_m evicts: bytes before it never see a compressed slot
    torch.testing.assert_close(whole.logits[:, :first], ref[:, :first], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole.logits[:, first:], ref[:, first:], atol=1e-4)
    out = none.train()(x[:, :30], none.init_state(2))
    assert "recon" not in out.aux and torch.isfinite(out.logits).all()


def _usage_ref(block: Any, h: torch.Tensor, q_start: int, k_start: int, stop: int) -> torch.Tensor:
    """Average content-only attention of the queries h[q_start:stop] over the keys h[k_start:stop] (causal),
    written out: h (T, D) -> (stop - k_start,)."""
    H = block.n_head
    D = h.shape[1]
    z = block.ln1(h)
    q = block.q(z[q_start:stop]).view(-1, H, D // H).transpose(0, 1)  # (H, Lq, Dh)
    k = block.kv(z[k_start:stop])[:, :D].view(-1, H, D // H).transpose(0, 1)  # (H, Lk, Dh)
    scores = q @ k.transpose(1, 2) / math.sqrt(D // H)
    later = torch.arange(k_start, stop).view(1, -1) > torch.arange(q_start, stop).view(-1, 1)
    return torch.softmax(scores.masked_fill(later, -math.inf), -1).mean((0, 1))


def test_most_used_keeps_the_most_attended_evicted_slots_in_order() -> None:
    """Evictions at 12 (3 slots: keep 1) and 18 (6 slots: keep 2): the compressed memory holds, oldest first, the
    evicted inputs that the completing segment's queries attended to most (average content-only attention)."""
    model = _model(compression="most_used")
    S, Nm, c = 6, 9, 3
    inputs, hooks = _record_inputs(model)
    try:
        with torch.no_grad():
            _, state = _run(model, _tokens(20, seed=5), [4, 13])
    finally:
        for hk in hooks:
            hk.remove()
    for i, block in enumerate(model.blocks):
        h = torch.cat(inputs[i], 1)[0]  # (20, D)
        expected = []
        with torch.no_grad():
            for end in (12, 18):
                first, last = max(0, end - S - Nm), end - Nm  # the evicted slots [first, last)
                usage = _usage_ref(block, h, end - S, first, end)[: last - first]
                top = usage.topk((last - first) // c).indices.sort().values + first
                expected.append(h[top])
        want = torch.cat(expected)  # (3, D)
        torch.testing.assert_close(state.tensors[f"cmem{i}"][0, -3:], want, rtol=0, atol=0)
        assert bool((state.tensors[f"cmem{i}"][0, :-3] == 0).all())


def test_reconstruction_loss_and_compressed_memory_equal_the_papers_formulas_by_hand() -> None:
    """Sec. 3.2 "Attention": at each eviction || attn(x, E) - attn(x, f(E)) ||^2 with x the completing segment's layer
    inputs, E the evicted ones, content-only multi-head attention with the layer's LN, Q, K, V (mean squared error
    here, averaged over the evictions of the call); sec. 3.1: cmem holds f(E) of each evicted segment in order."""
    model = _model(n_layer=1, mem_len=6, cmem_len=4).train()  # segment 6, c = 3: 18 bytes evict twice
    block = model.layers[0]
    compressor = block.compressor_
    with torch.no_grad():  # a conv that is not mean pooling
        compressor.weight.add_(0.1 * torch.randn(compressor.weight.shape, generator=torch.Generator().manual_seed(1)))
    x = _tokens(18, batch=2, seed=2)
    out = model(x, model.init_state(2))
    e = model.embed(x).detach()  # (2, 18, D) layer 0's inputs (dropout 0)

    def f(old: torch.Tensor) -> torch.Tensor:
        return F.conv1d(old.transpose(1, 2), compressor.weight, compressor.bias, stride=3).transpose(1, 2)

    def attn(h: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(2, t.shape[1], 2, 8).transpose(1, 2)  # (2, H, L, Dh)
        k, v = block.kv(block.ln1(mem)).chunk(2, -1)
        q = block.q(block.ln1(h))
        return torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / 8**0.5, -1) @ heads(v)

    evictions = [(e[:, 6:12], e[:, 0:6]), (e[:, 12:18], e[:, 6:12])]  # (queries' inputs, evicted inputs)
    want = torch.stack([(attn(seg, old) - attn(seg, f(old))).pow(2).mean() for seg, old in evictions]).mean()
    torch.testing.assert_close(out.aux["recon"], model.config.recon_weight * want)
    torch.testing.assert_close(out.state.tensors["cmem0"], torch.cat([f(e[:, 0:6]), f(e[:, 6:12])], 1))
    torch.testing.assert_close(out.state.tensors["mem0"][:, -6:], e[:, 12:18])


@pytest.mark.parametrize("mode", ["conv", "dilated"])
def test_gradient_isolation_of_the_reconstruction_loss(mode: str) -> None:
    """The LM loss gives the compressor no gradient; the reconstruction loss gives every other weight none (the
    layer's LN, Q, K, V enter it as detached copies), and the weights keep requires_grad."""
    model = _model(compression=mode).train()
    x = _tokens(31, batch=2)
    out = model(x[:, :-1], model.init_state(2))
    nll = -model.target_logprobs(out, x[:, 1:]).mean()
    recon = out.aux["recon"]
    assert recon.dim() == 0 and float(recon.detach()) > 0
    named = dict(model.named_parameters())
    comp = {n: p for n, p in named.items() if ".compressor." in n}
    rest = {n: p for n, p in named.items() if n not in comp}
    assert comp and all(p.requires_grad for p in named.values())
    for g in torch.autograd.grad(nll, list(comp.values()), allow_unused=True, retain_graph=True):
        assert g is None
    for n, g in zip(rest, torch.autograd.grad(recon, list(rest.values()), allow_unused=True, retain_graph=True),
                    strict=True):
        assert g is None, n
    grads = torch.autograd.grad(recon, list(comp.values()))
    for n, g in zip(comp, grads, strict=True):
        if n.endswith("compressor.weight"):
            assert float(g.abs().sum()) > 0, n
    lm = dict(zip(rest, torch.autograd.grad(nll, list(rest.values()), allow_unused=True), strict=True))
    for i in range(model.config.n_layer):
        for name in ("q.weight", "kv.weight", "r_net.weight", "u", "v"):
            g = lm[f"blocks.{i}.{name}"]
            assert g is not None and float(g.abs().sum()) > 0, (i, name)


def test_kv_projections_get_lm_gradients_after_many_segments() -> None:
    """Training steps over a stream (state carried, detached, as the trainer does): every layer's K/V projection
    keeps taking the LM loss's gradient, equal to the gradient of the LM loss alone (the reconstruction term adds
    nothing to it), and the compressor's gradient is the reconstruction loss's alone."""
    model = _model(compression="conv").train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = _tokens(8 * 6 + 1, batch=2, seed=3)
    state = model.init_state(2)
    for step in range(8):
        chunk = x[:, 6 * step : 6 * step + 7]
        out = model(chunk[:, :-1], state)
        loss = model.loss(out, chunk[:, 1:])
        nll = -model.target_logprobs(out, chunk[:, 1:]).mean()
        kv = [b.kv.weight for b in model.blocks]
        expected = torch.autograd.grad(nll, kv, retain_graph=True)
        opt.zero_grad()
        loss.backward()
        for b, g in zip(model.blocks, expected, strict=True):
            assert b.kv.weight.grad is not None and float(b.kv.weight.grad.abs().sum()) > 0
            torch.testing.assert_close(b.kv.weight.grad, g, rtol=0, atol=0)
            assert b.compressor.weight.grad is not None  # the 0 x f term of a call without eviction: a zero grad
            if 6 * (step + 1) > 9:  # this call evicted
                assert float(b.compressor.weight.grad.abs().sum()) > 0
        opt.step()
        state = out.state.detach()
    assert int(state.tensors["seen"][0]) == 48 and all(p.requires_grad for p in model.parameters())


def _stale(state: State) -> State:
    """The state with every layer's key/value cache marked stale (its fingerprints NaN): the next call projects the
    whole memory afresh, as the model did before it had a cache."""
    return State({k: torch.full_like(v, math.nan) if k.startswith("memo.sig") else v for k, v in state.tensors.items()})


def _count_projections(model: CompressiveTransformer) -> list[int]:
    """Rows each call of every block's `project` (the memory's keys and values afresh, or new compressed slots)
    receives, recorded in order."""
    rows: list[int] = []
    for block in model.blocks:
        inner = block.project
        block.project = lambda keys, inner=inner: (rows.append(keys.shape[1]), inner(keys))[1]  # type: ignore
    return rows


@pytest.mark.parametrize("mode", ["conv", "most_used"])
def test_the_key_value_cache_equals_projecting_the_memory_afresh(mode: str) -> None:
    """Byte by byte with frozen weights, each memory slot is projected once (a compressed slot when it is made),
    and logits and state equal a run that projects the whole memory afresh at every call."""
    model = _model(compression=mode)
    cfg = model.config
    x = _tokens(40, batch=2, seed=5)
    adapter = Adapter({"resid": 0.1 * torch.randn(2, 10, 10, generator=torch.Generator().manual_seed(2))})
    rows = _count_projections(model)
    runs = []
    for stale in (False, True):
        state, logits = model.init_state(2), []
        with torch.no_grad():
            for t in range(x.shape[1]):
                out = model(x[:, t : t + 1], _stale(state) if stale else state, adapter)
                state = out.state
                logits.append(out.logits)
        runs.append((state, torch.cat(logits, 1), sum(rows)))
        rows.clear()
    (cached, a, projected), (fresh, b, afresh) = runs
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    evictions = len(range(cfg.mem_len // cfg.segment + 1, x.shape[1] // cfg.segment + 1))  # segment ends past n_m
    assert projected == cfg.n_layer * evictions * cfg.segment // cfg.rate  # only the new compressed slots
    assert afresh > 10 * projected
    assert_states_close(cached.persistent(), fresh.persistent(), rtol=1e-5, atol=1e-6)
    n_f, n_c = model.fills(cached.tensors["seen"])
    assert int(n_c.min()) > 0
    with torch.no_grad():  # the cache's valid slots are the projections of the memories' valid slots
        for i, block in enumerate(model.blocks):
            for b in range(2):
                for name, n in (("mem", int(n_f[b])), ("cmem", int(n_c[b]))):
                    slots = cached.tensors[f"{name}{i}"][b, -n:]
                    torch.testing.assert_close(cached.tensors[f"memo.kv_{name}{i}"][b, -n:], block.project(slots),
                                               rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(cached.tensors["memo.sig0"]).all())


@pytest.mark.parametrize("mode", [*COMPRESSIONS, "none"])
@pytest.mark.parametrize("history", [8, 15])
def test_rows_that_close_a_segment_together_close_it_once(mode: str, history: int) -> None:
    """A search's branches in the branch form (rows on one root, each its own bytes and adapter) that close their
    segment in the same step close it once: f compresses the slots the root evicts for all of them, and the rows
    step on over one new root, their tails kept. Every row's log-probs and settled state equal its own usual
    forward alone. After 15 bytes the closes at 18 and 24 are over the root (tails of 3 and 9 bytes), the one at 30
    on the usual path (a tail of 15 > n_m); after 8, the close at 12 (a partial window: 3 slots evicted) is over
    the root, the one at 18 on the usual path, the one at 24 over each row's own root. With "most_used" f (each row
    weighs the slots by its own segment's queries) every row compresses its own; without a compressed memory
    ("none") the evicted slots drop."""
    # the site after the first block: the adapter shapes the tails
    model = _model(adapt_layer=0, **({"cmem_len": 0} if mode == "none" else {"compression": mode}))
    B, T = 5, 16
    tails = _tokens(T, B, seed=history)
    k = model.adaptation_sites()[0].adapter_size()
    mats = 0.1 * torch.randn(B, k, k, generator=torch.Generator().manual_seed(3))
    compressed: list[int] = []  # the rows of every call of f
    for block in model.layers if mode != "none" else []:
        inner = block.compressor_.forward
        block.compressor_.forward = (  # type: ignore[method-assign]
            lambda win, usage=None, inner=inner: (compressed.append(win.shape[0]), inner(win, usage))[1])
    shared = [] if mode == "most_used" else {8: [12], 15: [18, 24]}[history]
    with torch.no_grad():
        root = model(_tokens(history, seed=1), model.init_state(1)).state
        compressed.clear()
        state, logprobs = model.branch(root).take(torch.zeros(B, dtype=torch.long)), []
        for j in range(T):
            out = model(tails[:, j : j + 1], state, Adapter({"resid": mats}))
            state = out.state
            logprobs.append(model.log_probs(out))
            if history + j + 1 in shared:  # closed over the root: one new root, the tails kept
                assert len(state.roots) == 1 and state.tensors["memo.tail_n"].tolist() == [j + 1] * B
        rows = sum(compressed)
        settled = model.settle(state)
        for b in range(B):
            alone = model(tails[b : b + 1], root, Adapter({"resid": mats[b : b + 1]}))
            torch.testing.assert_close(torch.cat(logprobs, 1)[b : b + 1], model.log_probs(alone), rtol=1e-4,
                                       atol=1e-5)
            assert_states_close(settled.select(b), alone.state, rtol=1e-4, atol=1e-5)
    if mode != "none":
        assert rows == model.config.n_layer * (3 * B if mode == "most_used" else {8: 1 + 2 * B, 15: 2 + B}[history])


def test_a_close_that_evicts_nothing_keeps_the_root() -> None:
    """While the fine memory fills (the close at 6 of n_m = 9), a close in the branch form changes no memory: the rows
    that close stay on the root they share with rows that do not (once in the roots, not twice), their tails kept."""
    model = _model()
    with torch.no_grad():
        branched = model.branch(model(_tokens(2, seed=1), model.init_state(1)).state)
        state = branched.take(torch.zeros(3, dtype=torch.long))
        for j in range(3):
            state = model(_tokens(1, 3, seed=j), state).state
        state = State.stack([state, branched])  # three rows after 5 bytes, one after 2, on one root
        state = model(_tokens(1, 4, seed=3), state).state  # the three close the first segment
    assert state.roots == branched.roots and state.tensors["memo.tail_n"].tolist() == [4, 4, 4, 1]

def test_a_stale_cache_is_projected_afresh() -> None:
    """Weights changed in place (as full dynamic evaluation changes them) or needing a gradient: the call projects
    the memory afresh, and its keys still carry the gradient to the K/V weights."""
    model = _model()
    x = _tokens(30, batch=1, seed=6)
    with torch.no_grad():
        state = model(x[:, :25], model.init_state(1)).state
        model.blocks[1].kv.weight.add_(0.05 * torch.randn_like(model.blocks[1].kv.weight))
        after = model(x[:, 25:], state).logits
        ref = model(x[:, 25:], _stale(state)).logits
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        state = model(x[:, 25:], state).state  # 30 bytes: 9 fine slots and 4 compressed ones, the cache fresh
    rows = _count_projections(model)
    out = model(x[:, 25:26], state)  # grad enabled and the weights require it: projected afresh
    assert rows == [9 + 4] * model.config.n_layer
    out.logits.sum().backward()
    assert float(model.blocks[0].kv.weight.grad.abs().sum()) > 0


def test_stale_rows_at_different_fills_batch_like_each_alone() -> None:
    """Rows whose caches are stale (imported or fresh sessions) at different fills, in one call: each row's state,
    its key/value cache included, equals the row's alone; the cache holds zeros outside the valid slots, as a row
    alone has them (the branch form's roots rely on it: models/_branches.py)."""
    model = _model()
    with torch.no_grad():
        states = [_stale(model(_tokens(n, seed=n), model.init_state(1)).state) for n in (3, 11, 40)]
    states.append(model.init_state(1))  # a fresh row: nothing seen
    assert_rows_batch_like_each_alone(model, states=states, steps=2)


def test_training_keeps_no_cache_and_exports_leave_it_out() -> None:
    """Training mode marks the cache stale (weights move every step); `State.persistent` drops the memo tensors."""
    model = _model().train()
    out = model(_tokens(20, batch=2), model.init_state(2))
    assert all(bool(out.state.tensors[f"memo.sig{i}"].isnan().all()) for i in range(model.config.n_layer))
    kept = out.state.persistent().tensors
    assert kept and not any(k.startswith("memo.") for k in kept)
    assert set(out.state.tensors) - set(kept) == {f"memo.{n}{i}" for n in ("kv_mem", "kv_cmem", "sig")
                                                   for i in range(model.config.n_layer)}


@pytest.mark.parametrize("mode", COMPRESSIONS)
@pytest.mark.parametrize("cuts", [[1, 2, 3], [5, 11, 12], [7, 19, 30, 31], list(range(1, 47))])
def test_pieces_with_the_state_equal_one_forward(mode: str, cuts: list[int]) -> None:
    """Stream invariance: any cutting of the stream into calls (bytes one at a time included) gives the one long
    forward's logits and state, with an adapter, for every compression function (float summation order aside).
    Only the values agree in every case: the gradients agree when the cuts fall on the segment grid (within a
    segment, a cut makes the earlier bytes' inputs stop-gradient memory)."""
    model = _model(compression=mode)
    x = _tokens(47, batch=2)
    adapter = Adapter({"resid": 0.1 * torch.randn(2, 10, 10, generator=torch.Generator().manual_seed(1))})
    with torch.no_grad():
        whole = model(x, model.init_state(2), adapter)
        logits, state = _run(model, x, cuts, adapter=adapter)
    torch.testing.assert_close(logits, whole.logits, rtol=1e-5, atol=1e-5)
    assert_states_close(state, whole.state, rtol=1e-5, atol=1e-6)


def test_rows_at_different_fills_batch_like_each_alone() -> None:
    """Sessions at different fills of their memories batch together; each row equals itself alone, state included."""
    assert_rows_batch_like_each_alone(_model())


def test_adapter_zero_is_no_adapter_and_row_b_touches_only_row_b() -> None:
    model = _model(adapt_layer=0)  # the site after block 0 shapes block 1's memory too
    x = _tokens(20, batch=3)
    with torch.no_grad():
        plain = model(x, model.init_state(3)).logits
        zero = model(x, model.init_state(3), Adapter.zeros({"resid": 10}, 3)).logits
        m = torch.zeros(3, 10, 10)
        m[1] = 0.3 * torch.randn(10, 10, generator=torch.Generator().manual_seed(0))
        moved = model(x, model.init_state(3), Adapter({"resid": m})).logits
    torch.testing.assert_close(zero, plain, rtol=0, atol=0)
    torch.testing.assert_close(moved[[0, 2]], plain[[0, 2]], rtol=0, atol=0)
    assert not torch.allclose(moved[1], plain[1])


def test_generation_through_the_state_equals_recomputation() -> None:
    """Greedy generation (one byte a call, memories carried and compressed) is the argmax of a fresh forward over
    the whole text each time."""
    assert_greedy_generation_equals_recomputation(_model())


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    model = _model(compression="dilated")
    with torch.no_grad():
        for p in model.parameters():  # move every weight off its initial value (u, v start at zero)
            p.add_(0.01 * torch.randn_like(p))
    save_checkpoint(tmp_path / "ck", model)
    loaded = load_checkpoint(tmp_path / "ck")
    assert isinstance(loaded.model, CompressiveTransformer) and loaded.config == model.config
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["model"]["arch"] == "compressive"
    x = _tokens(40, batch=2)
    with torch.no_grad():
        # weights that require grad take other float paths in some ops: compare like with like, bit for bit
        trainable, _ = _run(model, x, [13])
        copy, _ = _run(loaded.model.trainable_copy(), x, [13])
        frozen, sa = _run(model.freeze(), x, [13])
        served, sb = _run(loaded.model, x, [13])
    torch.testing.assert_close(served, frozen, rtol=0, atol=0)
    torch.testing.assert_close(copy, trainable, rtol=0, atol=0)
    assert_states_close(sb, sa, rtol=0, atol=0)


# -- trained: training, checkpoint, statistics, dynamic evaluation --------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("compressive_checkpoint")
    return out, train_on_test_data(make_config("tiny", {"arch": "compressive", **TRAINING}), out)


@pytest.fixture(scope="module")
def ckpt(trained: tuple[Path, Any]) -> Checkpoint:
    return load_checkpoint(trained[0])


def test_training_with_the_tiny_preset_lowers_the_loss(trained: tuple[Path, Any], ckpt: Checkpoint) -> None:
    out, result = trained
    cfg = make_config("tiny", {"arch": "compressive"})
    torch.manual_seed(cfg.seed)
    untrained = build_model(config_from_dict({"arch": "compressive", **cfg.model}))
    before = evaluate_bpb(untrained, VALID.read_bytes()[:2000], streams=4)
    assert before > 7.0 and result.best_valid_bpb < before - 1.0
    log = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    train_bpb = [r["train_bpb"] for r in log if "train_bpb" in r]
    assert train_bpb[-1] < train_bpb[0] - 0.5, train_bpb
    assert isinstance(ckpt.model, CompressiveTransformer) and ckpt.model.frozen
    # the reconstruction loss trained the compressors away from their mean-pooling start
    for block in ckpt.model.blocks:
        c = block.compressor
        start = torch.eye(c.weight.shape[0]).unsqueeze(-1).repeat(1, 1, c.rate) / c.rate
        assert not torch.allclose(c.weight, start)
    ms_g = ckpt.stats["adapter.resid"]
    assert ms_g.shape == (64, 64) and bool((ms_g > 0).any()) and bool(torch.isfinite(ms_g).all())
    assert all(f"param.{n}" in ckpt.stats for n, _ in ckpt.model.named_parameters())


def test_score_bytes_equals_a_log_softmax_of_one_forward(ckpt: Checkpoint) -> None:
    data = (TEXT * 2).encode()  # scored in chunks of 50 (not the segment grid), memories carried
    scored = score_bytes(ckpt.model, data, logprobs=True, chunk=50)
    with torch.no_grad():
        lp = torch.log_softmax(ckpt.model(torch.tensor([[BOS, *data[:-1]]]), ckpt.model.init_state(1)).logits[0], -1)
    manual = lp.gather(-1, torch.tensor(list(data)).unsqueeze(-1))[:, 0].double()
    assert scored.logprobs is not None
    np.testing.assert_allclose(scored.logprobs, manual.numpy(), rtol=1e-5, atol=1e-5)


def test_sparse_dynamic_evaluation_lowers_the_bits_of_a_repetitive_text(ckpt: Checkpoint) -> None:
    static_later, sparse_later, static, sparse = sparse_bits_on_repeats(ckpt.model)
    assert sparse_later < 0.9 * static_later, (static_later, sparse_later)
    assert sparse.adapted["resid"].shape == (64, 64)
    np.testing.assert_allclose(sparse.logprobs[:10], static.logprobs[:10], rtol=1e-5, atol=1e-6)  # scored first


def test_full_dynamic_evaluation_learns_and_leaves_the_compressor(ckpt: Checkpoint) -> None:
    """Full mode adapts every weight the LM loss reaches; the compressor, which it does not reach, stays."""
    s = repetitive()
    text = s * 3
    static = evaluate(ckpt.model, text, DynEvalConfig(mode="static"))
    full = evaluate(ckpt.model, text, DynEvalConfig(mode="full", rule="sgd", lr=1e-2, segment=10))
    later = slice(len(s), None)
    assert -full.logprobs[later].sum() < 0.9 * -static.logprobs[later].sum()
    np.testing.assert_allclose(full.logprobs[:10], static.logprobs[:10], rtol=1e-5, atol=1e-6)
    weights = dict(ckpt.model.named_parameters())
    for name, w in full.adapted.items():
        if ".compressor." in name:
            torch.testing.assert_close(w, weights[name], rtol=0, atol=0)
    assert not torch.equal(full.adapted["blocks.0.kv.weight"], weights["blocks.0.kv.weight"])


def test_evaluate_many_equals_each_text_alone(ckpt: Checkpoint) -> None:
    """Batched sparse dynamic evaluation: rows whose segments end at different times equal each text alone."""
    assert_evaluate_many_equals_each_text_alone(ckpt.model)


# -- served: sessions over HTTP, export/import, Redis ---------------------------------------------------------


@pytest.fixture(scope="module")
def client(trained: tuple[Path, Any]) -> Iterator[TestClient]:
    with served(trained[0], suggest_budget_ms=0) as c:
        yield c


def _exported(client: TestClient, sid: str) -> tuple[State, Adapter, int, bytes]:
    blob = client.get(f"/v1/sessions/{sid}/state")
    assert blob.status_code == 200, blob.text
    tensors = safetensors_load(blob.content)
    header = json.loads(blob.content[8 : 8 + int.from_bytes(blob.content[:8], "little")])
    meta = json.loads(header["__metadata__"]["session"])
    return (State.from_tensors(tensors, "state."), Adapter(State.from_tensors(tensors, "adapter.").tensors),
            int(meta["last_token"]), blob.content)


def test_session_adapts_scores_suggests_and_generates(client: TestClient, ckpt: Checkpoint) -> None:
    sid = create_session(client, adaptation={"lr": 0.03, "decay": 0.0})["id"]
    text = repetitive(100, seed=9).decode()
    seen = [observe_text(client, sid, text) for _ in range(3)]
    assert seen[2]["bits"] < seen[0]["bits"] and seen[2]["bits"] < 0.9 * seen[2]["static_bits"], seen
    assert seen[0]["static_bits"] == pytest.approx(score_bytes(ckpt.model, text.encode()).bits, rel=1e-5)
    state, adapter, last, _ = _exported(client, sid)
    assert set(state.tensors) == set(ckpt.model.init_state(1).persistent().tensors)  # the cache is not exported
    assert int(state.tensors["seen"]) == 300 and adapter.mats["resid"].abs().sum() > 0
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "a tru", "k": 3, "n_chars": 3})
    assert r.status_code == 200, r.text
    cursor = advance(ckpt.model, state, bytes([last]) + b"a tru", adapter)
    expected = suggest(ckpt.model, cursor, "a tru", adapter, k=3, n_chars=3)
    assert [w["text"] for w in r.json()["completions"]] == [c.text for c in expected.completions]
    assert all(w["text"].startswith("tru") for w in r.json()["completions"])
    gen = {"prompt": " It", "max_tokens": 20, "temperature": 0.8, "seed": 3, "session_id": sid}
    a = client.post("/v1/generate", json=gen)
    assert a.status_code == 200, a.text
    reference = "".join(generate(ckpt.model, b" It", SamplingParams(max_tokens=20, temperature=0.8, seed=3),
                                 state=state, last_token=last, adapter=adapter))
    assert a.json()["text"] == reference
    scored = client.post("/v1/score", json={"text": TEXT})
    assert scored.status_code == 200 and scored.json()["bits"] == pytest.approx(
        score_bytes(ckpt.model, TEXT.encode()).bits, rel=1e-5)


def test_session_memory_survives_export_and_import(client: TestClient) -> None:
    source = create_session(client, initial_text=TEXT)  # 108 bytes: memories full, compressed slots in use
    state, _, _, blob = _exported(client, source["id"])
    assert int(state.tensors["seen"]) == len(TEXT)
    assert all(bool(state.tensors[f"cmem{i}"].abs().sum(-1).gt(0).any()) for i in range(3))
    target = "imported-compressive-session-0123"
    put = client.put(f"/v1/sessions/{target}/state", content=blob, headers={"content-type": "application/octet-stream"})
    assert put.status_code == 200, put.text
    again, _, _, _ = _exported(client, target)
    assert_states_close(again, state, rtol=0, atol=0)
    a, b = observe_text(client, target, MORE), observe_text(client, source["id"], MORE)
    assert a["bits"] == b["bits"] and a["updates"] == b["updates"]


def test_session_memory_survives_the_redis_store(trained: tuple[Path, Any], tmp_path: Path) -> None:
    """A session written to Redis by one server is read back by the next, memories and all, and continues the
    same evaluation as the library's."""
    from tests.server.conftest import run_redis

    with run_redis(tmp_path) as url:
        with served(trained[0], session_store=url) as c:
            created = create_session(c, initial_text=TEXT[:60])
            sid = created["id"]
            state, adapter, _, _ = _exported(c, sid)
        with served(trained[0], session_store=url) as c:  # a restarted server on the same Redis
            restored, restored_adapter, _, _ = _exported(c, sid)
            after = observe_text(c, sid, MORE)
    assert_states_close(restored, state, rtol=0, atol=0)
    assert int(restored.tensors["seen"]) == 60  # the stream's BOS and the first 59 bytes
    torch.testing.assert_close(restored_adapter.mats["resid"], adapter.mats["resid"], rtol=0, atol=0)
    from trainer.evaluation import config_for

    ck = load_checkpoint(trained[0])
    reference = evaluate(ck.model, (TEXT[:60] + MORE).encode(), config_for("sparse", ck.dyneval), stats=ck.stats)
    assert created["observed"]["bits"] + after["bits"] == pytest.approx(reference.bits, rel=1e-5)
