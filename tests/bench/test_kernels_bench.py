"""bench.kernels' timing in turns (`Bench.alternating`): each contender of a case keeps the least of its round
medians, a contender that fails in any round is an error row, and rows keep the order the cases were made in."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.kernels import Bench


def test_contenders_are_timed_in_turns_and_keep_their_best_round(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Bench(torch.device("cpu"), quick=True)
    b.rounds = 3
    order: list[str] = []
    times = {"a": iter([5.0, 3.0, 4.0]), "b": iter([2.0, 9.0, 1.0])}

    def time_ms(fn: Any, share: float = 1.0) -> float:
        assert share == pytest.approx(1 / 3)
        name = fn()
        order.append(name)
        if name == "c":
            raise RuntimeError("launch failed")
        return next(times[name])

    monkeypatch.setattr(b, "time_ms", time_ms)
    with b.alternating():
        b.case("op", "case", "a", lambda: lambda: "a")
        b.case("op", "case", "missing", lambda: None)  # a path that does not exist: n/a, never timed
        b.case("op", "case", "b", lambda: lambda: "b", baseline="a")
        b.case("op", "case", "c", lambda: lambda: "c")
    assert order[:3] == ["a", "b", "c"] and order[3:5] == ["a", "b"]  # round by round; c left out once it failed
    assert [(r.impl, r.ms, r.error) for r in b.results] == [
        ("a", 3.0, ""), ("missing", None, "n/a"), ("b", 1.0, ""), ("c", None, "RuntimeError: launch failed")]
    assert order.count("c") == 1
