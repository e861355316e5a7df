"""The same work on a CUDA device as on the CPU (`gpu` marker: skipped without CUDA; `pytest -m gpu` on a GPU
machine). Each compares the device's figures with the CPU's on the same weights, within float32 tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.adaptation import evaluate
from models.checkpoint import load_checkpoint
from models.device import resolve_device
from models.sampling import SamplingParams, generate
from models.scoring import score_bytes
from server.engine import Engine
from tests._gpu import GPU, TEXT, observe, served
from trainer.config import make_config
from trainer.evaluation import config_for
from trainer.train import train

pytestmark = GPU

DATA = Path(__file__).resolve().parent / "data"


def test_auto_is_cuda() -> None:
    assert resolve_device("auto").type == "cuda"


def test_scoring_and_sparse_evaluation_match_the_cpu(tiny_checkpoint: Path) -> None:
    cpu = load_checkpoint(tiny_checkpoint)
    gpu = load_checkpoint(tiny_checkpoint, device="cuda")
    assert gpu.device.type == "cuda" and gpu.model.frozen
    assert score_bytes(gpu.model, TEXT).bits == pytest.approx(score_bytes(cpu.model, TEXT).bits, rel=1e-4)
    cfg = config_for("sparse", cpu.dyneval)
    on_cpu = evaluate(cpu.model, TEXT, cfg, stats=cpu.stats)
    on_gpu = evaluate(gpu.model, TEXT, cfg, stats=gpu.stats)
    assert on_gpu.bits == pytest.approx(on_cpu.bits, rel=1e-3)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    assert "".join(generate(gpu.model, b"It is a ", greedy))  # runs there (the argmax may differ in the last ulp)


async def _observe(engine: Engine) -> tuple[float, float]:
    _, observed = await observe(engine)
    static = await engine.score(TEXT)
    return observed, static.bits


def test_the_engine_serves_sessions_on_the_device(tiny_checkpoint: Path) -> None:
    results = {device: served(tiny_checkpoint, _observe, device=device, precision="float32")
               for device in ("cpu", "cuda")}
    assert results["cuda"] == pytest.approx(results["cpu"], rel=1e-3)


def test_training_runs_on_the_device(tmp_path: Path) -> None:
    result = train(make_config("tiny", {"max_steps": 5}), [DATA / "train.txt"], out=tmp_path / "ck",
                   valid_path=DATA / "valid.txt", progress=False, device="cuda")
    assert result.steps == 5
    assert load_checkpoint(tmp_path / "ck").model.frozen
    assert torch.cuda.is_available()


@pytest.mark.parametrize("name", ["compressive", "char-transformer"])
def test_the_kernels_pass_their_start_up_check_on_the_shipped_transformers(name: str) -> None:
    # the server serves with the Triton kernels only if this holds (server/engine/_loading.py `serving_kernels`)
    from server.engine._kernel_check import check_model

    ckpt = load_checkpoint(Path(__file__).resolve().parent.parent / "checkpoints" / name, device="cuda")
    assert check_model(ckpt.model, ckpt.tokenizer.vocab_size) is None


CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


async def _session_figures(engine: Engine) -> tuple[float, float, list[tuple[str, float]], list[tuple[str, float]]]:
    """A keyboard user's session as served: two observes, then suggestions mid-word."""
    session_id, first = await observe(engine)
    second = await engine.score(TEXT, session_id=session_id, adapt=True)  # the adapter and any copy model learned
    found = await engine.suggest(session_id, None, "It is a tr", k=3)
    return (first, second.bits, [(c.text, c.prob) for c in found.completions],
            [(c.char, c.prob) for c in found.next_chars])


@pytest.mark.parametrize("name", ["default", "words", "compressive", "char-transformer"])
def test_the_shipped_checkpoints_sessions_on_the_device_match_the_cpu(name: str) -> None:
    # every shipped model's sessions as a server runs them on a GPU: the copy model (default), the word model's
    # tokens, the transformers' attention through the Triton kernels (when they passed their start-up check)
    figures = {device: served(CHECKPOINTS / name, _session_figures, device=device, precision="float32",
                              suggest_budget_ms=0) for device in ("cpu", "cuda")}
    (cpu_first, cpu_second, cpu_words, cpu_chars), (first, second, words, chars) = figures["cpu"], figures["cuda"]
    assert second < first  # it adapted on the device too
    # (the default's second observe is under a bit in all: the copy model has seen it; hence the absolute margin)
    assert (first, second) == pytest.approx((cpu_first, cpu_second), rel=1e-3, abs=0.05)
    assert [w for w, _ in words][:1] == [w for w, _ in cpu_words][:1]
    assert [p for _, p in words] == pytest.approx([p for _, p in cpu_words], rel=2e-2, abs=1e-3)
    assert dict(chars) == pytest.approx(dict(cpu_chars), rel=2e-2, abs=1e-3)
