"""What a keystroke's search does per key, and that doing less of it changes nothing (models/suggest.py): a branch's
children are queued one at a time (`_Siblings`), the search pops what it popped with all of them queued at once; many
sessions' rows in one step read their adapters one matrix per session (`Adapter.counts`), with the numbers of the
matrices repeated per row."""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import pytest
import torch

import models.suggest as ms
from models.base import Adapter, LanguageModel, State
from models.checkpoint import load_checkpoint
from models.mlstm import MLSTM, MLSTMConfig
from models.suggest import (
    WordSearch,
    complete_word,
    gather_rows,
    row_adapters,
    split_word,
    step,
    takes_space,
    word_ends,
)
from models.word_suggest import _best
from tests.models.test_suggest import _bigram, _cursor

CONTEXTS = ["", "the ", "ca", "f", "wd", "x!", "caf"]


def _queue_every_child(search: Any) -> None:
    """Queue every sibling still waiting, as a search that queues all children at once has them."""
    for _, _, item in list(search.queue):
        rest = item.rest if isinstance(item, ms._Branch) else None
        if rest is None:
            continue
        item.rest = None
        for j in range(rest.next, len(rest.tokens)):
            child = rest.child(j)
            child.rest = None
            heapq.heappush(search.queue, (-rest.logprobs[j], rest.orders[j], child))
        rest.next = len(rest.tokens)


class _EveryChild(ms._Search):
    def expand(self, *args: Any) -> None:
        super().expand(*args)
        _queue_every_child(self)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize(("k", "batch", "budget"), [(3, 1, 2048), (8, 8, 2048), (5, 4, 6)])
