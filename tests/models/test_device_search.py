"""The word search on the device (models/device_search.py) against the host's (`models.suggest.complete_word`): the
same completions in the same order with the same probabilities, alone or many at once; an overflowing pool or node
table is detected, never answered wrong; the budget cut; the one-character cursors; the reads it makes."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from models.base import Adapter, LanguageModel, Output, State
from models.checkpoint import load_checkpoint
from models.device_search import DeviceSearches, Finished, Ineligible
from models.scoring import BOS
from models.suggest import Cursor, Suggestions, advance, complete_word, split_word, takes_space
from server.settings import DEFAULT_CHECKPOINT
from tests.models.conftest import tiny_mlstm
from tests.models.test_suggest import Bigram, _bigram

# mid-word, after a space, after a mark (both kinds), Spanish with accents typed and to come, an emoji, nothing typed
CONTEXTS = ["It is a truth univ", "she said th", "and ", "Hi,", "It was done.", "El niño está en la montaña, la canci",
            "Él comió una manz", "she said \U0001f600", "caf", ""]


def _cursor(model: LanguageModel, context: str) -> Cursor:
    return advance(model, model.init_state(1), bytes([BOS]) + context.encode())


def _host(model: LanguageModel, context: str, **kw: Any) -> Suggestions:
    return complete_word(model, _cursor(model, context), split_word(context)[1], space=takes_space(context), **kw)


def _device(model: LanguageModel, contexts: list[str], *, k: int = 5, max_chars: int = 24,
            searches: DeviceSearches | None = None, **kw: Any) -> tuple[dict[str, Finished], DeviceSearches]:
    """Every context's search at once -> their outcomes by context, and the searches (for their counters)."""
    searches = searches or DeviceSearches(model, **kw)
    searches.add([(c, _cursor(model, c), split_word(c)[1], k, max_chars, takes_space(c), None) for c in contexts])
    got: dict[str, Finished] = {}
    for _ in range(1000):
        if not searches.busy:
            break
        searches.round()
        got.update(searches.ended())
    assert sorted(got) == sorted(contexts)
    return got, searches


def _same(host: Suggestions, device: Finished, rel: float) -> None:
    assert [(c.text, c.space_before) for c in device.completions] == \
        [(c.text, c.space_before) for c in host.completions]
    for d, h in zip(device.completions, host.completions, strict=True):
        assert d.prob == pytest.approx(h.prob, rel=rel)
    assert device.exact and host.exact and not device.overflow
    assert device.space_share == pytest.approx(host.space_share, rel=1e-9)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Path) -> LanguageModel:
    return load_checkpoint(tiny_checkpoint).model


@pytest.fixture(scope="module")
def shipped() -> LanguageModel:
    return load_checkpoint(DEFAULT_CHECKPOINT).model


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_the_device_search_is_the_host_search(which: str, request: pytest.FixtureRequest) -> None:
    """Each context's completions as the host finds them (float32 models: the rows of other batches round
    differently, about 1e-7 a step), all searched in one batch; and one alone gives the same."""
    model = request.getfixturevalue(which)
    got, searches = _device(model, CONTEXTS)
    hosts = {c: _host(model, c, k=5) for c in CONTEXTS}
    for c in CONTEXTS:
        _same(hosts[c], got[c], rel=1e-5)
    assert got["Hi,"].space_share > 0
    if which == "shipped":  # after a mark, the words after a space too (the tiny model is not sure of the space)
        assert any(c.space_before for c in got["Hi,"].completions)
    # the slots used again (16 searches where 10 were) answer the same
    again, _ = _device(model, [*CONTEXTS[::-1], *(c + " " for c in CONTEXTS[:6])], searches=searches)
    for c in CONTEXTS:
        _same(hosts[c], again[c], rel=1e-5)
    # a batch of one: the same answer as in the batch of all
    alone, _ = _device(model, ["she said th"])
    one, of_all = alone["she said th"].completions, got["she said th"].completions
    assert [c.text for c in one] == [c.text for c in of_all]
    assert [c.prob for c in one] == pytest.approx([c.prob for c in of_all], rel=1e-5)
    # the device search expands fewer branches than the host's rounds (which pop past a waiting completion)
    assert sum(f.expansions for f in got.values()) <= sum(h.expansions for h in hosts.values())
    assert searches.overflows == 0


