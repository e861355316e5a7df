"""The copy model (models/copymodel.py): learns an exact repeat after one sighting, scores before it learns,
depends only on the stream, keeps fixed memory, and mixes into sessions' scores and searches."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.copy_scan import compiled
from models.base import Adapter, State
from models.checkpoint import load_checkpoint
from models.copymodel import BUCKET_EDGES, CopyConfig, CopyMemory, CopyModel, _stacked, branch_view, frozen_stats
from models.keysim import ModelSuggester
from models.memory import MemoryMixed, merge_branches
from tests.toy_transformer import ToyTransformer, ToyTransformerConfig

V = 256


def uniform(B: int, T: int) -> torch.Tensor:
    return torch.full((B, T, V), -math.log(V))  # (B, T, V) a network that knows nothing


def run(model: CopyModel, data: bytes, cuts: list[int] | None = None) -> tuple[torch.Tensor, State]:
    """log p_mix of every byte of `data` (each predicted from the bytes before it, as a stream starting with BOS
    '\\n'), feeding the stream in pieces cut at `cuts`."""
    x = torch.tensor([10, *data[:-1]]).unsqueeze(0)  # (1, T) inputs
    y = torch.tensor(list(data))
    state, out, start = model.init_state(1), [], 0
    for end in [*(cuts or []), len(data)]:
        mixed, state = model.mix(uniform(1, end - start), x[:, start:end], state)
        out.append(mixed[0].gather(1, y[start:end, None])[:, 0])
        start = end
    return torch.cat(out), state


def bits(lp: torch.Tensor) -> float:
    return -float(lp.sum()) / math.log(2)


def test_an_exact_repeat_is_learned_after_one_sighting() -> None:
    g = torch.Generator().manual_seed(0)
    block = bytes(torch.randint(0, 256, (300,), generator=g).tolist())
    lp, _ = run(CopyModel(CopyConfig(window=1024)), block + block)
    first, second = bits(lp[:300]) / 300, bits(lp[300:]) / 300
    assert first > 7.5  # random bytes: nothing to copy yet (a uniform network is 8 bits)
    assert second < 2.0  # the repeat costs a fraction of it: the match model and the counts found it
    assert bits(lp[320:]) / 280 < 1.0  # and once the mixer has learned to trust a long match, far less


def test_a_byte_is_scored_before_anything_learns_from_it() -> None:
    """Changing a byte changes no earlier prediction, and the prediction of a byte never depends on itself (a peek
    would give the changed byte a higher probability at its own position)."""
    text = b"the cat sat on the mat. the cat sat on the mat. the cat"
    model = CopyModel(CopyConfig(window=256))
    base, _ = run(model, text)
    for i in (5, 30, len(text) - 1):
        changed = text[:i] + b"#" + text[i + 1:]
        other, _ = run(model, changed)
        torch.testing.assert_close(other[:i], base[:i], rtol=0, atol=0)  # everything before i is identical
        # what position i predicted is the same distribution; "#" was never seen, so it gets no copy bonus
        assert other[i] <= -math.log(V) + 0.5


def test_outputs_and_state_depend_only_on_the_stream_not_on_the_cuts() -> None:
    text = (b"abracadabra, abracadabra! " * 12)[:250]
    model = CopyModel(CopyConfig(window=128, lr=0.05))
    whole, s1 = run(model, text)
    for cuts in ([1], [7, 8, 100], list(range(3, 250, 17))):
        pieces, s2 = run(model, text, cuts)
        torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-6)
        for k, v in s1.tensors.items():
            torch.testing.assert_close(s2.tensors[k], v, rtol=0, atol=1e-6, msg=k)


def test_memory_is_fixed_and_old_bytes_are_forgotten() -> None:
    """Past `window` bytes the state keeps its size, and a block seen only before the window is not copied."""
    g = torch.Generator().manual_seed(1)
    block = bytes(torch.randint(0, 256, (100,), generator=g).tolist())
    filler = bytes(torch.randint(0, 256, (300,), generator=g).tolist())
    model = CopyModel(CopyConfig(window=256))
    size = model.init_state(1).row_bytes
    lp, state = run(model, block + filler + block)
    assert state.row_bytes == size and int(state.tensors["fill"][0]) == 256
    assert bits(lp[400:]) / 100 > 7.0  # forgotten: the second block costs what the first did
    lp, _ = run(CopyModel(CopyConfig(window=512)), block + filler + block)
    assert bits(lp[400:]) / 100 < 2.5  # within the window it is copied


def test_the_default_prior_without_learning_is_the_network() -> None:
    g = torch.Generator().manual_seed(2)
    log_net = torch.log_softmax(torch.randn(2, 40, V, generator=g), -1)  # (2, 40, V)
    x = torch.randint(0, V, (2, 40), generator=g)
    model = CopyModel(CopyConfig(window=64, lr=0.0))
    mixed, _ = model.mix(log_net, x, model.init_state(2))
    torch.testing.assert_close(mixed, log_net, rtol=0, atol=1e-5)


def test_rows_of_a_batch_equal_each_alone_padding_included() -> None:
    g = torch.Generator().manual_seed(3)
    texts = [b"hello hello hello", b"abcabcabcabcabcabcabc", b"xyxyxy"]
    model = CopyModel(CopyConfig(window=64, lr=0.05))
    T = max(len(t) for t in texts)
    x = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for i, t in enumerate(texts):
        x[i, : len(t)] = torch.tensor(list(t))
        mask[i, : len(t)] = True
    log_net = torch.log_softmax(torch.randn(3, T, V, generator=g), -1)
    mixed, state = model.mix(log_net, x, model.init_state(3), mask)
    for i, t in enumerate(texts):
        alone, s = model.mix(log_net[i : i + 1, : len(t)], x[i : i + 1, : len(t)], model.init_state(1))
        torch.testing.assert_close(mixed[i, : len(t)], alone[0], rtol=0, atol=1e-6)
        for k, v in s.tensors.items():
            torch.testing.assert_close(state.tensors[k][i : i + 1], v, rtol=0, atol=1e-6, msg=k)


def test_the_frozen_path_copies_without_learning() -> None:
    """CopyMemory.read (the keyboard search, sampling) reads a session's history and mixer without changing them: a
    branch that repeats an earlier phrase gets its continuation predicted, and the statistics stay as they were."""
    toy = ToyTransformer(ToyTransformerConfig()).freeze()
    copy = CopyModel(CopyConfig(window=256, lr=0.05))
    text = b"please send the quarterly report to accounting. " * 3
    x = torch.tensor([10, *text]).unsqueeze(0)
    log_net = toy.log_probs(toy(x, toy.init_state(1)))
    _, learned = copy.mix(log_net, x, copy.init_state(1))
    stats = State({k: learned.tensors[k] for k in ("hist", "fill", "uni", "weights")})
    before = {k: v.clone() for k, v in stats.tensors.items()}
    mixed = MemoryMixed(toy, [CopyMemory(copy)])
    state = merge_branches(toy.init_state(1), {"copy": branch_view(learned)})
    prompt = torch.tensor([list(b"please send the quarterly re")])
    zero = Adapter.zeros({site.name: 4 for site in toy.adaptation_sites()}, 1)
    out = mixed(prompt, state, Adapter(zero.mats, {"copy": ([stats], None)}))
    lp = mixed.log_probs(out)[0, -1]  # after "...quarterly re": "p" (report) is the copy's prediction
    plain = toy.log_probs(toy(prompt, toy.init_state(1)))[0, -1]
    assert float(lp[ord("p")]) > math.log(0.5) > float(plain[ord("p")])
    for k, v in stats.tensors.items():
        assert torch.equal(v, before[k]), k
    # without a session's statistics the mixed model is the network
    alone = mixed(prompt, state, zero)
    torch.testing.assert_close(mixed.log_probs(alone)[0, -1], plain, rtol=0, atol=1e-5)


def test_config_and_state_checks() -> None:
    with pytest.raises(ValueError, match="window"):
        CopyConfig(window=0)
    with pytest.raises(ValueError, match="lr"):
        CopyConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="weights"):
        CopyConfig(weights=((1.0,),))
    config = CopyConfig(window=128, orders=3)
    assert CopyConfig.from_dict({**config.to_dict(), "note": "kept by the caller"}) == config
    prior = tuple(tuple(float(i == 0) for i in range(config.features)) for _ in BUCKET_EDGES)
    assert CopyConfig.from_dict(CopyConfig(window=128, orders=3, weights=prior).to_dict()).weights == prior
    model = CopyModel(config)
    good = model.init_state(1)
    model.check_state(good)
    for name, value in (("fill", torch.tensor([-1])), ("bucket", torch.tensor([99])),
                        ("weights", torch.full_like(good.tensors["weights"], math.inf))):
        bad = State({**good.tensors, name: value})
        with pytest.raises(ValueError):
            model.check_state(bad)
    with pytest.raises(ValueError, match="copy.hist is missing"):
        model.check_state(State({k: v for k, v in good.tensors.items() if k != "hist"}))


@pytest.mark.parametrize("mode", ["static", "sparse", "full"])
def test_the_keyboard_simulator_suggests_with_the_copy_model(tiny_checkpoint: Path, mode: str) -> None:
    """The in-process simulator (bench.keyboard's "full + copy" row) mixes the copy model into its scores and its
    word search in every mode, as a server session does; without it, the made-up word is never offered."""
    ckpt = load_checkpoint(tiny_checkpoint)
    config = None if mode == "static" else ckpt.dyneval.config("dynamic" if mode == "full" else "sparse")
    text = "Please forward the zqvx ledger to accounting before Tuesday.\n"
    found = {}
    for copy in (None, CopyModel(CopyConfig(window=1024))):
        sim = ModelSuggester(ckpt.model, config, stats=ckpt.stats, copy=copy)
        for _ in range(3):  # the mixer starts from the network alone here (no learned prior): it learns to trust
            sim.observe(text)  # the copy model as the text repeats
        found[copy is not None] = sim.suggest("Please forward the zq", 3)
    assert found[True][:1] == ["zqvx"] and "zqvx" not in found[False]


def test_the_fused_kernel_equals_the_pytorch_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with numba the step runs as one kernel (kernels/copy_scan.py); the PyTorch code is its reference
    (and the path on other devices): same scores, same state, learning and frozen, with padding."""
    if compiled() is None:
        pytest.skip("numba is not installed: the reference is the only path")
    g = torch.Generator().manual_seed(4)
    text = (b"one two three, one two three; four five six. one two three four five six! " * 4)
    B, T, W = 3, 60, 128
    model = CopyModel(CopyConfig(window=W, orders=4, lr=0.05))
    log_net = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    x = torch.tensor([list(text[i * 17 : i * 17 + T]) for i in range(B)])
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([[T], [T - 7], [T]])

    def both(fn: Any) -> tuple[Any, Any]:
        fast = fn()
        monkeypatch.setattr("models.copymodel.compiled", lambda: None)
        ref = fn()
        monkeypatch.undo()
        return fast, ref

    state = model.init_state(B)
    for start in (0, 20, 40):  # three calls: the history fills, then slides past the window
        cut = slice(start, start + 20)
        (fast, s_fast), (ref, s_ref) = both(lambda c=cut, s=state: model.mix(log_net[:, c], x[:, c], s, mask[:, c]))
        torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
        for k, v in s_ref.tensors.items():
            torch.testing.assert_close(s_fast.tensors[k], v, rtol=1e-5, atol=1e-5, msg=k)
        state = s_ref
    stats = State({k: state.tensors[k] for k in ("hist", "fill", "uni", "weights")})
    index = torch.tensor([2, -1, 0, 0])
    view = branch_view(state.select(index.clamp(min=0)))
    branch = torch.tensor([list(b"one t"), list(b"five "), list(b"xyz o"), list(b"three")])
    lp = torch.log_softmax(torch.randn(4, 5, V, generator=g), -1)
    (fast, c_fast, n_fast), (ref, c_ref, n_ref) = both(
        lambda: model.mix_frozen(lp, branch, view.tensors["ctx"], view.tensors["ctxlen"], stats, index))
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_fast[index >= 0], c_ref[index >= 0]) and torch.equal(n_fast[index >= 0], n_ref[index >= 0])
    torch.testing.assert_close(fast[1], lp[1], rtol=0, atol=0)  # index -1: the network alone


