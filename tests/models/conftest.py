"""Fixtures shared by the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from models.mlstm import MLSTM, MLSTMConfig


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matrices: one torch thread (several spin and wait on a busy 2-core machine, up to 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_mlstm(seed: int = 0, hidden: int = 16) -> MLSTM:
    """A frozen float64 mLSTM of `hidden` units with a wide embedding (distinct rows), for exact comparisons."""
    torch.manual_seed(seed)
    model = MLSTM(MLSTMConfig(hidden=hidden, embed_dim=8, dropout_hidden=0.0)).double()
    with torch.no_grad():
        model.embed.weight.normal_(0, 1.0)
    return model.freeze()  # type: ignore[return-value]
