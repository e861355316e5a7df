"""Typists of head-memory sessions batched in the same rounds (server/engine/_suggest.py `SuggestRounds`): each gets
the suggestions of its own search alone, from scratch (the head memory's read of a round of many sessions' rows,
models/adaptation/_head_memory.py), and the rounds' tensors are made in inference mode (no autograd bookkeeping a
torch op), which an observe and the next keystrokes read without error."""

from __future__ import annotations

from pathlib import Path

from models.checkpoint import load_checkpoint
from models.session import SessionModel
from models.suggest import SUGGEST_MIN_PROB
from server.engine._suggest import CursorCache, SuggestJob, SuggestRounds
from tests.server.test_suggest_reuse import run, same

TEXTS = (b"the cat sat on the mat, the cat sat on the hat; " * 3,
         b"Hi Anna, thanks for the notes on the garden. " * 3,
         b"see you at ten then, see you at the station. " * 3)
CONTEXTS = ("the ca", "Hi, ", "see you at th")


def test_head_sessions_batched_in_rounds_get_their_own_searches(tiny_checkpoint: Path) -> None:
    served = SessionModel.of(load_checkpoint(tiny_checkpoint))
    asked = {"head": {"lr": 2e-3, "decay": 1e-4}, "adapter": None}
    sessions = [served.observe(served.fresh(served.config(asked), id=f"s{i}"), text) for i, text in enumerate(TEXTS)]
    assert all(s.memories["head"].tensors["delta"].any() for s in sessions)  # each its own learned delta

    def rounds() -> SuggestRounds:
        return SuggestRounds(served.search_model, CursorCache(model=served), min_prob=SUGGEST_MIN_PROB, batch=8,
                             max_expansions=2048, round_rows=128)

    batched = rounds()
    for turn in range(2):  # then again after each session observed its context
        jobs = [SuggestJob(s, context, 3, 24, 5) for s, context in zip(sessions, CONTEXTS, strict=True)]
        batched.start(jobs)
        while batched.active:
            batched.round()
        for job, session, context in zip(jobs, sessions, CONTEXTS, strict=True):
            assert job.result is not None and job.cursor is not None, job.error
            assert job.cursor.state.tensors["h"].is_inference()
            same(job.result, run(rounds(), session, context))
        if turn == 0:
            sessions = [served.observe(s, context.encode()) for s, context in zip(sessions, CONTEXTS, strict=True)]
