"""The keyboard's word search on the model's device in the engine (ADAPTLM_SUGGEST_ON_DEVICE, models/device_search.py):
`/v1/sessions/{id}/suggest` answers as the host's search does; a search the device cannot certify runs on the host;
a transformer's searches stay on the host."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from models.checkpoint import load_checkpoint
from models.device_search import DeviceSearches
from models.suggest import SUGGEST_MIN_PROB
from server.engine._suggest import CursorCache, SuggestJob, SuggestRounds, search_on_device
from server.settings import Settings
from tests.server.test_suggest import TEXT, record

# mid-word, after a space, after a mark, accents typed, one to come, and a prefix with little after it
CONTEXTS = ["She said that the man was univ", "and ", "It was done.", "El niño está en la canci", "caf", "qxzj"]


def _answers(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """A session adapted on TEXT, then every context's suggestions, four at once (they batch in the engine)."""
    r = client.post("/v1/sessions", json={"initial_text": TEXT, "adaptation": {"lr": 0.01}})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert client.post(f"/v1/sessions/{sid}/observe", json={"text": TEXT}).status_code == 200

    def one(context: str) -> dict[str, Any]:
        r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": context, "k": 5, "n_chars": 3})
        assert r.status_code == 200, r.text
        return dict(r.json())

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(CONTEXTS, pool.map(one, CONTEXTS), strict=True))


