"""Training on a CUDA device (`gpu` marker: skipped without CUDA; `pytest -m gpu` on a GPU machine). Imports
nothing of the server, so it runs where only the trainer's packages are installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.adaptation import evaluate
from models.checkpoint import load_checkpoint
from trainer.config import make_config
from trainer.evaluation import config_for
from trainer.train import train

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parent.parent / "data"
TEXT = b"It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 4


def test_transformer_trains_in_the_devices_precision_with_tf32_put_back(tmp_path: Path) -> None:
    """precision "auto" is bf16 on a GPU with bf16; float32 matmuls use TF32 while training, not after; gradient
    accumulation and the slim checkpoint (no training-only heads) on the device; full dynamic evaluation of the
    later layers there."""
    before = torch.get_float32_matmul_precision()
    cfg = make_config("tiny", {"arch": "char-transformer", "max_steps": 6, "valid_every": 3, "precision": "auto",
                               "accumulate": 2, "ship_training_only": False})
    train(cfg, [DATA / "train.txt"], out=tmp_path / "ck", valid_path=DATA / "valid.txt", progress=False,
          device="cuda")
    assert torch.get_float32_matmul_precision() == before
    ck = load_checkpoint(tmp_path / "ck", device="cuda")
    expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    assert ck.meta["training"]["precision"] == expected and expected in ck.card
    assert ck.meta["training_only_parameters_shipped"] is False
    full = evaluate(ck.model, TEXT, config_for("dynamic", ck.dyneval, layers_from=2), stats=ck.stats)
    assert full.bits > 0 and full.skipped_updates == 0