@pytest.mark.parametrize("orders", [1, 2, 6])
def test_the_pair_indexed_frozen_kernel_equals_the_reference(monkeypatch: pytest.MonkeyPatch, orders: int) -> None:
    """The frozen kernel reads the history through its byte-pair index (frozen_stats): on a small alphabet (long and
    many matches), histories still filling and past their window, several sessions in one batch and branches with
    short and long contexts, it gives the reference's scores and contexts."""
    if compiled() is None:
        pytest.skip("numba is not installed: the reference is the only path")
    g = torch.Generator().manual_seed(orders)
    W, T = 96, 9
    model = CopyModel(CopyConfig(window=W, orders=orders, lr=0.05))
    text = bytes(b"ab c"[i] for i in torch.randint(0, 4, (400,), generator=g).tolist())
    sessions = [model.init_state(1)]  # one that has read nothing: the network alone
    for n in (40, 95, 300):  # filling, nearly full, slid past the window
        _, s = model.mix(uniform(1, n), torch.tensor([list(text[:n])]), model.init_state(1))
        sessions.append(s)
    state = State.stack(sessions)
    stats = frozen_stats(state)
    assert set(stats.tensors) > {"hist", "fill", "uni", "weights"}  # the index is there, and is what is read
    index = torch.tensor([1, 2, 3, 3, 2, 1, -1, 0])
    view = branch_view(state.select(index.clamp(min=0)))
    ctx, ctxlen = view.tensors["ctx"].clone(), view.tensors["ctxlen"].clone()
    ctxlen[3], ctxlen[4] = 0, 1  # a branch that knows nothing before its inputs, one that knows one byte
    branch = torch.randint(0, 4, (8, T), generator=g).apply_(lambda i: b"ab c"[i])
    lp = torch.log_softmax(torch.randn(8, T, V, generator=g), -1)
    fast, c_fast, n_fast = model.mix_frozen(lp, branch, ctx, ctxlen, stats, index)
    monkeypatch.setattr("models.copymodel.compiled", lambda: None)
    ref, c_ref, n_ref = model.mix_frozen(lp, branch, ctx, ctxlen, frozen_stats(state), index)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    has = index >= 0  # (a row without a copy model keeps no context)
    assert torch.equal(c_fast[has], c_ref[has]) and torch.equal(n_fast[has], n_ref[has])
    assert not torch.allclose(fast[:6], lp[:6], atol=1e-3)  # the copy model does change the scores
    assert torch.equal(fast[6:], lp[6:]) and torch.equal(ref[6:], lp[6:])  # not without one, nor from nothing read


