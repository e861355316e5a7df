"""The output rows' session memory (models/adaptation/_head_memory.py): it scores as the phase-1 variant it serves
(VariantStream's weight-normalised output update), no byte's score sees that byte, the divergence guard holds, rows
batch without changing each other, its state is bfloat16 and round-trips through export and restore.

Tiny float64 mLSTMs, frozen as a loaded checkpoint is, with synthetic MS_g statistics."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from models.adaptation import (
    AdapterSettings,
    DynEvalSettings,
    Row,
    TextJob,
    VariantConfig,
    VariantStream,
    _step,
    batch_step,
)
from models.adaptation._head_memory import STATE_DTYPE, HeadMemory, HeadSettings
from models.base import State
from models.checkpoint import load_checkpoint
from models.memory import MemorySettingsError, SessionConfig, memory_types, state_nbytes
from models.mlstm import MLSTM
from models.session import SessionModel
from models.tokenizer import ByteTokenizer
from tests.models.conftest import tiny_mlstm

H = 16
LR = 0.02
SEGMENT = 10


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny matrices (tests/models/conftest.py)."""


def _model(seed: int = 0) -> MLSTM:
    return tiny_mlstm(seed, H)


def _ms_v(model: MLSTM, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 10 ** (torch.rand(model.head.v.shape, generator=g, dtype=torch.float64) * 2 - 5)


def _text(n: int, seed: int = 0, alphabet: int = 8) -> bytes:
    g = torch.Generator().manual_seed(seed)
    symbols = torch.randperm(256, generator=g)[:alphabet]
    return bytes(symbols[torch.randint(0, alphabet, (n,), generator=g)].tolist())


def _memory(model: MLSTM, eps: float = 1e-5) -> HeadMemory:
    return HeadMemory(model, _ms_v(model), eps)


def _rows(model: MLSTM, memory: HeadMemory, n: int, lr: float = LR, decay: float = 0.0) -> list[Row]:
    state = memory.init(HeadSettings(lr=lr, decay=decay), torch.device("cpu"))
    return [Row(model.init_state(1), memories={"head": state}) for _ in range(n)]


def _run(model: MLSTM, memory: HeadMemory, texts: list[bytes], rows: list[Row] | None = None) -> list[Row]:
    """Each text read by one row, every row in each batched step (texts of different lengths: padding)."""
    rows = rows or _rows(model, memory, len(texts))
    jobs = []
    for text, row in zip(texts, rows, strict=True):
        inputs, targets = ByteTokenizer().stream(text, None, torch.device("cpu"))
        jobs.append(TextJob(inputs, targets, [row]))
    while any(not j.done for j in jobs):
        batch_step(model, [j for j in jobs if not j.done], SEGMENT, memories={"head": memory})
    return rows


def _logprobs(row: Row) -> np.ndarray:
    return torch.cat(row.logprobs).numpy()


def test_registered_before_the_copy_model_and_off_without_a_section() -> None:
    names = list(memory_types())
    assert names.index("head") < names.index("copy")  # the copy model mixes into the adapted distribution
    model = _model()
    memory = _memory(model)
    assert memory.defaults() is None
    assert "head" not in SessionConfig.resolve({"head": memory})
    assert SessionConfig.resolve({"head": memory}, {"head": {"lr": 1e-4, "decay": 1e-4}}).get("head") \
        == HeadSettings(lr=1e-4, decay=1e-4)
    with pytest.raises(MemorySettingsError) as e:
        memory.settings({"lr": -1.0, "decay": 0.0})
    assert e.value.param == "lr"


def test_scores_as_the_weight_normalised_output_variant() -> None:
    """The memory is VariantStream's `headv` (the whole v, out_norm): the same first segment exactly (nothing
    learned yet), and the same bits over the text but for the bfloat16 rounding of its stored delta."""
    model = _model()
    memory = _memory(model)
    text = _text(400)
    (row,) = _run(model, memory, [text])
    stats = {"param.head.v": _ms_v(model)}
    config = VariantConfig(units=0, out_rank=H, out_lr=LR, out_norm=True, decay=0.0, eps=1e-5, segment=SEGMENT)
    inputs, targets = ByteTokenizer().stream(text, None, torch.device("cpu"))
    variant, _ = VariantStream(model, config, stats).run(inputs, targets)
    ours, theirs = _logprobs(row), variant.numpy()
    np.testing.assert_allclose(ours[:SEGMENT], theirs[:SEGMENT], rtol=0, atol=1e-9)
    assert abs(ours.sum() - theirs.sum()) < 0.01 * abs(theirs.sum())
    static = _logprobs(_run(model, memory, [text], _rows(model, memory, 1, lr=0.0))[0])
    # it learns: the adapted rows save more than 5% of the static bits on a text of 8 symbols
    assert -ours.sum() < 0.95 * -static.sum()


def test_the_gradient_by_hand_is_autograds() -> None:
    """`_gradient` (the step's gradient, written out) equals autograd's through `_tilt`, padding and a nonzero D
    included."""
    model = _model()
    memory = _memory(model)
    g = torch.Generator().manual_seed(4)
    B, T = 3, 7
    log_dist = torch.log_softmax(torch.randn(B, T, 256, generator=g, dtype=torch.float64), -1)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    delta = (0.3 * torch.randn(B, 256, H, generator=g, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([[7], [4], [1]])
    weight = mask.double() / mask.sum(1, keepdim=True).double()
    out, saved = memory._tilt(log_dist, hidden, delta)
    loss = -(out.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * weight).sum()
    (expected,) = torch.autograd.grad(loss, [delta])
    with torch.no_grad():
        u, norm, uh = (t.detach() for t in saved)
        got = memory._gradient(out.detach(), targets, weight, hidden, (u, norm, uh))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_no_peek() -> None:
    """Changing a byte changes no score before it, in its own segment included: each segment is scored before the
    update it causes (an update on the segment first would let byte t shape the scores of bytes t-9..t-1)."""
    model = _model()
    memory = _memory(model)
    text = _text(60, seed=3)
    t = 4 * SEGMENT + 7  # late in a segment, after several updates
    other = text[:t] + bytes([(text[t] + 1) % 256]) + text[t + 1 :]
    a, b = (_logprobs(_run(model, memory, [x])[0]) for x in (text, other))
    np.testing.assert_array_equal(a[:t], b[:t])
    assert not np.array_equal(a[t + 1 :], b[t + 1 :])  # the change does reach the later segments


def test_rows_batch_without_changing_each_other() -> None:
    """Sessions of different lengths and rates in one batched step score and learn as each alone."""
    model = _model()
    memory = _memory(model)
    texts = [_text(95, seed=1), _text(60, seed=2), _text(80, seed=3)]
    rates = [(LR, 0.0), (0.0, 0.0), (3 * LR, 1e-2)]
    rows = [Row(model.init_state(1), memories={"head": memory.init(HeadSettings(lr=lr, decay=d),
                                                                   torch.device("cpu"))}) for lr, d in rates]
    together = _run(model, memory, texts, rows)
    for text, (lr, d), row in zip(texts, rates, together, strict=True):
        (alone,) = _run(model, memory, [text], _rows(model, memory, 1, lr, d))
        np.testing.assert_allclose(_logprobs(row), _logprobs(alone), rtol=0, atol=1e-9)
        delta, alone_delta = row.memories["head"].tensors["delta"], alone.memories["head"].tensors["delta"]
        assert delta.dtype == STATE_DTYPE and torch.equal(delta, alone_delta)
    assert not together[1].memories["head"].tensors["delta"].any()  # lr 0: nothing learned
    assert together[2].memories["head"].tensors["delta"].any()


def test_divergence_guard_resets_the_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta under which a segment scores non-finite, or worse than the guard's bound a token, is reset to zero and
    the segment scored under the shipped output layer; the other row of the batch keeps its own delta. (The bound is
    the session's, lowered here so that a tiny model's rows, g_i |h| a few nats, can cross it.)"""
    bound = 16.0
    monkeypatch.setattr(_step, "DIVERGED_BITS", bound)
    model = _model()
    assert model.head.g is not None
    with torch.no_grad():
        model.head.g.mul_(10.0)  # longer rows: a delta that turns them away from the text costs more bits
    memory = _memory(model)
    text = _text(SEGMENT, seed=5)
    inputs, targets = ByteTokenizer().stream(text, None, torch.device("cpu"))
    out = model(inputs[None], model.init_state(1))
    assert out.hidden is not None
    log_dist = torch.log_softmax(out.logits, -1)
    fresh = _logprobs(_run(model, memory, [text], _rows(model, memory, 1, lr=0.0))[0])
    assert -fresh.mean() / math.log(2) < bound
    # the rows of the text's bytes turned against its mean hidden state, every other row towards it
    sign = torch.ones(256, 1, dtype=torch.float64)
    sign[targets] = -1.0
    away = -model.head.v.detach() + sign * out.hidden[0].mean(0).detach()
    lp, _ = memory._tilt(log_dist, out.hidden, away.unsqueeze(0))
    assert -float(lp[0].gather(-1, targets[:, None]).mean()) / math.log(2) > bound  # the guard has work to do
    for bad in (torch.full_like(model.head.v, math.nan), away):
        rows = _rows(model, memory, 2, lr=0.0)
        rate = rows[0].memories["head"].tensors["rate"]
        rows[0].memories = {"head": State({"delta": bad.unsqueeze(0).to(STATE_DTYPE), "rate": rate})}
        keep = torch.full((1, *model.head.v.shape), 0.01, dtype=STATE_DTYPE)
        rows[1].memories = {"head": State({"delta": keep, "rate": rate})}
        _run(model, memory, [text, text], rows)
        np.testing.assert_allclose(_logprobs(rows[0]), fresh, rtol=0, atol=1e-9)
        assert not rows[0].memories["head"].tensors["delta"].any()
        assert torch.equal(rows[1].memories["head"].tensors["delta"], keep)  # lr 0, no decay: unchanged
        # the reset counts as the session's counts M's (`nonfinite_resets`); each row's step from there as an update
        assert [(r.updates, r.dropped, r.resets) for r in rows] == [(1, 0, 1), (1, 0, 0)]


def test_its_steps_count_as_updates_and_refused_ones_as_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's `updates` (a session's `updates`) count the memory's steps, one a segment; a step the non-finite guard
    refuses counts in `dropped` (a session's `nonfinite_resets`) and leaves the delta as it was."""
    model = _model()
    memory = _memory(model)
    texts = [_text(3 * SEGMENT + 4), _text(SEGMENT, seed=1)]  # 4 segments, and 1 (padding in the batch after it)
    rows = _run(model, memory, texts)
    assert [(r.updates, r.dropped, r.resets) for r in rows] == [(4, 0, 0), (1, 0, 0)]
    monkeypatch.setattr(memory, "_step", lambda rules, old, grad: torch.full_like(old, math.inf))
    rows = _run(model, memory, texts)
    assert [(r.updates, r.dropped, r.resets) for r in rows] == [(0, 4, 0), (0, 1, 0)]
    assert not any(r.memories["head"].tensors["delta"].any() for r in rows)


def test_state_is_bfloat16_and_round_trips() -> None:
    model = _model()
    memory = _memory(model)
    settings = HeadSettings(lr=LR, decay=1e-3)
    (row,) = _run(model, memory, [_text(50)], _rows(model, memory, 1, LR, 1e-3))
    state = row.memories["head"]
    assert state_nbytes(state) == 2 * model.head.v.numel() + 16  # the delta in bf16, and the row's (lr, decay)
    tensors, meta = memory.export(state)
    assert set(tensors) == {"delta"} and tensors["delta"].dtype == torch.bfloat16
    back = memory.restore(settings, tensors, meta, torch.device("cpu"))
    assert torch.equal(back.tensors["delta"], state.tensors["delta"])
    assert back.tensors["rate"].tolist() == [[LR, 1e-3]]
    for wrong in ({"delta": tensors["delta"].float()}, {"delta": tensors["delta"][:, :3]},
                  {"delta": torch.full_like(tensors["delta"], math.inf)}, {**tensors, "rate": torch.zeros(1, 2)}):
        with pytest.raises(ValueError):
            memory.restore(settings, wrong, None, torch.device("cpu"))


def test_read_is_learn_without_the_update() -> None:
    """A search reads a session's delta as its observe scored with it; a row of no session is left as it was."""
    model = _model()
    memory = _memory(model)
    (row,) = _run(model, memory, [_text(80)])
    text = _text(12, seed=9)
    inputs, targets = ByteTokenizer().stream(text, None, torch.device("cpu"))
    out = model(inputs[None].expand(2, -1), model.init_state(2))
    log_dist = torch.log_softmax(out.logits, -1)
    assert out.hidden is not None
    read, _ = memory.read(log_dist, inputs[None].expand(2, -1), out.hidden, None,
                          [memory.view(row.memories["head"])], torch.tensor([0, -1]))
    mask = torch.ones(1, targets.numel(), dtype=torch.bool)
    learned, _, _ = memory.learn(log_dist[:1], inputs[None], targets[None], mask, out.hidden[:1],
                              [row.memories["head"]])
    torch.testing.assert_close(read[0], learned[0], rtol=0, atol=1e-9)
    torch.testing.assert_close(read[1], log_dist[1], rtol=0, atol=1e-9)


def test_a_served_session_learns_exports_and_imports(tiny_checkpoint: Path) -> None:
    """On a trained checkpoint, through `SessionModel` (the engine's batched step, the copy model after it): a session
    with the memory on gains over the same session with it off, and an exported and imported session goes on
    exactly as the one that was never exported."""
    from server.engine._export import export_session, import_session

    ckpt = load_checkpoint(tiny_checkpoint)
    sm = SessionModel.of(ckpt)
    assert "head" in sm.memories and sm.memories["head"].defaults() is None  # no "head" section: off
    text = b"the cat sat on the mat, the cat sat on the hat; " * 6
    asked = {"head": {"lr": 2e-3, "decay": 1e-4}}
    on, off = (sm.observe(sm.fresh(sm.config(a)), text, shadow=False) for a in (asked, {}))
    assert on.stats.bits < 0.97 * off.stats.bits
    delta = on.memories["head"].tensors["delta"]
    assert delta.dtype == STATE_DTYPE and delta.any()
    blob = export_session(on, "hash", sm)
    back, config = import_session(blob, model_hash="hash", template=sm.fresh(sm.config()), sessions=sm)
    assert config.get("head") == HeadSettings(lr=2e-3, decay=1e-4)
    assert torch.equal(back.memories["head"].tensors["delta"], delta)
    more = b"the rat sat on the cat. "
    a, b = sm.observe(on, more, shadow=False), sm.observe(back, more, shadow=False)
    assert a.stats.bits == b.stats.bits
    assert torch.equal(a.memories["head"].tensors["delta"], b.memories["head"].tensors["delta"])


def test_the_checkpoint_section_makes_it_the_default_in_place_of_the_adapter(tiny_checkpoint: Path) -> None:
    """dyneval.json's "head" section turns the memory on for new sessions at its rate and decay; the "session"
    section's "adapter": false leaves M off unless a session asks for it (then at the checkpoint's settings)."""
    ckpt = load_checkpoint(tiny_checkpoint)
    raw = dict(ckpt.dyneval)
    raw["head"] = {"lr": 1e-4, "decay": 1e-3}
    raw["session"] = {**raw.get("session", {}), "adapter": False}
    sm = SessionModel.of(dataclasses.replace(ckpt, dyneval=DynEvalSettings(raw)))
    config = sm.config()
    assert config.get("head") == HeadSettings(lr=1e-4, decay=1e-3) and "adapter" not in config
    asked = sm.config({"adapter": {"lr": 0.0}})
    assert asked.get("adapter") == AdapterSettings(lr=0.0, decay=ckpt.dyneval.session.decay,
                                                   size=sm.memories["adapter"].settings().size)  # type: ignore[attr-defined]
    with pytest.raises(MemorySettingsError):
        sm.config({"adapter": {"lr": -1.0}})
    raw["session"]["adapter"] = "no"
    with pytest.raises(ValueError, match="adapter must be true or false"):
        SessionModel.of(dataclasses.replace(ckpt, dyneval=DynEvalSettings(raw)))
    assert "adapter" in SessionModel.of(ckpt).config()  # without the key: on, as before
