"""The mLSTM's step as CUDA graphs (models/step_graphs.py) on a CUDA device (`gpu` marker: skipped without CUDA;
`pytest -m gpu` on a GPU machine): each captured shape's replay gives the eager padded path's numbers, and those of
the model's own path, for every row bucket, chunk and adapter form; replays read fresh inputs; the engine serves the
same bits with graphs on and off. The padding logic itself is tested on the CPU (tests/models/test_step_graphs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.base import Adapter, Output, State
from models.checkpoint import load_checkpoint
from models.mlstm import MLSTM
from models.step_graphs import StepRunner
from server.engine import Engine
from tests._gpu import GPU, TEXT, observe, served

pytestmark = GPU


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> MLSTM:
    m = load_checkpoint(tiny_checkpoint, device="cuda").model
    assert isinstance(m, MLSTM) and m.frozen
    return m


def _inputs(model: MLSTM, B: int, T: int, form: str, seed: int) -> tuple[torch.Tensor, State, Adapter | None]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    H = model.config.hidden
    k = min(H, 64)
    tokens = torch.randint(0, 256, (B, T), generator=g, device="cuda")
    state = State({"h": torch.randn(B, H, generator=g, device="cuda") * 0.3,
                   "c": torch.randn(B, H, generator=g, device="cuda") * 0.3})
    if form == "none":
        return tokens, state, None
    if form == "rows":
        return tokens, state, Adapter({"h": torch.randn(B, k, k, generator=g, device="cuda") * 0.05})
    counts = tuple([2] * (B // 2) + [1] * (B % 2))
    return tokens, state, Adapter({"h": torch.randn(len(counts), k, k, generator=g, device="cuda") * 0.05},
                                  counts=counts)


def _run(model: MLSTM, runner: StepRunner | None, inputs: tuple[torch.Tensor, State, Adapter | None]) -> Output:
    model.step_runner = runner
    try:
        with torch.no_grad():
            out: Output = model(*inputs)
            return out
    finally:
        model.step_runner = None


def _close(a: Output, b: Output, tol: float) -> None:
    assert b.hidden is not None and a.hidden is not None
    for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.state.tensors["h"], b.state.tensors["h"]),
                 (a.state.tensors["c"], b.state.tensors["c"])):
        torch.testing.assert_close(y, x, rtol=tol, atol=tol)


@pytest.mark.parametrize("form", ["none", "rows", "groups"])
def test_replay_equals_eager_for_each_bucket(model: MLSTM, form: str) -> None:
    graphs = StepRunner(model, graphs=True, max_rows=256, max_chunk=32)
    eager = StepRunner(model, graphs=False, max_rows=256, max_chunk=32)
    for B in (1, 2, 3, 8, 13, 64, 200):  # buckets 1, 2, 4, 8, 16, 64, 256
        for T in (1, 5, 20, 77):  # chunks 1; 4+1; 16+4; 32+32+8+4+1
            for seed in (1, 2):  # the second call replays the graphs on other inputs
                inputs = _inputs(model, B, T, form, seed)
                replayed, padded = _run(model, graphs, inputs), _run(model, eager, inputs)
                own = _run(model, None, inputs)
                _close(padded, replayed, 1e-5)  # the same kernels at the same shapes
                _close(own, replayed, 1e-4)  # other row counts: cuBLAS may sum in another order
    assert graphs.declined == 0 and graphs.captured > 0
    assert graphs.captured == 7 * 5  # once per (row bucket, chunk): 7 buckets, chunks of 1, 4, 8, 16 and 32


def test_replay_under_bf16_autocast(model: MLSTM) -> None:
    graphs = StepRunner(model, graphs=True, max_rows=64, max_chunk=32)
    inputs = _inputs(model, 5, 20, "rows", 3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        replayed, own = _run(model, graphs, inputs), _run(model, None, inputs)
    assert graphs.calls == 1
    _close(own, replayed, 2e-3)


async def _observe(engine: Engine) -> tuple[float, float, float]:
    session_id, observed = await observe(engine)
    suggested = await engine.suggest(session_id, None, "It is a tr")
    assert suggested.completions
    return observed, (await engine.score(TEXT)).bits, suggested.completions[0].prob


def test_the_engine_serves_the_same_with_graphs_on_and_off(tiny_checkpoint: Path) -> None:
    results = {mode: served(tiny_checkpoint, _observe, device="cuda", precision="float32", cuda_graphs=mode,
                            suggest_budget_ms=0) for mode in ("off", "on")}
    assert results["on"] == pytest.approx(results["off"], rel=1e-4)
