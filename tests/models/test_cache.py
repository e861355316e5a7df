"""Neural cache (docs/algorithms.md §4): a proper distribution, a naive reference, lambda = 0 is the model."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models.adaptation import CacheConfig, CacheMemory, DynEvalConfig, NeuralCache, evaluate, read_memory
from models.base import Adapter, LanguageModel, Output, Site, State
from models.memory import MemoryMixed
from models.mlstm import MLSTM, MLSTMConfig


def _model() -> MLSTM:
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=16, embed_dim=8, dropout_hidden=0.0)).double().eval()
    with torch.no_grad():
        model.embed.weight.normal_(0, 1.0)
    return model


def _text(n: int, seed: int, alphabet: int = 256) -> bytes:
    g = torch.Generator().manual_seed(seed)
    symbols = torch.randperm(256, generator=g)[:alphabet]
    return bytes(symbols[torch.randint(0, alphabet, (n,), generator=g)].tolist())


Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # log_dist, hidden, targets, mask


def _chunks(seed: int = 0, V: int = 11, H: int = 6) -> list[Chunk]:
    """Two chunks of a batch of 2 streams; row 1 is padded at the end of the first chunk, then goes on."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in (7, 5):
        log_dist = torch.log_softmax(torch.randn(2, T, V, generator=g, dtype=torch.float64), -1)
        hidden = torch.randn(2, T, H, generator=g, dtype=torch.float64)
        targets = torch.randint(0, V, (2, T), generator=g)
        mask = torch.ones(2, T, dtype=torch.bool)
        out.append((log_dist, hidden, targets, mask))
    out[0][3][1, 4:] = False
    return out


def _naive(chunks: list[Chunk], cfg: CacheConfig) -> list[torch.Tensor]:
    """Position by position: keep every real (h, y) pair of a stream; mix over the last `window` of them."""
    results = [torch.full_like(c[0], math.nan) for c in chunks]
    for b in range(chunks[0][0].shape[0]):
        pairs: list[tuple[torch.Tensor, int]] = []
        for c, (log_dist, hidden, targets, mask) in enumerate(chunks):
            for t in range(log_dist.shape[1]):
                if not mask[b, t]:
                    continue
                p = log_dist[b, t].exp()
                recent = pairs[-cfg.window:]
                if recent:
                    scores = torch.stack([cfg.theta * hidden[b, t] @ h for h, _ in recent])
                    w = torch.softmax(scores, 0)
                    p_cache = torch.zeros_like(p)
                    for wi, (_, y) in zip(w, recent, strict=True):
                        p_cache[y] += wi
                    p = (1 - cfg.lam) * p + cfg.lam * p_cache
                results[c][b, t] = p.log()
                pairs.append((hidden[b, t], int(targets[b, t])))
    return results


def test_model_exposes_the_hidden_states_fed_to_the_head() -> None:
    model = _model()
    out = model(torch.randint(0, 256, (2, 9)), model.init_state(2))
    assert out.hidden is not None and out.hidden.shape == (2, 9, 16)
    torch.testing.assert_close(out.logits, F.linear(out.hidden, model.head.weight(), model.head.bias),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [1, 3, 100])
def test_matches_naive_reference_across_chunks_and_padding(window: int) -> None:
    cfg = CacheConfig(window=window, theta=1.3, lam=0.3)
    chunks = _chunks()
    cache = NeuralCache(cfg)
    got = [cache.mix(*c) for c in chunks]
    for g, ref, c in zip(got, _naive(chunks, cfg), chunks, strict=True):
        mask = c[3]
        torch.testing.assert_close(g[mask], ref[mask], rtol=0, atol=1e-12)