@pytest.mark.usefixtures("one_thread")
def test_nothing_above_the_floor_is_nothing(tiny: LanguageModel) -> None:
    context = "she said th"
    assert not _host(tiny, context, k=3, min_prob=0.9).completions
    got, _ = _device(tiny, [context, "and "], k=3, min_prob=0.9)
    assert got[context].completions == [] and got[context].exact


@pytest.mark.usefixtures("one_thread")
def test_a_float64_model_matches_to_rounding() -> None:
    """A float64 model: the device's arithmetic is the host's, the batches' rounding aside (1e-12)."""
    model = tiny_mlstm(hidden=16)
    contexts = ["ab", "x!", "", "q"]
    got, _ = _device(model, contexts, k=4, max_chars=4, min_prob=1e-3)
    for c in contexts:
        host = _host(model, c, k=4, max_chars=4, min_prob=1e-3)
        assert host.completions
        _same(host, got[c], rel=1e-12)


@pytest.mark.usefixtures("one_thread")
def test_multibyte_characters_are_the_host_s() -> None:
    """The bigram's "f" -> "é" (C3 A9, and C3 "a", invalid) and "d" -> an em dash (not a word character): whole
    valid characters only, as the host; a lead byte's second byte by its range (E0, ED, F0, F4 narrow it)."""
    model = _bigram()
    contexts = ["caf", "wd", "x!", "the "]
    got, _ = _device(model, contexts, k=10, max_chars=4)
    for c in contexts:
        _same(_host(model, c, k=10, max_chars=4), got[c], rel=1e-9)
    assert "café" in [c.text for c in got["caf"].completions]
    # "z" -> E0 A4 95 ("क", a letter) or E0 80 B0: an overlong "0", which E0's second-byte range forbids
    table = model.table.data.clone()
    table[ord("z"), 0xE0] = 12.0
    table[0xE0, 0xA4], table[0xE0, 0x80] = 12.0, 13.0
    table[0xA4, 0x95], table[0x80, 0xB0] = 14.0, 14.0
    other = Bigram(table).eval()
    got, _ = _device(other, ["z"], k=10, max_chars=3)
    _same(_host(other, "z", k=10, max_chars=3), got["z"], rel=1e-9)
    assert "z\u0915" in [c.text for c in got["z"].completions]


@pytest.mark.usefixtures("one_thread")
def test_the_room_of_max_chars(shipped: LanguageModel) -> None:
    """At most `max_chars` characters added (the shipped model's "that" and "this" after "she said th" are longer)."""
    contexts = ["she said th", "Hi,", "and "]
    for max_chars in (1, 2):
        got, _ = _device(shipped, contexts, max_chars=max_chars)
        for c in contexts:
            host = _host(shipped, c, k=5, max_chars=max_chars)
            _same(host, got[c], rel=1e-5)
            assert all(len(x.text) - len(split_word(c)[1]) <= max_chars for x in got[c].completions)


class _Growing(Bigram):
    """A bigram whose state grows a slot a step (as a transformer's memories): not for fixed rows."""

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        t = state.tensors["t"]
        return Output(self.table[tokens], State({"t": torch.cat([t, t[:, :1]], 1)}))


def test_a_state_that_grows_is_refused() -> None:
    model = _Growing(_bigram().table.data).eval()
    searches = DeviceSearches(model)
    cursor = Cursor(model.init_state(1), torch.log_softmax(model.table[ord("a")], -1))
    searches.add([("a", cursor, "a", 3, 8, False, None)])
    with pytest.raises(Ineligible):
        searches.round()
    assert not searches.eligible(State({"t": torch.zeros(1, 5)}))  # another shape than the rows'


