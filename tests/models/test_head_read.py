"""The head memory's search read (`HeadMemory.read`) over a round of many sessions' rows: the numbers of one product
and one log-softmax per session, in one log-softmax for the batch where each session's rows are together (a search
round's layout), whatever the layout of the rows."""

from __future__ import annotations

import pytest
import torch

from models.adaptation._head_memory import HeadMemory, HeadSettings
from models.base import State
from tests.models.conftest import tiny_mlstm


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny matrices (tests/models/conftest.py)."""


def _memory_and_views(sessions: int) -> tuple[HeadMemory, list[torch.Tensor]]:
    model = tiny_mlstm(0, 16).float()
    g = torch.Generator().manual_seed(1)
    memory = HeadMemory(model, torch.rand(model.head.v.shape, generator=g) * 1e-3 + 1e-5, 1e-5)
    views = []
    for _ in range(sessions):
        state = memory.init(HeadSettings(lr=1e-3, decay=0.0), torch.device("cpu"))
        delta = (torch.randn(state.tensors["delta"].shape, generator=g) * 0.3).to(state.tensors["delta"].dtype)
        views.append(memory.view(State({**state.tensors, "delta": delta})))
    return memory, views


def _one_by_one(log_dist: torch.Tensor, hidden: torch.Tensor, views: list[torch.Tensor],
                index: list[int]) -> torch.Tensor:
    """The read session by session: its rows gathered, one product, one log-softmax."""
    out = log_dist.clone()
    for s in sorted(set(index) - {-1}):
        rows = torch.tensor([b for b, r in enumerate(index) if r == s])
        out[rows] = torch.log_softmax(log_dist[rows] + hidden[rows] @ views[s].t(), -1)
    return out


@pytest.mark.parametrize("index", [
    [0, 0, 0, 1, 1, 2, 2, 2, 2, 3],  # a round: each search's rows together
    [2, 2, 0, 0, 0, 0, 1],  # sessions in any order
    [0, 1, 0, 1, 2, 2],  # a session's rows apart
    [0, 0, -1, 1, 1, -1],  # rows of no session keep their distribution
])
def test_read_is_each_sessions_product_and_log_softmax(index: list[int]) -> None:
    memory, views = _memory_and_views(4)
    g = torch.Generator().manual_seed(2)
    B, V = len(index), memory.v.shape[0]
    log_dist = torch.log_softmax(torch.randn(B, 1, V, generator=g) * 3, -1)
    hidden = torch.randn(B, 1, memory.v.shape[1], generator=g)
    out, branch = memory.read(log_dist, torch.zeros(B, 1, dtype=torch.long), hidden, None, views,
                              torch.tensor(index))
    assert branch is None
    assert torch.equal(out, _one_by_one(log_dist, hidden, views, index))


def test_a_round_of_many_sessions_takes_one_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    memory, views = _memory_and_views(8)
    index = [s for s in range(8) for _ in range(3)]
    B, V = len(index), memory.v.shape[0]
    log_dist = torch.log_softmax(torch.randn(B, 1, V), -1)
    calls = []
    softmax = torch.log_softmax

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return softmax(*args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(torch, "log_softmax", counted)
    memory.read(log_dist, torch.zeros(B, 1, dtype=torch.long),
                torch.randn(B, 1, memory.v.shape[1]), None, views, torch.tensor(index))
    assert len(calls) == 1
