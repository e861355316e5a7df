"""`batch_step`'s resident rows (`Row.resident`: a row's tensors are rows of tables that outlive the step, the server's
session slots): gathered by index and written back in place, they score, learn, refuse and reset exactly as rows
that own their tensors."""

from __future__ import annotations

import random

import pytest
import torch

from models.adaptation import DynEvalConfig, Row, TextJob, UpdateRule, batch_step
from models.base import State
from tests.models.conftest import tiny_mlstm


def _text(seed: int, n: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([rng.randrange(256) for _ in range(n)])


@pytest.mark.parametrize("wild", [False, True])  # True: one session's adapter so large that its scores diverge
def test_resident_rows_step_as_owned_rows(wild: bool) -> None:
    model = tiny_mlstm()
    H, k = model.config.hidden, 8
    rule = UpdateRule(DynEvalConfig(mode="sparse", rule="sgd", lr=0.05), ["h"], None)
    g = torch.Generator().manual_seed(0)
    starts = [(torch.randn(1, H, generator=g, dtype=torch.float64) * 0.1,
               torch.randn(1, H, generator=g, dtype=torch.float64) * 0.1,
               torch.randn(1, k, k, generator=g, dtype=torch.float64) * 0.01) for _ in range(3)]
    if wild:  # the guard resets it to 0 and the segment is scored again
        starts[1] = (starts[1][0], starts[1][1], starts[1][2] * 1e6)
    texts = [_text(i, n) for i, n in enumerate((50, 33, 61))]
    # tables of 8 rows; the sessions' rows at scattered places, the shadows after them
    tables = {"h": torch.zeros(8, H, dtype=torch.float64), "c": torch.zeros(8, H, dtype=torch.float64),
              "m": torch.zeros(4, k, k, dtype=torch.float64)}
    slots = [(5, 1), (0, 3), (2, 0)]  # (state row, adapter row) of each session; shadow at state row + 1

    def jobs(resident: bool) -> list[TextJob]:
        out = []
        for (h, c, m), text, (s, a) in zip(starts, texts, slots, strict=True):
            if resident:
                for row, value in ((s, (h, c)), (s + 1, (h + 1, c - 1))):
                    tables["h"][row : row + 1].copy_(value[0])
                    tables["c"][row : row + 1].copy_(value[1])
                tables["m"][a].copy_(m[0])
                rows = [Row(State({"h": tables["h"][s : s + 1], "c": tables["c"][s : s + 1]}),
                            {"h": tables["m"][a]}, rule, resident=True),
                        Row(State({"h": tables["h"][s + 1 : s + 2], "c": tables["c"][s + 1 : s + 2]}), resident=True)]
            else:
                rows = [Row(State({"h": h.clone(), "c": c.clone()}), {"h": m[0].clone()}, rule),
                        Row(State({"h": h + 1, "c": c - 1}))]
            out.append(TextJob(text[:-1], text[1:], rows))
        # a text of no session, owning its state, in the same batches
        out.append(TextJob(texts[0][:-1], texts[0][1:], [Row(model.init_state(1))]))
        return out

    def run(resident: bool) -> list[TextJob]:
        todo = jobs(resident)
        while any(not j.done for j in todo):
            batch_step(model, [j for j in todo if not j.done], 8)
        return todo

    owned, resident = run(False), run(True)
    resets = 0
    for a, b in zip(owned, resident, strict=True):
        for x, y in zip(a.rows, b.rows, strict=True):
            assert torch.equal(torch.cat(x.logprobs), torch.cat(y.logprobs))
            assert (x.updates, x.dropped, x.resets) == (y.updates, y.dropped, y.resets)
            resets += x.resets
            for key in ("h", "c"):
                assert torch.equal(x.state.tensors[key], y.state.tensors[key])
            if x.mats is not None:
                assert y.mats is not None and torch.equal(x.mats["h"], y.mats["h"])
    for (row, m_row), job in zip(slots, resident[:3], strict=True):  # written in place: the tables hold the results
        main, shadow = job.rows
        assert main.state.tensors["h"].data_ptr() == tables["h"][row].data_ptr()
        assert main.mats is not None and main.mats["h"].data_ptr() == tables["m"][m_row].data_ptr()
        assert torch.equal(tables["h"][row + 1 : row + 2], shadow.state.tensors["h"])
    assert (resets > 0) == wild
    assert all(torch.count_nonzero(tables["m"][m_row]) > 0 for _, m_row in slots)  # they learned
