"""What the session guards did, counted without a read back from the device a step (`Row.updates`, `dropped`,
`resets`; models/adaptation/_step.py): on a GPU a read back waits for everything queued, so the counts of the applied,
refused and reset updates stay on the device until they are read, and a batch with no adapter M to reset reads
nothing back at all. On the CPU the reads are counted where Python asks a tensor for its values."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch

from models.adaptation import Row, TextJob, UpdateRule, batch_step
from models.adaptation._config import DynEvalConfig
from models.adaptation._head_memory import STATE_DTYPE, HeadMemory
from models.base import State
from models.memory import Learned, Memory
from models.sampling import SamplingParams, Stepper, draw_next, filter_logits, sample_next
from tests.models.conftest import tiny_mlstm

SEGMENT = 8
# the ways Python code reads a tensor's values on the host (each waits for a GPU's queue)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu")


@contextlib.contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the tensor methods that read values back to the host, one entry a call, while inside."""
    seen: list[str] = []
    with monkeypatch.context() as patch:
        for name in READS:
            original = getattr(torch.Tensor, name)

            def read(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
                seen.append(_name)
                return _original(self, *args, **kw)

            patch.setattr(torch.Tensor, name, read)
        yield seen


class Stepping(Memory):
    """A distribution memory that changes no score and reports the weight steps it is given, row by row."""

    name: ClassVar[str] = "stepping"
    kind: ClassVar[Any] = "distribution"

    def __init__(self, steps: Sequence[tuple[int, int, int]]) -> None:
        self.steps = torch.tensor(steps, dtype=torch.int64)

    def learn(self, log_dist: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              hidden: torch.Tensor | None, states: Sequence[Any]) -> Learned:
        return Learned(log_dist, list(states), self.steps[: len(states)])


def _rule(scale: float) -> UpdateRule:
    rule = UpdateRule(DynEvalConfig(mode="sparse", rule="sgd", lr=0.01, decay=0.0), ["h"])
    rule.scale["h"] = scale
    return rule


def _job(model: Any, text: bytes, rows: list[Row]) -> TextJob:
    tokens = torch.tensor(list(text), dtype=torch.long)
    return TextJob(tokens[:-1], tokens[1:], rows)


def test_a_batch_counts_the_applied_refused_and_reset_updates_of_each_row() -> None:
    model = tiny_mlstm()
    k = model.adaptation_sites()[0].dim
    text = b"the guards count what they did, row by row, " * 2  # several segments
    plain = Row(model.init_state(1), {"h": torch.zeros(k, k, dtype=torch.float64)}, _rule(0.01),
                memories={"stepping": None})  # M and a memory that learns: two updates a segment
    refused = Row(model.init_state(1), {"h": torch.zeros(k, k, dtype=torch.float64)}, _rule(math.inf))  # M -> inf
    huge = Row(model.init_state(1), {"h": torch.full((k, k), 1e300, dtype=torch.float64)}, _rule(0.01))  # diverged
    shadow = Row(model.init_state(1))
    jobs = [_job(model, text, [plain, refused, shadow]), _job(model, text, [huge])]
    memories = {"stepping": Stepping([(1, 0, 0)])}
    batch_step(model, jobs, SEGMENT, memories=memories)
    assert (jobs[0].pos, jobs[1].pos) == (SEGMENT, 0)  # the reset row's job redoes its segment
    assert [(r.updates, r.dropped, r.resets) for r in (plain, refused, shadow, huge)] == \
        [(2, 0, 0), (0, 1, 0), (0, 0, 0), (0, 0, 1)]
    while not all(job.done for job in jobs):
        batch_step(model, [job for job in jobs if not job.done], SEGMENT, memories=memories)
    segments = -(-(len(text) - 1) // SEGMENT)
    assert [(r.updates, r.dropped, r.resets) for r in (plain, refused, shadow, huge)] == \
        [(2 * segments, 0, 0), (0, segments, 0), (0, 0, 0), (segments, 0, 1)]
    assert refused.mats is not None and not refused.mats["h"].any()  # every refused update left M as it was


def test_the_counts_stay_on_the_device_until_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Static scores, shadows and sessions whose learned part is a memory (the shipped default: the head's delta, no
    M): no row can be reset and its segment redone, so a step reads nothing back; the counts are read when asked,
    once a row."""
    model = tiny_mlstm()
    memory = Stepping([(1, 0, 0), (0, 1, 1)])
    text = b"nothing to read back until the end " * 2
    rows = [*(Row(model.init_state(1), memories={"stepping": None}) for _ in range(2)), Row(model.init_state(1))]
    job = _job(model, text, rows)
    steps = 0
    with host_reads(monkeypatch) as reads:
        while not job.done:
            batch_step(model, [job], SEGMENT, memories={"stepping": memory})
            steps += 1
        assert reads == []
        counts = [(r.updates, r.dropped, r.resets) for r in rows]
        assert reads == ["tolist", "tolist"]  # each row with counts on the device, once
        assert [(r.updates, r.dropped, r.resets) for r in rows] == counts and len(reads) == 2
    assert steps > 2 and counts == [(steps, 0, 0), (0, steps, steps), (0, 0, 0)]


def test_rows_of_many_steps_fold_their_counts_on_the_device() -> None:
    model = tiny_mlstm()
    memory = Stepping([(1, 0, 0)])
    text = bytes(range(97, 123)) * 6  # 155 steps of one token: past the fold at 64 steps, twice
    row = Row(model.init_state(1), memories={"stepping": None})
    job = _job(model, text, [row])
    while not job.done:
        batch_step(model, [job], 1, memories={"stepping": memory})
    assert len(row._on_device) < 64 and row.updates == len(text) - 1


def test_the_head_step_from_the_rows_rates_is_the_rules_step() -> None:
    """On a GPU the head memory makes each row's rule from its rates where they are (`HeadMemory._step_rates`);
    the numbers are those of the rules it builds from the rates read back (the CPU's `_step`), bit for bit."""
    torch.manual_seed(0)
    V, H = 7, 5
    memory = HeadMemory.__new__(HeadMemory)
    memory.ms_v, memory.eps, memory.dtype = torch.rand(V, H) * 1e-3, 1e-6, torch.float32
    memory._rules, memory._parts = {}, None
    rates = torch.tensor([[1e-2, 1e-3], [5e-3, 0.0], [1e-2, 1e-3], [2e-2, 0.5], [1e-4, 1e-30]], dtype=torch.float64)
    old, grad = torch.randn(len(rates), V, H), torch.randn(len(rates), V, H)
    rules = [memory.rule(lr, decay) for lr, decay in rates.tolist()]
    assert torch.equal(memory._step_rates(rates, old, grad), memory._step(rules, old, grad))


def test_the_heads_step_without_reads_is_the_one_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head memory's `learn` as on a GPU (no read back: every row's rule from its rates on the device, the reset's
    second pass always) gives what it gives with the CPU's reads, bit for bit: a reset row (a delta that makes the
    scores non-finite), a refused one (a rate that overflows the step), padding, and rows of three rates."""
    from models.adaptation import _head_memory
    from tests.models.test_head_memory import _memory, _model

    model = _model()
    memory = _memory(model)
    B, T = 5, 12
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, 256, (B, T), generator=g)
    targets = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([T, T, 7, T, 3]).unsqueeze(1)  # (B, T) padded rows
    out = model(inputs, model.init_state(B))
    assert out.hidden is not None
    log_dist = torch.log_softmax(out.logits, -1).detach()
    hidden = out.hidden.detach()
    shape = (1, *model.head.v.shape)
    deltas = [torch.zeros(shape), torch.full(shape, 0.01), torch.full(shape, math.nan), torch.zeros(shape),
              torch.full(shape, -0.02)]
    rates = [(0.02, 0.0), (0.01, 1e-3), (0.02, 0.0), (1e308, 0.0), (0.01, 0.5)]
    states = [State({"delta": d.to(STATE_DTYPE), "rate": torch.tensor([r], dtype=torch.float64)})
              for d, r in zip(deltas, rates, strict=True)]
    with_reads = memory.learn(log_dist, inputs, targets, mask, hidden, states)
    monkeypatch.setattr(_head_memory, "_reads_back", lambda device: False)
    without = memory.learn(log_dist, inputs, targets, mask, hidden, states)
    assert with_reads.steps is not None and without.steps is not None
    assert with_reads.steps[:, 1:].tolist() == [[0, 0], [0, 0], [0, 1], [1, 0], [0, 0]]  # reset; refused
    assert torch.equal(with_reads.steps, without.steps)
    assert torch.equal(with_reads.log_dist, without.log_dist)
    for a, b in zip(with_reads.states, without.states, strict=True):
        assert torch.equal(a.tensors["delta"], b.tensors["delta"])


def test_a_decode_step_reads_its_sequences_tokens_back_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Stepper.draw` leaves the token on the device; one read back takes the tokens of every sequence, and they
    are those `sample` draws one by one."""
    model = tiny_mlstm()
    model.eval()

    def steppers() -> list[Stepper]:
        out = []
        for seed in range(3):
            s = Stepper(model, SamplingParams(max_tokens=50, temperature=1.0, top_p=0.9, seed=seed))
            s.prefill(b"abc")
            out.append(s)
        return out

    one_by_one, together = steppers(), steppers()
    expected = [[s.step().token for s in one_by_one] for _ in range(5)]
    got = []
    for _ in range(5):
        with host_reads(monkeypatch) as reads:
            drawn = [s.draw() for s in together]
            tokens = torch.stack([d[0] for d in drawn]).tolist()
            assert reads == ["tolist"]
        got.append([s.take(t, d).token for s, t, d in zip(together, tokens, drawn, strict=True)])
        Stepper.feed_many(together, got[-1])
    assert got == expected


def test_a_drawn_token_is_the_one_multinomial_draws() -> None:
    """`draw_next` draws as torch.multinomial(p, 1) does (argmax of p / Exp(1) noise), without its read back: the
    same tokens from the same generator state, sampled and filtered distributions alike."""
    for seed in range(40):
        logits = torch.randn(256, generator=torch.Generator().manual_seed(1000 + seed)) * 3
        for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=20), SamplingParams(top_p=0.5)):
            ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            weights = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), -1)
            assert [int(draw_next(logits, params, ours)) for _ in range(4)] == \
                [int(torch.multinomial(weights, 1, generator=theirs)) for _ in range(4)]


