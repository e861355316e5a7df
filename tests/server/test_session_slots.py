"""Session slots (server/engine/_slots.py): observed sessions' tensors kept on the device between requests are a cache
of the stored records. With slots or without, a session's answers and records are the same: through evictions,
resets, imports, another replica's writes (a slot holding an older revision is never used) and failed steps (nothing
of a failed observe stays in a slot or the store)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from models.base import State
from models.session import SessionModel
from server.engine import Engine, EngineConfig, SessionConfig
from server.engine._redis import RedisSessionStore
from server.engine._store import SessionStore
from server.metrics import Metrics

TEXTS = [b"the quick brown fox jumps over the lazy dog, again and again. ",
         b"We met at noon and talked about the weather for an hour. ",
         b"Dear Anne, thank you for the letter; I read it twice over. "]
HEAD = {"head": {"lr": 1e-3, "decay": 1e-3}}


@contextmanager
def running(checkpoint: Path, slots: int, store: SessionStore | None = None) -> Iterator[Engine]:
    # a long max_wait_ms: the observes submitted together start together, so that every engine batches alike
    engine = Engine(checkpoint, config=EngineConfig(session_slots=slots, max_wait_ms=50.0), store=store)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def tensors(engine: Engine, session_id: str) -> dict[str, torch.Tensor]:
    """A stored record's tensors by name."""
    record = engine.get_session(session_id, None, touch=False)
    out = {f"state.{k}": v for k, v in record.state.tensors.items()}
    out |= {f"static.{k}": v for k, v in record.static_state.tensors.items()}
    for name, state in record.memories.items():
        if isinstance(state, State):
            out |= {f"{name}.{k}": v for k, v in state.tensors.items()}
    return {k: v.detach().cpu().clone() for k, v in out.items()}


def slot_series(engine: Engine) -> dict[str, float]:
    """The session slots' series of the server's /metrics text for this engine: name[/outcome] -> value."""
    metrics = Metrics()
    metrics.engine_stats = lambda: engine.stats
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if "session_slot" in sample.name:
                outcome = sample.labels.get("outcome")
                out[f"{sample.name}/{outcome}" if outcome else sample.name] = sample.value
    return out


def scores(results: list[Any]) -> list[tuple[float, float | None, int]]:
    return [(r.bits, r.static_bits, r.updates) for r in results]


async def scenario(engine: Engine) -> list[Any]:
    """Three sessions (the defaults; another adapter size, which the slots' tables do not fit; the head memory)
    observe together round after round, with suggestions, a reset and an import between. -> what they answered."""
    sessions = engine.sessions
    configs = [None, SessionConfig({**sessions.config().memories,
                                    "adapter": sessions.config({"adapter": {"size": 32}}).memories["adapter"]}),
               sessions.config(HEAD)]
    ids = [(await engine.create_session(owner=None, config=c))[0].id for c in configs]
    out: list[Any] = []

    async def round_(n: int) -> None:
        texts = [TEXTS[(i + n) % 3][n:] for i in range(3)]
        out.append(scores(list(await asyncio.gather(*(engine.score(t, session_id=s, adapt=True)
                                                       for s, t in zip(ids, texts, strict=True))))))

    for n in range(3):
        await round_(n)
    out.append(scores([await engine.score(TEXTS[i], session_id=s, adapt=True) for i, s in enumerate(ids)]))  # in turn
    for s in ids:
        found = await engine.suggest(s, None, "the qu", k=3)
        out.append([(c.text, c.prob) for c in found.completions])
    await engine.reset_session(ids[0], None)  # a slot holds the record before the reset
    await engine.import_session(ids[2], None, await engine.export_session(ids[1], None))  # and before this import
    for n in range(3, 5):
        await round_(n)
    out.append([tensors(engine, s) for s in ids])
    return out


def same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