def test_distribution_sums_to_one() -> None:
    cache = NeuralCache(CacheConfig(window=4, theta=0.7, lam=0.4))
    for log_dist, hidden, targets, mask in _chunks(seed=3):
        mixed = cache.mix(log_dist, hidden, targets, mask)
        torch.testing.assert_close(mixed.exp().sum(-1), torch.ones(mixed.shape[:2], dtype=torch.float64),
                                   rtol=0, atol=1e-12)
    assert cache.keys is not None and cache.keys.shape[1] == 4  # memory holds the window, no more


def test_window_one_with_lambda_one_copies_the_previous_byte() -> None:
    # the only pair in a window of 1 is (h_{t-1}, x_t): p_cache is one-hot on the current input byte
    log_dist, hidden, targets, _ = _chunks()[0]
    mixed = NeuralCache(CacheConfig(window=1, theta=1.0, lam=1.0)).mix(log_dist, hidden, targets)
    torch.testing.assert_close(mixed[:, 0], log_dist[:, 0], rtol=0, atol=0)  # empty cache: the model
    expected = torch.full_like(mixed[:, 1:], -math.inf).scatter(2, targets[:, :-1, None], 0.0)
    assert torch.equal(mixed[:, 1:], expected)


@pytest.mark.parametrize("mode", ["static", "full", "sparse"])
def test_lambda_zero_equals_no_cache(mode: str) -> None:
    model = _model()
    text = _text(90, 1)
    cfg = DynEvalConfig(mode=mode, rule="sgd", lr=0.5, segment=10)
    plain = evaluate(model, text, cfg)
    cached = evaluate(model, text, dataclasses.replace(cfg, cache=CacheConfig(window=50, lam=0.0)))
    np.testing.assert_array_equal(cached.logprobs, plain.logprobs)


@pytest.mark.parametrize("mode", ["static", "full", "sparse"])
def test_cache_helps_on_a_repeat_in_every_mode(mode: str) -> None:
    model = _model()
    s = _text(300, 2, alphabet=8)
    base = DynEvalConfig(mode=mode, rule="sgd", lr=0.2, segment=20)
    with_cache = dataclasses.replace(base, cache=CacheConfig(window=1000, theta=1.0, lam=0.5))

    def second(cfg: DynEvalConfig) -> float:
        res = evaluate(model, s + s, cfg)
        assert res.bytes == 2 * len(s) and np.isfinite(res.logprobs).all()
        return float(-res.logprobs[len(s):].sum() / len(s) / math.log(2))

    assert second(with_cache) < second(base) - 1.0


# -- a session's memory: kept between texts, read by CacheMemory without change -----------------------------------


def test_memory_kept_between_texts_goes_on_as_one_stream() -> None:
    """Mixing a stream in two calls, the memory carried between them as a State, equals one call on the whole."""
    cfg = CacheConfig(window=6, theta=0.7, lam=0.3)
    g = torch.Generator().manual_seed(3)
    T, V, H = 11, 9, 5
    log_dist = torch.log_softmax(torch.randn(1, T, V, generator=g, dtype=torch.float64), -1)
    hidden = torch.randn(1, T, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (1, T), generator=g)
    whole = NeuralCache(cfg).mix(log_dist, hidden, targets)
    first = NeuralCache(cfg)
    a = first.mix(log_dist[:, :4], hidden[:, :4], targets[:, :4])
    memory = first.to_state()
    assert memory is not None and memory.tensors["keys"].shape == (1, 4, H)
    second = NeuralCache.from_state(cfg, memory)
    b = second.mix(log_dist[:, 4:], hidden[:, 4:], targets[:, 4:])
    torch.testing.assert_close(torch.cat([a, b], 1), whole)
    assert second.keys is not None and second.keys.shape[1] == cfg.window  # the memory is cut to the window
    assert memory.tensors["keys"].shape == (1, 4, H)  # and the stored one was not written into