def test_children_queued_one_at_a_time_pop_as_all_at_once(context: str, k: int, batch: int, budget: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model = _bigram()
    data = context.encode()

    def search() -> tuple[Any, list[bytes]]:
        popped: list[bytes] = []
        s = WordSearch(_cursor(model, data), split_word(context)[1], k=k, batch=batch, max_expansions=budget,
                       model=model, space=takes_space(context))
        while (request := s.request()) is not None:
            popped += [b.data for b in s._popped]
            s.feed(*step(model, *request, None))
        return s.result(), popped

    lazy, lazy_popped = search()
    monkeypatch.setattr(ms, "_Search", _EveryChild)
    eager, eager_popped = search()
    assert lazy_popped == eager_popped  # the same branches in the same order
    assert (lazy.expansions, lazy.model_calls, lazy.exact) == (eager.expansions, eager.model_calls, eager.exact)
    assert [(c.text, c.prob, c.space_before) for c in lazy.completions] == \
        [(c.text, c.prob, c.space_before) for c in eager.completions]


def test_a_search_makes_few_branches_it_does_not_pop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A branch object per child above the probability floor, most never popped, was most of a keystroke's Python
    work (with every child queued at once: about 18 times the branches expanded here); now the popped ones, at most one
    waiting child per branch expanded or popped, and the continuations of a multibyte character."""
    made = 0

    class Counted(ms._Branch):
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            nonlocal made
            made += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ms, "_Branch", Counted)
    model = _bigram()
    for context in ["the ", "ca", "x!"]:
        made = 0
        got = complete_word(model, _cursor(model, context.encode()), split_word(context)[1], k=1, min_prob=1e-5,
                            space=takes_space(context))
        assert got.exact and got.expansions >= 30
        assert made <= 5 * got.expansions, (context, made, got.expansions)


def _mlstm() -> MLSTM:
    torch.manual_seed(0)
    model = MLSTM(MLSTMConfig(hidden=48, embed_dim=16)).freeze()
    assert model.grouped_adapters
    return model


def test_rows_of_few_sessions_read_one_matrix_each_with_the_same_numbers() -> None:
    model = _mlstm()
    g = torch.Generator().manual_seed(1)
    adapters: list[Adapter | None] = [Adapter({"h": 0.1 * torch.randn(1, 16, 16, generator=g)}) for _ in range(3)]
    rows = [4, 1, 3]
    B = sum(rows)
    state = model.init_state(B)
    state.tensors["h"].normal_(generator=g)
    tokens = torch.randint(0, 256, (B, 1), generator=g)
    grouped = row_adapters(adapters, rows, grouped=True)
    per_row = row_adapters(adapters, rows)
    assert grouped is not None and per_row is not None
    assert grouped.counts == (4, 1, 3) and grouped.mats["h"].shape == (3, 16, 16)  # no copy per row
    assert per_row.counts is None and per_row.mats["h"].shape == (B, 16, 16)
    with torch.no_grad():
        a, b = model(tokens, state, grouped), model(tokens, state, per_row)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.state.tensors["h"], b.state.tensors["h"])
    one = row_adapters(adapters[:1], [5], grouped=True)  # one session: its matrix for every row
    assert one is not None and one.counts == (5,) and one.batch == 5
    with torch.no_grad(), pytest.raises(ValueError, match="inference only"), torch.enable_grad():
        model(tokens, state, grouped)


def test_the_stack_of_the_same_sessions_is_made_once() -> None:
    g = torch.Generator().manual_seed(2)
    adapters: list[Adapter | None] = [Adapter({"h": torch.randn(1, 8, 8, generator=g)}) for _ in range(2)]
    first = row_adapters(adapters, [2, 3], grouped=True)
    again = row_adapters(adapters, [1, 1], grouped=True)  # other rows, the same sessions: the same stack
    assert first is not None and again is not None and first.mats["h"] is again.mats["h"]
    assert adapters[0] is not None
    adapters[0].mats["h"].add_(1.0)  # changed in place: stacked again
    changed = row_adapters(adapters, [1, 1], grouped=True)
    assert changed is not None and changed.mats["h"] is not first.mats["h"]
    assert torch.equal(changed.mats["h"][0], adapters[0].mats["h"][0])


def test_a_search_over_grouped_adapters_finds_what_the_rows_copies_find(tiny_checkpoint: Path) -> None:
    """Several sessions' searches in one batched step of the trained tiny mLSTM: the same pops, completions and
    probabilities (to the bit) as with the matrices repeated per row."""
    ck = load_checkpoint(tiny_checkpoint, device=torch.device("cpu"))
    model: LanguageModel = ck.model
    g = torch.Generator().manual_seed(3)
    k = model.adaptation_sites()[0].adapter_size()
    contexts = ["the qu", "I will ", "Hi, ", "and th"]
    adapters = [Adapter({"h": 0.05 * torch.randn(1, k, k, generator=g)}) for _ in contexts]

    def searches(grouped: bool) -> list[tuple[Any, ...]]:
        found = []
        runs = [WordSearch(ms.advance(model, model.init_state(1), bytes([10]) + c.encode(), a), split_word(c)[1],
                           k=4, batch=8, model=model, space=takes_space(c)) for c, a in zip(contexts, adapters,
                                                                                            strict=True)]
        while True:
            asked = [(s, a, r) for s, a in zip(runs, adapters, strict=True) if (r := s.request()) is not None]
            if not asked:
                break
            rows = [len(r[1]) for _, _, r in asked]
            adapter = row_adapters([a for _, a, _ in asked], rows, grouped)
            states = State.stack([r[0] for _, _, r in asked])
            state, logprobs = step(model, states, [t for _, _, r in asked for t in r[1]], adapter)
            start = 0
            for (s, _, _), n in zip(asked, rows, strict=True):
                s.feed(state.select(slice(start, start + n)), logprobs[start : start + n])
                start += n
        for s in runs:
            r = s.result()
            found.append((r.expansions, r.model_calls, [(c.text, c.prob, c.space_before) for c in r.completions]))
        return found

    assert searches(True) == searches(False)


def test_the_rows_of_many_batches_gather_as_their_takes_stack() -> None:
    g = torch.Generator().manual_seed(4)

    def batch(b: int) -> State:
        return State({"h": torch.randn(b, 6, generator=g), "ctx": torch.randint(0, 255, (b, 5), generator=g,
                                                                                   dtype=torch.uint8)})

    one = batch(1)
    shared = State({k: v.expand(3, *v.shape[1:]) for k, v in one.tensors.items()})  # a row repeated as a view
    sources = [(batch(4), [3, 0]), (shared, [1, 2]), (batch(2), [1]), (batch(5), [4, 4, 2])]
    got = gather_rows(sources)
    want = State.stack([s.take(torch.tensor(rows)) for s, rows in sources])
    assert got.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    alone = gather_rows(sources[:1])
    assert torch.equal(alone.tensors["h"], sources[0][0].tensors["h"][[3, 0]])


def test_word_ends_are_the_word_end_bytes_mass() -> None:
    lp = torch.log_softmax(torch.randn(7, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(5)), 1)
    lp[6, ms._BYTES.ends] = -1000.0  # every word end underflows: below any floor
    got = word_ends(lp.numpy(), ms._BYTES)
    want = torch.logsumexp(lp[:, ms._BYTES.ends], 1)
    assert got[:6] == pytest.approx(want[:6].numpy(), rel=1e-13)
    assert got[6] < -700


@pytest.mark.parametrize("n", [1, 3, 64, 500])
def test_a_word_model_s_best_candidates_are_a_stable_sort_s_first(n: int) -> None:
    """`word_suggestions` takes its completions' candidates without sorting the vocabulary: the same indices in the
    same order as the stable descending argsort's, ties (many here) in index order."""
    g = torch.Generator().manual_seed(6)
    values = torch.randint(0, 5, (300,), generator=g).double() / 8  # ties everywhere
    values[torch.rand(300, generator=g) < 0.5] = -1.0  # not offered
    want = torch.argsort(values, descending=True, stable=True)[:n]
    want = want[values[want] >= 0]
    assert _best(values, n).tolist() == want.tolist()
    assert _best(torch.full((10,), -1.0, dtype=torch.float64), 3).tolist() == []
