"""The mLSTM's bucketed static-shape step (models/step_graphs.py) on the CPU: its padded, chunked path gives the
numbers of the model's own path for the real rows, padded rows never reach them, and the paths that use it
(scoring, observes, the keyboard search, the engine with ADAPTLM_CUDA_GRAPHS=on) answer as without it. The CUDA
graphs themselves: tests/test_gpu_graphs.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from models.base import Adapter, State
from models.checkpoint import load_checkpoint
from models.mlstm import MLSTM, MLSTMConfig
from models.scoring import score_bytes
from models.session import SessionModel
from models.step_graphs import StepRunner, chunks, install_step_runner, row_bucket, wants_runner
from models.suggest import advance, suggest
from server.app import start_engine
from server.engine import Engine, EngineConfig
from server.settings import Settings

H, K = 32, 8
TEXT = b"It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 3


@pytest.fixture(scope="module")
def model() -> MLSTM:
    torch.manual_seed(0)
    m = MLSTM(MLSTMConfig(embed_dim=16, hidden=H))
    m.eval().freeze()
    return m


def _inputs(B: int, T: int, form: str, seed: int = 1) -> tuple[torch.Tensor, State, Adapter | None]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (B, T), generator=g)
    state = State({"h": torch.randn(B, H, generator=g) * 0.3, "c": torch.randn(B, H, generator=g) * 0.3})
    if form == "none":
        return tokens, state, None
    if form == "rows":
        return tokens, state, Adapter({"h": torch.randn(B, K, K, generator=g) * 0.2})
    counts = tuple([1] * (B % 3) + [2] * ((B - B % 3) // 2) + [1] * ((B - B % 3) % 2))  # mixed group sizes
    assert sum(counts) == B
    return tokens, state, Adapter({"h": torch.randn(len(counts), K, K, generator=g) * 0.2}, counts=counts)


def _both(model: MLSTM, tokens: torch.Tensor, state: State, adapter: Adapter | None,
          autocast: bool = False) -> tuple[object, object, StepRunner]:
    runner = StepRunner(model, graphs=False, max_rows=64, max_chunk=8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.step_runner = None
        own = model(tokens, state, adapter)
        model.step_runner = runner
        try:
            bucketed = model(tokens, state, adapter)
        finally:
            model.step_runner = None
    return own, bucketed, runner


def _close(a: object, b: object) -> None:
    for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.state.tensors["h"], b.state.tensors["h"]),  # type: ignore[attr-defined]
                 (a.state.tensors["c"], b.state.tensors["c"])):  # type: ignore[attr-defined]
        assert x.shape == y.shape
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_buckets_and_chunks() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 2048)] == [1, 2, 4, 8, 8, 16, 2048]
    assert chunks(20, 32) == [16, 4]
    assert chunks(1, 32) == [1]
    assert chunks(100, 32) == [32, 32, 32, 4]
    assert all(sum(chunks(n, 8)) == n and all(c <= 8 and c & (c - 1) == 0 for c in chunks(n, 8)) for n in range(1, 70))


@pytest.mark.parametrize("form", ["none", "rows", "groups"])
def test_padded_chunked_step_equals_the_models_own(model: MLSTM, one_thread: None, form: str) -> None:
    # rows 1..5 pad to 1, 2, 4, 8; 1, 7 and 19 steps are one chunk, three and three (8 + 8 + 2 + 1)
    for B in (1, 3, 5):
        for T in (1, 7, 19):
            own, bucketed, runner = _both(model, *_inputs(B, T, form))
            assert runner.calls == 1 and runner.declined == 0
            _close(own, bucketed)


def test_under_bf16_autocast_it_takes_the_models_precision(model: MLSTM, one_thread: None) -> None:
    own, bucketed, runner = _both(model, *_inputs(3, 5, "groups"), autocast=True)
    assert runner.calls == 1
    _close(own, bucketed)
    plain, _, _ = _both(model, *_inputs(3, 5, "groups"))
    assert not torch.equal(plain.logits, own.logits)  # type: ignore[attr-defined]  # bf16 matmuls did run


def test_padded_rows_never_reach_real_rows(model: MLSTM, one_thread: None) -> None:
    runner = StepRunner(model, graphs=False, max_rows=64, max_chunk=8)
    model.step_runner = runner
    try:
        with torch.no_grad():
            # a batch of 8 rows poisoned with NaN fills the 8-row buffers; then 5 real rows in the same buffers
            tokens, state, adapter = _inputs(8, 4, "rows")
            poisoned = State({k: torch.full_like(v, float("nan")) for k, v in state.tensors.items()})
            assert torch.isnan(model(tokens, poisoned, adapter).logits).all()
            tokens, state, adapter = _inputs(5, 4, "rows", seed=2)
            out = model(tokens, state, adapter)
            model.step_runner = None
            own = model(tokens, state, adapter)
    finally:
        model.step_runner = None
    assert runner.calls == 2
    _close(own, out)
    assert torch.isfinite(out.logits).all()


def test_calls_it_does_not_run_take_the_models_path(model: MLSTM, one_thread: None) -> None:
    runner = StepRunner(model, graphs=False, max_rows=4, max_chunk=8)
    model.step_runner = runner
    try:
        tokens, state, adapter = _inputs(3, 4, "rows")
        mats = adapter.mats["h"].clone().requires_grad_(True)  # type: ignore[union-attr]
        out = model(tokens, state, Adapter({"h": mats}))  # gradients: the sparse adaptation's path
        assert out.logits.requires_grad
        with torch.no_grad():
            model(*_inputs(5, 4, "none"))  # more rows than max_rows
    finally:
        model.step_runner = None
    assert runner.calls == 0 and runner.declined == 1


def test_settings_values() -> None:
    assert not wants_runner("auto", torch.device("cpu")) and wants_runner("auto", torch.device("cuda"))
    assert wants_runner("on", torch.device("cpu")) and not wants_runner("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="cuda_graphs"):
        wants_runner("sometimes", torch.device("cpu"))
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="sometimes")
    with pytest.raises(ValidationError, match="cuda_graphs"):
        Settings.model_validate({"cuda_graphs": "sometimes"})
    assert Settings.model_fields["cuda_graphs"].default == "auto" and EngineConfig().cuda_graphs == "auto"
    with pytest.raises(ValueError, match="CUDA"):
        StepRunner(MLSTM(MLSTMConfig(embed_dim=8, hidden=8)), graphs=True)


def test_observes_scores_and_the_search_answer_as_without_it(tiny_checkpoint: Path, one_thread: None) -> None:
    ckpt = load_checkpoint(tiny_checkpoint)
    model = ckpt.model
    assert isinstance(model, MLSTM)
    sessions = SessionModel.of(ckpt)
    results = {}
    for mode in ("off", "on"):
        runner = install_step_runner(model, mode)
        session = sessions.observe(sessions.fresh(sessions.config()), TEXT)  # adapting row + its static shadow
        static = score_bytes(model, TEXT)
        adapter = session.adapter
        cursor = advance(model, session.state, TEXT[-1:] + b"It is a tr", adapter)
        found = suggest(model, cursor, "It is a tr", adapter)
        results[mode] = (session, static.bits, found)
        if mode == "on":
            assert runner is not None and runner.calls > 10 and model.step_runner is runner
        else:
            assert runner is None and model.step_runner is None
    model.step_runner = None
    (off, off_bits, off_found), (on, on_bits, on_found) = results["off"], results["on"]
    assert on.stats.bits == pytest.approx(off.stats.bits, rel=1e-6)
    assert on.stats.static_bits == pytest.approx(off.stats.static_bits, rel=1e-6)
    assert on_bits == pytest.approx(off_bits, rel=1e-6)
    torch.testing.assert_close(on.adapter.mats["h"], off.adapter.mats["h"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(on.state.tensors["h"], off.state.tensors["h"], rtol=1e-5, atol=1e-6)
    assert [c.text for c in on_found.completions] == [c.text for c in off_found.completions]
    assert [c.prob for c in on_found.completions] == pytest.approx([c.prob for c in off_found.completions],
                                                                      rel=1e-5)


def test_the_engine_serves_with_it_on_the_cpu(tiny_checkpoint: Path, one_thread: None) -> None:
    async def scores(engine: Engine) -> tuple[float, float]:
        session, _ = await engine.create_session(owner=None)
        observed = await engine.score(TEXT, session_id=session.id, adapt=True)
        return observed.bits, (await engine.score(TEXT)).bits

    results = {}
    for mode in ("off", "on"):
        # as `adaptlm serve` starts it from ADAPTLM_CUDA_GRAPHS
        engine = start_engine(Settings(checkpoint=tiny_checkpoint, precision="float32", cuda_graphs=mode))
        assert engine.config.cuda_graphs == mode
        try:
            results[mode] = asyncio.run(scores(engine))
        finally:
            engine.stop()
    assert results["on"] == pytest.approx(results["off"], rel=1e-6)


def test_session_indexed_adapters_through_the_triton_kernel(model: MLSTM, one_thread: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # what a CUDA device with Triton runs in its graphs (no per-row gather), here under Triton's interpreter
    pytest.importorskip("triton")
    monkeypatch.setattr(StepRunner, "_triton_groups", lambda self: True)
    own, bucketed, runner = _both(model, *_inputs(3, 2, "groups"))
    assert runner.calls == 1
    _close(own, bucketed)


def test_a_shape_whose_capture_fails_takes_the_models_path(model: MLSTM, one_thread: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # (a capture needs CUDA: here the capture itself is what fails, as an operation that syncs with the host would)
    def broken(self: StepRunner, *args: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StepRunner, "_capture", broken)
    runner = StepRunner(model, graphs=False, max_rows=64, max_chunk=8)
    runner.graphs = True  # as on CUDA, without the device
    tokens, state, adapter = _inputs(3, 5, "rows")
    model.step_runner = runner
    try:
        with torch.no_grad():
            first, second = model(tokens, state, adapter), model(tokens, state, adapter)
        model.step_runner = None
        with torch.no_grad():
            own = model(tokens, state, adapter)
    finally:
        model.step_runner = None
    _close(own, first)
    _close(own, second)
    assert runner.calls == 0 and runner.declined == 2  # the second call knows the shape and does not try again


def test_per_row_adapters_beyond_the_buffer_limit_take_the_models_path(model: MLSTM, one_thread: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import models.step_graphs as step_graphs

    monkeypatch.setattr(step_graphs, "_ROWS_BYTES", 4 * K * K * 4)  # four rows' matrices
    within, beyond = _both(model, *_inputs(3, 2, "rows")), _both(model, *_inputs(5, 2, "rows"))  # pad to 4, to 8
    assert (within[2].calls, within[2].declined) == (1, 0)
    assert (beyond[2].calls, beyond[2].declined) == (0, 1)
    _close(beyond[0], beyond[1])