def test_reading_the_memory_predicts_as_the_next_observed_token_would() -> None:
    """`read_memory` (sampling, suggestions) gives the distribution that observing one more token would score."""
    cfg = CacheConfig(window=5, theta=1.3, lam=0.4)
    g = torch.Generator().manual_seed(4)
    T, V, H = 8, 7, 4
    log_dist = torch.log_softmax(torch.randn(1, T, V, generator=g), -1)
    hidden = torch.randn(1, T, H, generator=g)
    targets = torch.randint(0, V, (1, T), generator=g)
    cache = NeuralCache(cfg)
    cache.mix(log_dist[:, :-1], hidden[:, :-1], targets[:, :-1])
    memory = cache.to_state()
    assert memory is not None
    observed = NeuralCache.from_state(cfg, memory).mix(log_dist[:, -1:], hidden[:, -1:], targets[:, -1:])
    read = read_memory(log_dist[:, -1:].expand(3, -1, -1), hidden[:, -1:].expand(3, -1, -1), memory, cfg)
    for row in read:
        torch.testing.assert_close(row, observed[0])
    assert float(read[0].exp().sum()) == pytest.approx(1.0, abs=1e-5)
    assert not torch.allclose(read[0], log_dist[0, -1:])  # the memory did change the prediction


class _Toy(LanguageModel):
    """A model whose hidden state is its input's embedding: enough for the cache to tell contexts apart."""

    def __init__(self, V: int = 12, H: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = MLSTMConfig(hidden=H, embed_dim=H, vocab_size=V)  # a config it never reads
        self.embed = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V)

    def init_state(self, batch: int) -> State:
        return State({"n": torch.zeros(batch, 1)})

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        h = self.embed(tokens)
        return Output(logits=self.head(h), state=State({"n": state.tensors["n"] + tokens.shape[1]}), hidden=h)

    def adaptation_sites(self) -> list[Site]:
        return []


def _memory(model: _Toy, tokens: list[int], cfg: CacheConfig) -> State:
    x = torch.tensor([tokens[:-1]])
    out = model(x, model.init_state(1))
    cache = NeuralCache(cfg)
    cache.mix(torch.log_softmax(out.logits, -1), out.hidden, torch.tensor([tokens[1:]]))
    memory = cache.to_state()
    assert memory is not None
    return memory


@torch.no_grad()
def test_cache_mixed_reads_each_rows_session_and_leaves_the_others_alone() -> None:
    model = _Toy().eval()
    cfg = CacheConfig(window=50, theta=2.0, lam=0.5)
    mixed = MemoryMixed(model, [CacheMemory(cfg)])
    one, two = _memory(model, [1, 2, 3, 1, 2, 3, 1], cfg), _memory(model, [4, 5, 4, 5, 4, 5, 4, 5], cfg)
    x = torch.tensor([[3], [4], [7], [3]])
    plain = torch.log_softmax(model(x, model.init_state(4)).logits, -1)
    adapter = Adapter({}, {"cache": ([one, two], torch.tensor([0, 1, -1, 1]))})
    out = mixed(x, mixed.init_state(4), adapter)
    lp = mixed.log_probs(out)
    torch.testing.assert_close(lp[2], plain[2])  # no session: the model alone
    h = model(x, model.init_state(4)).hidden
    for row, memory in ((0, one), (1, two), (3, two)):
        torch.testing.assert_close(lp[row], read_memory(plain[row : row + 1], h[row : row + 1], memory, cfg)[0])
    assert int(lp[0, 0].argmax()) == 1  # after 3 the first session saw 1 every time
    assert int(lp[1, 0].argmax()) == 5  # after 4 the second saw 5
    # lambda = 0 is the model; no cache at all is the model's own output
    zero = MemoryMixed(model, [CacheMemory(dataclasses.replace(cfg, lam=0.0))])
    torch.testing.assert_close(zero.log_probs(zero(x, zero.init_state(4), adapter)), plain)
    torch.testing.assert_close(mixed(x, mixed.init_state(4), Adapter({})).logits, model(x, model.init_state(4)).logits)