@pytest.mark.usefixtures("one_thread")
def test_an_overflow_is_detected_and_never_answered(shipped: LanguageModel) -> None:
    """A pool of 8 branches drops some that matter (the shipped model: 4 searches of 10): those searches end marked
    `overflow` (their caller runs the host search); the others, certified, are exact. Out of nodes likewise."""
    hosts = {c: _host(shipped, c, k=5) for c in CONTEXTS}
    got, searches = _device(shipped, CONTEXTS, pool=8, batch=4)
    overflowed = [c for c in CONTEXTS if got[c].overflow]
    assert overflowed and len(overflowed) < len(CONTEXTS) and searches.overflows == len(overflowed)
    for c in CONTEXTS:
        if not got[c].overflow:
            _same(hosts[c], got[c], rel=1e-5)
        else:
            assert not got[c].exact
    got, searches = _device(shipped, CONTEXTS, nodes=6)
    assert all(f.overflow for f in got.values()) and searches.overflows == len(CONTEXTS)


@pytest.mark.usefixtures("one_thread")
def test_the_budget_cuts_as_the_host_s(tiny: LanguageModel) -> None:
    got, _ = _device(tiny, ["and "], k=10, max_expansions=3)
    found = got["and "]
    assert not found.exact and not found.overflow and found.expansions == 3
    probs = [c.prob for c in found.completions]
    assert probs == sorted(probs, reverse=True)


@pytest.mark.usefixtures("one_thread")
def test_the_cursors_of_the_next_characters(tiny: LanguageModel) -> None:
    """The model after each one-character continuation, most probable first: as `advance` makes it (after a mark, the
    space and the space + a character too)."""
    for context in ("she said th", "Hi,"):
        got, _ = _device(tiny, [context])
        cursors = got[context].next_cursors
        assert 3 <= len(cursors) <= 8
        base = _cursor(tiny, context)
        lp = base.logprobs.double()
        for key, cursor in cursors.items():
            assert len(key.decode()) == 1 or key[:1] == b" " and len(key) <= 2
            after = advance(tiny, base.state, key)
            assert torch.allclose(cursor.logprobs, after.logprobs, atol=1e-5)
            assert all(torch.allclose(cursor.state.tensors[n], t, atol=1e-5) for n, t in after.state.tensors.items())
        first = list(cursors)[:3]
        if context == "Hi,":
            assert b" " in cursors
        else:  # the direct ones in the order of their probability
            assert [float(lp[k[0]]) for k in first] == sorted((float(lp[k[0]]) for k in first), reverse=True)


@pytest.mark.usefixtures("one_thread")
def test_the_host_may_learn_late(tiny: LanguageModel) -> None:
    """As on a GPU, the done flags and the results reach the host only when it waits for them, which it does a round
    after they were queued (`deferred`: on a CPU, copies that never arrive unless waited for): the same answers, a
    round or two later."""
    now, _ = _device(tiny, CONTEXTS)
    late, searches = _device(tiny, CONTEXTS, deferred=True)
    for c in CONTEXTS:
        assert late[c].completions == now[c].completions and late[c].exact
        assert late[c].next_cursors.keys() == now[c].next_cursors.keys()
    assert searches.rounds > max(f.model_calls for f in now.values())


@pytest.mark.usefixtures("one_thread")
def test_no_read_a_round_but_the_done_flags(tiny: LanguageModel) -> None:
    """Each round reads only its searches' done flags (a byte each); the results are read once, when they end."""
    got, searches = _device(tiny, CONTEXTS)
    assert searches.rounds >= 3
    flag_bytes = searches.bytes_read - searches.result_bytes
    assert searches.reads == searches.rounds + searches.result_reads
    assert flag_bytes <= searches.rounds * len(CONTEXTS)
    assert searches.result_reads <= searches.rounds  # at most one read of results a round, for all that ended