def test_answers_and_records_are_the_same_with_slots_and_without(tiny_checkpoint: Path) -> None:
    answers = {}
    stats = {}
    exported = {}
    for slots in (0, 1, 8):  # 1: the sessions take turns in one slot (evicted, then read back from the store)
        with running(tiny_checkpoint, slots) as engine:
            answers[slots] = asyncio.run(scenario(engine))
            stats[slots] = engine.slot_stats()
            exported[slots] = slot_series(engine)
    assert stats[0] is None and exported[0] == {}
    same(answers[0], answers[8])
    same(answers[0], answers[1])
    big, small = stats[8], stats[1]
    assert big is not None and small is not None
    # with room for all: the sessions the tables fit hit their slots after the first observe, except after the
    # reset and the import (a new revision: read from the store again); the other adapter size never has a slot
    assert big.hits >= 4 and big.misses >= 2 and big.declined >= 5 and big.evictions == 0
    assert small.evictions >= 1
    # /metrics says what the slots did: the same counters
    for n, st in ((8, big), (1, small)):
        assert exported[n] == {"adaptlm_session_slot_observes_total/hit": st.hits,
                               "adaptlm_session_slot_observes_total/miss": st.misses,
                               "adaptlm_session_slot_observes_total/declined": st.declined,
                               "adaptlm_session_slot_evictions_total": st.evictions,
                               "adaptlm_session_slots": n, "adaptlm_session_slots_used": st.used}


def test_a_slot_behind_another_replicas_write_is_not_used(tiny_checkpoint: Path, redis_url: str) -> None:
    """Two servers share a Redis store; the first holds a session in a slot, the second observes the session; the
    first's next observe reads the second's record, as a server without slots does."""

    def store() -> RedisSessionStore:
        return RedisSessionStore(redis_url, max_sessions=100, max_bytes=1 << 30)

    async def observes(one: Engine, two: Engine) -> tuple[list[Any], dict[str, torch.Tensor]]:
        session, _ = await one.create_session(owner=None)
        got = [await e.score(t, session_id=session.id, adapt=True) for e, t in ((one, TEXTS[0]), (two, TEXTS[1]),
                                                                             (one, TEXTS[2]))]
        return scores(got), tensors(one, session.id)

    with running(tiny_checkpoint, 8, store()) as one, running(tiny_checkpoint, 8, store()) as two:
        got = asyncio.run(observes(one, two))
        first = one.slot_stats()
    with running(tiny_checkpoint, 0) as alone:
        want = asyncio.run(observes(alone, alone))
    same(got, want)
    assert first is not None and first.hits == 0 and first.misses == 2  # its slot held the revision before two's


def test_a_failed_step_leaves_no_trace_in_the_slot_or_the_store(tiny_checkpoint: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    step = SessionModel.step
    calls = {"n": 0, "fail_at": -1}

    def flaky(self: SessionModel, *args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("a step that fails midway through an observe")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(SessionModel, "step", flaky)

    async def observes(engine: Engine, fail: bool) -> tuple[list[Any], dict[str, torch.Tensor]]:
        session, _ = await engine.create_session(owner=None)
        first = await engine.score(TEXTS[0], session_id=session.id, adapt=True)
        before = tensors(engine, session.id)
        if fail:
            calls["fail_at"] = calls["n"] + 2  # the second segment of the next observe: the slot is half written
            with pytest.raises(RuntimeError, match="midway"):
                await engine.score(TEXTS[1], session_id=session.id, adapt=True)
            same(tensors(engine, session.id), before)  # the store holds the record before the failed observe
        again = await engine.score(TEXTS[1], session_id=session.id, adapt=True)
        return scores([first, again]), tensors(engine, session.id)

    with running(tiny_checkpoint, 8) as engine:
        got = asyncio.run(observes(engine, fail=True))
        stats = engine.slot_stats()
    with running(tiny_checkpoint, 0) as engine:
        want = asyncio.run(observes(engine, fail=False))
    same(got, want)
    # the first observe fills the slot, the failed one hits it and the slot is dropped: the retry reads the store
    assert stats is not None and (stats.misses, stats.hits) == (2, 1)