def test_a_distribution_with_no_token_to_draw_is_an_error_not_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits with a NaN, a +inf or no finite entry hold no distribution: sampling raises (torch.multinomial's check
    did), greedy decoding too, rather than emit the argmax of NaNs (token 0, or the NaN's index) as text. The check
    rides in the drawn token, read back with it: `draw` still reads nothing back."""
    nan, inf = math.nan, math.inf
    bad = [torch.full((8,), nan), torch.full((8,), -inf), torch.tensor([0.0, -1.0, nan, -2.0]),
           torch.tensor([-1.0, inf, -2.0, -3.0])]
    for logits in bad:
        for params in (SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=2),
                       SamplingParams(top_p=0.5)):
            with pytest.raises(ValueError, match="no token to sample"):
                sample_next(logits, params, torch.Generator().manual_seed(0))
    assert sample_next(torch.tensor([-inf, -1.0, -inf]), SamplingParams(), None) == 1  # -inf entries are fine
    assert sample_next(torch.tensor([-inf, -1.0, -inf]), SamplingParams(temperature=0), None) == 1

    # a sequence whose model gives NaN logits (a diverged state): its sample fails, as the engine's draw then take
    model = tiny_mlstm()
    model.eval()
    stepper = Stepper(model, SamplingParams(max_tokens=5, seed=0))
    stepper.prefill(b"abc")
    assert stepper._logits is not None
    stepper._logits = torch.full_like(stepper._logits, nan)
    with pytest.raises(ValueError, match="no token to sample"):
        stepper.sample()
    with host_reads(monkeypatch) as reads:
        drawn = stepper.draw()
        assert reads == []
    with pytest.raises(ValueError, match="no token to sample"):
        stepper.take(int(drawn[0]), drawn)
    assert stepper.tokens == 0