@pytest.mark.usefixtures("one_thread")
def test_the_root_s_log_probs_come_with_the_results(tiny: LanguageModel) -> None:
    """A finished search brings its cursor's next-byte log-probs to the host with its results (the keystroke's next
    characters are read from them, not from the cursor on the device), equal to the cursor's."""
    got, _ = _device(tiny, CONTEXTS[:3])
    for c in CONTEXTS[:3]:
        root = got[c].root_logprobs
        assert root.device.type == "cpu" and root.dtype == torch.float64
        assert torch.equal(root, _cursor(tiny, c).logprobs.double().cpu())


@pytest.mark.gpu
def test_on_cuda_the_host_s_answers() -> None:
    """On a CUDA device (the done flags through pinned memory and an event, read a round late): the CPU host search's
    completions, every search certified (`pytest -m gpu` on a GPU machine)."""
    cpu = load_checkpoint(DEFAULT_CHECKPOINT).model
    gpu = load_checkpoint(DEFAULT_CHECKPOINT).model.to("cuda")
    got, searches = _device(gpu, CONTEXTS)
    for c in CONTEXTS:
        _same(_host(cpu, c, k=5), got[c], rel=1e-4)
    assert searches.result_reads < searches.rounds and searches.overflows == 0


@pytest.mark.gpu
def test_on_cuda_a_round_does_not_sync() -> None:
    """No operation of a round (nor of starting searches) waits for the device: torch's sync debug mode raises on
    any that would (a bigram model, whose step is one table lookup, so that only the search's own work is checked).
    The first round: it has no earlier round's copies to wait for (a later one waits on their event, by design)."""
    model = _bigram().to("cuda")
    searches = DeviceSearches(model)
    # the bigram keeps its (step-counting) state where it was made: on the device here, as a real model's is
    cursors = [(c, Cursor(cursor.state.to("cuda"), cursor.logprobs))
               for c in ("caf", "x!", "the ", "wd") for cursor in [_cursor(model, c)]]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        searches.add([(c, cursor, split_word(c)[1], 5, 4, takes_space(c), None) for c, cursor in cursors])
        assert searches.round() > 0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got: dict[str, Finished] = {}
    for _ in range(100):
        got.update(searches.ended())
        if not searches.busy:
            break
        searches.round()
    assert sorted(got) == sorted(c for c, _ in cursors)


class _Arrival:
    """A copy to the host that arrives when the device catches up with the host (`_caught_up`), as on a GPU: between
    two calls of the host, sometimes one round behind, sometimes not."""

    made: list[_Arrival] = []

    def __init__(self) -> None:
        self.arrived = False
        _Arrival.made.append(self)

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        self.arrived = True

    def record(self) -> None:
        pass


def _caught_up() -> None:
    for copy in _Arrival.made:
        copy.arrived = True


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("behind", [0, 1])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_slot_used_again_is_not_ended_by_its_last_search_s_flags(monkeypatch: pytest.MonkeyPatch, behind: int,
                                                                     k: int) -> None:
    """A search's results may reach the host while the done flags of the round after its end (which still name its
    slot, as ended) are unread: a search started in that slot meanwhile must not be taken as ended by them (it would
    answer nothing, inexact). The device catches up every other round, at either parity (`behind`), and the first
    search ends at different rounds (`k`), so that each order of arrival is played."""
    monkeypatch.setattr("models.device_search._Pending", _Arrival)
    monkeypatch.setattr(_Arrival, "made", [])
    model = _bigram()
    searches = DeviceSearches(model, deferred=True, slots=2)
    searches.add([("short", _cursor(model, "caf"), "caf", k, 2, False, None),
                  ("long", _cursor(model, "the "), "", 8, 8, False, None)])
    got: dict[str, Finished] = {}
    for i in range(200):
        if not searches.busy:
            break
        searches.round()
        if i % 2 == behind:
            _caught_up()
        for tag, found in searches.ended():
            got[tag] = found
            if tag == "short":  # its slot is free: the next search takes it
                searches.add([("new", _cursor(model, "ab"), "ab", 5, 8, False, None)])
    assert sorted(got) == ["long", "new", "short"]
    _same(_host(model, "ab", k=5, max_chars=8), got["new"], rel=1e-9)


