"""The shipped default checkpoint: present, within its size budget, loadable, and a real model."""

import json
from pathlib import Path

import pytest

from models.checkpoint import CHECKPOINT_FILES, load_checkpoint
from models.scoring import score_bytes

DEFAULT = Path(__file__).resolve().parent.parent / "checkpoints" / "default"
DATA = Path(__file__).resolve().parent / "data"


def test_default_checkpoint_is_complete_and_small() -> None:
    for name in CHECKPOINT_FILES:
        assert (DEFAULT / name).is_file(), name
    size = sum(p.stat().st_size for p in DEFAULT.iterdir() if p.is_file())
    assert size <= 20 * 1024 * 1024


def test_default_checkpoint_scores_english_well() -> None:
    ck = load_checkpoint(DEFAULT)
    meta = json.loads((DEFAULT / "config.json").read_text())
    assert meta["metrics"]["valid_bpb"] <= 2.2
    assert "Validation bits per byte" in ck.card
    # an excerpt it was not trained on (Sense and Sensibility was in its training mix: pick a non-Austen line)
    text = b"The quick brown fox jumps over the lazy dog, and the dog, being lazy, did not mind it at all.\n"
    english = score_bytes(ck.model, text).bits_per_byte
    noise = score_bytes(ck.model, bytes(range(256)) * 2).bits_per_byte
    assert english < 3.0
    assert noise > english + 3.0


@pytest.mark.parametrize("key", ["param.w_m.v", "adapter.h"])
def test_default_checkpoint_has_gradient_statistics(key: str) -> None:
    ck = load_checkpoint(DEFAULT)
    assert key in ck.stats
    assert float(ck.stats[key].min()) >= 0 and float(ck.stats[key].max()) > 0