def test_a_search_stacks_its_sessions_copy_statistics_once() -> None:
    """The rounds of a keyboard search stack the same sessions' statistics: the second stack of the same states is
    the first one (not a new 420 KB a session), as is a stack of some of them (fewer searches left, another order:
    each row's index mapped to its session's place in it); a set with a session the last stack lacks is stacked
    anew, and one session is its own."""
    model = CopyModel(CopyConfig(window=64))

    def session(mark: int) -> Adapter:  # a session's view, its history marked to tell it apart
        view = frozen_stats(model.init_state(1))
        return Adapter({}, {"copy": ([State({**view.tensors, "hist": view.tensors["hist"] + mark})], None)})

    a, b, c = session(1), session(2), session(3)

    def stacked(adapters: list[Adapter | None], rows: list[int]) -> tuple[State, list[int]]:
        views, index = Adapter({}).with_sessions(adapters, rows).memories["copy"]
        assert index is not None
        got, index = _stacked(views, index)
        return got, index.tolist()

    first, index = stacked([a, b, c], [2, 3, 1])
    assert index == [0, 0, 1, 1, 1, 2]
    again, index = stacked([a, b, c], [1, 1, 1])
    assert again is first and index == [0, 1, 2]
    fewer, index = stacked([c, None, a], [2, 1, 1])  # a row without a copy model stays -1
    assert fewer is first and index == [2, 2, -1, 0]
    assert [int(fewer.tensors["hist"][i, 0]) for i in index if i >= 0] == [3, 3, 1]  # each row its session's
    d = session(4)
    other, index = stacked([b, d], [1, 1])
    assert other is not first and other.tensors["hist"].shape == (2, 64) and index == [0, 1]
    alone, _ = stacked([a], [4])
    assert alone is a.memories["copy"][0][0]