@pytest.mark.usefixtures("one_thread")
def test_a_search_cut_after_it_finished_is_exact(tiny: LanguageModel) -> None:
    """A search that finished on the device, cut (its deadline passed) before the host learnt of its end (a round or
    two later on a GPU: `deferred`), found its k completions: exact, as the host's search that has them is."""
    context = "she said th"
    searches = DeviceSearches(tiny, deferred=True)
    searches.add([(context, _cursor(tiny, context), "th", 5, 24, False, None)])
    got: list[tuple[Any, Finished]] = []
    cut_at = None
    for i in range(100):
        if not searches.busy:
            break
        searches.round()
        if cut_at is None and bool(searches.done[searches._tags[context]]):  # ended there; the host does not know
            searches.cut(context)
            cut_at = i
        got += searches.ended()
    assert cut_at is not None and len(got) == 1
    found = got[0][1]
    _same(_host(tiny, context, k=5), found, rel=1e-5)


def _random_bigram(rng: random.Random) -> Bigram:
    """A bigram of flat or peaked rows (a flat one overflows the pools), often with multibyte characters to come."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    table = torch.randn(256, 256, generator=g) * rng.choice([0.3, 1.0, 2.5])
    table[:, [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]] += 1.0
    table[:, ord(" ")] += 1.5
    if rng.random() < 0.5:
        table[:, [0xC2, 0xC3, 0xE0, 0xE2, 0xED, 0xF0, 0xF4]] += 2.5  # leads whose second byte is narrowed, or not
        table[:, 0x80:0xC0] += 2.0
    return Bigram(table).eval()


@pytest.mark.usefixtures("one_thread")
def test_random_models_and_arrivals_answer_as_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random bigrams, searches joining between rounds (k past the first 8 columns, slots used again, pools and node
    tables small enough to overflow), copies reaching the host at random rounds: every search ends once, and each one
    certified answers the host's completions."""
    monkeypatch.setattr("models.device_search._Pending", _Arrival)
    monkeypatch.setattr(_Arrival, "made", [])
    rng = random.Random(7)
    certified = 0
    for _ in range(6):
        model = _random_bigram(rng)
        searches = DeviceSearches(model, deferred=True, slots=rng.choice([1, 2]), pool=rng.choice([32, 256]),
                                  nodes=rng.choice([64, 256]))
        asked: dict[int, tuple[str, int, int]] = {}
        got: dict[int, Finished] = {}
        for _ in range(300):
            if rng.random() < 0.4 and len(asked) < 16:
                batch = []
                for _ in range(rng.randrange(1, 4)):
                    c, k, mc = rng.choice(["ab", "x!", "", "caf", "the ", "Hi,", "é"]), rng.randrange(1, 11), 4
                    asked[len(asked)] = (c, k, mc)
                    batch.append((len(asked) - 1, _cursor(model, c), split_word(c)[1], k, mc, takes_space(c), None))
                searches.add(batch)
            elif not searches.busy and len(asked) == 16:
                break
            searches.round()
            if rng.random() < 0.5:
                _caught_up()
            for tag, found in searches.ended():
                assert tag not in got
                got[tag] = found
        assert sorted(got) == sorted(asked)
        for tag, (c, k, mc) in asked.items():
            if not got[tag].overflow:
                certified += 1
                _same(_host(model, c, k=k, max_chars=mc), got[tag], rel=1e-9)
    assert certified >= 20