def test_the_setting_on_answers_as_off(serve_app: Any, tiny_checkpoint: Path, client: httpx.Client,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same session's suggestions from a server with the device search on and from one with it off (the default
    on a CPU): the same words in the same order, the same probabilities (the rows of other batches round
    differently), next characters and exactness; and the device's rounds did run."""
    rounds = [0]
    device_round = DeviceSearches.round

    def counted(self: DeviceSearches) -> int:
        rounds[0] += 1
        return device_round(self)

    monkeypatch.setattr(DeviceSearches, "round", counted)
    off = _answers(client)
    assert rounds[0] == 0
    with serve_app(Settings(checkpoint=tiny_checkpoint, suggest_on_device="on", suggest_budget_ms=0)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as c:
        on = _answers(c)
    assert rounds[0] >= 3
    for context in CONTEXTS:
        a, b = on[context], off[context]
        assert [w["text"] for w in a["completions"]] == [w["text"] for w in b["completions"]], context
        assert [w["prob"] for w in a["completions"]] == pytest.approx([w["prob"] for w in b["completions"]], rel=1e-5)
        assert a["next_chars"] == b["next_chars"] and a["exact"] == b["exact"] and a["prefix"] == b["prefix"]
    assert any(on[c]["completions"] for c in CONTEXTS)


def test_the_host_s_searches_are_counted_on_metrics(serve_app: Any, tiny_checkpoint: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Device searches too small to be certified are searched again on the host, and /metrics counts them."""
    init = DeviceSearches.__init__

    def small(self: DeviceSearches, *args: Any, **kw: Any) -> None:
        init(self, *args, **{**kw, "pool": 8, "batch": 4})

    monkeypatch.setattr(DeviceSearches, "__init__", small)
    with serve_app(Settings(checkpoint=tiny_checkpoint, suggest_on_device="on", suggest_budget_ms=0)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as c:
        answers = _answers(c)
        metrics = c.get("/metrics").text
    assert all(a["exact"] for a in answers.values())
    [line] = [line for line in metrics.splitlines() if line.startswith("adaptlm_suggest_device_fallbacks_total")]
    assert float(line.rsplit(" ", 1)[1]) >= 1


def _run(rounds: SuggestRounds, jobs: list[SuggestJob]) -> None:
    rounds.start(jobs)
    for _ in range(500):
        if not rounds.busy:
            return
        rounds.round()
    raise AssertionError("the searches did not end")


def test_an_overflowing_search_is_answered_by_the_host(tiny_checkpoint: Path) -> None:
    """A pool too small to certify the searches: the host's search answers them, exactly as with the setting off;
    with the host learning of the ends a round late, as on a GPU (`deferred`)."""
    model = load_checkpoint(tiny_checkpoint).model
    mats = {s.name: 0.05 * torch.ones(1, 4, 4) for s in model.adaptation_sites()}

    def jobs() -> list[SuggestJob]:
        return [SuggestJob(record(f"s{i}", model.init_state(1), mats), c, 5, 24, 3) for i, c in enumerate(CONTEXTS)]

    def rounds(on: bool) -> SuggestRounds:
        return SuggestRounds(model, CursorCache(), min_prob=SUGGEST_MIN_PROB, batch=8, max_expansions=2048,
                             round_rows=128, on_device=on)

    host, device = jobs(), jobs()
    _run(rounds(False), host)
    small = rounds(True)
    small.device = DeviceSearches(model, min_prob=SUGGEST_MIN_PROB, pool=8, batch=4, deferred=True)
    _run(small, device)
    assert small.fallbacks > 0 and small.device.rounds > 0
    for h, d in zip(host, device, strict=True):
        assert h.result is not None and d.result is not None
        assert [c.text for c in d.result.completions] == [c.text for c in h.result.completions]
        assert [c.prob for c in d.result.completions] == pytest.approx([c.prob for c in h.result.completions],
                                                                       rel=1e-5)
        assert d.result.exact and d.result.next_chars == h.result.next_chars


def test_the_setting() -> None:
    model = torch.nn.Linear(1, 1)
    assert search_on_device("on", model) and not search_on_device("off", model)  # type: ignore[arg-type]
    assert not search_on_device("auto", model)  # type: ignore[arg-type]  # a CPU: off
    with pytest.raises(ValueError):
        search_on_device("yes", model)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Settings(suggest_on_device="yes")  # type: ignore[arg-type]


def test_a_deadline_cuts_and_a_dropped_search_ends_unanswered(tiny_checkpoint: Path) -> None:
    """On the device as on the host: a search past its deadline answers what it found, inexact; one whose client went
    away (`drop`) ends without an answer, its slot free again."""
    model = load_checkpoint(tiny_checkpoint).model
    mats = {s.name: torch.zeros(1, 4, 4) for s in model.adaptation_sites()}
    rounds = SuggestRounds(model, CursorCache(), min_prob=SUGGEST_MIN_PROB, batch=8, max_expansions=2048,
                           round_rows=128, on_device=True)
    late = SuggestJob(record("a", model.init_state(1), mats), "she said th", 5, 24, 3, deadline=0.0)
    gone = SuggestJob(record("b", model.init_state(1), mats), "and ", 5, 24, 3)
    kept = SuggestJob(record("c", model.init_state(1), mats), "It was done.", 5, 24, 3)
    rounds.start([late, gone, kept])
    assert rounds.on_device == [late, gone, kept]
    rounds.drop(gone)
    ended = []
    for _ in range(100):
        if not rounds.busy:
            break
        ended += rounds.round()[1]
    assert ended == [late, kept] or ended == [kept, late]
    assert late.result is not None and not late.result.exact
    assert kept.result is not None and kept.result.exact and kept.result.completions
    assert gone.result is None and rounds.device is not None and not rounds.device.busy


def test_a_search_not_certified_past_its_deadline_answers_what_it_found(tiny_checkpoint: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A device search that ended uncertified (its pool overflowed) once its deadline has passed (while its results were
    on their way to the host) answers the completions it found, inexact: the host's search, started then, would be cut
    at once and answer nothing."""
    model = load_checkpoint(tiny_checkpoint).model
    mats = {s.name: torch.zeros(1, 4, 4) for s in model.adaptation_sites()}
    rounds = SuggestRounds(model, CursorCache(), min_prob=SUGGEST_MIN_PROB, batch=8, max_expansions=2048,
                           round_rows=128, on_device=True)
    rounds.device = DeviceSearches(model, min_prob=SUGGEST_MIN_PROB, pool=8, batch=4, deferred=True)
    jobs = [SuggestJob(record(f"s{i}", model.init_state(1), mats), c, 5, 24, 3) for i, c in enumerate(CONTEXTS)]
    request, ended = DeviceSearches._request_results, DeviceSearches.ended
    overflowed: list[SuggestJob] = []

    def late(self: DeviceSearches) -> None:  # the deadline passes while the results travel
        request(self)
        for r in self._results:
            for slot in r.slots:
                self._slots[slot].tag.deadline = 0.0

    def seen(self: DeviceSearches) -> list[Any]:
        out = ended(self)
        overflowed.extend(job for job, found in out if found.overflow)
        return out

    monkeypatch.setattr(DeviceSearches, "_request_results", late)
    monkeypatch.setattr(DeviceSearches, "ended", seen)
    _run(rounds, jobs)
    assert overflowed
    for job in overflowed:
        assert job.result is not None and job.result.completions and not job.result.exact


def test_dropping_a_search_after_the_slots_grew(tiny_checkpoint: Path) -> None:
    """More searches than the first slots (8), so that the device's buffers grew while starting them (under inference
    mode); then a client goes away, the engine's `drop` coming from outside inference mode: the search ends unanswered
    (it raised, and the engine's loop with it), the others answer."""
    model = load_checkpoint(tiny_checkpoint).model
    mats = {s.name: torch.zeros(1, 4, 4) for s in model.adaptation_sites()}
    rounds = SuggestRounds(model, CursorCache(), min_prob=SUGGEST_MIN_PROB, batch=8, max_expansions=2048,
                           round_rows=128, on_device=True)
    jobs = [SuggestJob(record(f"s{i}", model.init_state(1), mats), "and ", 3, 24, 3) for i in range(10)]
    rounds.start(jobs)
    assert rounds.on_device == jobs
    rounds.drop(jobs[0])
    rounds.device.cut(jobs[1])  # type: ignore[union-attr]
    _run(rounds, [])
    assert jobs[0].result is None and jobs[1].result is not None and not jobs[1].result.exact
    assert all(job.result is not None and job.result.exact for job in jobs[2:])
