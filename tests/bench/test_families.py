"""`python -m bench.families`' cold-start column: 128-byte pieces scored as a new session or a stateless /v1/score
reads them (`score_bytes`: the start token first, every byte scored)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.families import cold_bpb
from models.checkpoint import load_checkpoint
from models.scoring import score_bytes

DATA = Path(__file__).resolve().parents[1] / "data"


def test_cold_pieces_are_scored_as_score_bytes_scores_them(tiny_checkpoint: Path) -> None:
    ck = load_checkpoint(tiny_checkpoint)
    text = (DATA / "valid.txt").read_bytes()
    pieces = [text[i * 300 : i * 300 + 32] for i in range(5)]
    want = sum(score_bytes(ck.model, p).bits for p in pieces) / sum(map(len, pieces))
    # fails before: the pieces joined and split into rows, each row's first byte an unscored input instead of BOS
    assert cold_bpb(ck.model, pieces, ck.tokenizer.bos) == pytest.approx(want, rel=1e-5)
