"""The engine's steps on a CUDA device wait for it only where they must (`gpu` marker: skipped without CUDA). A read
back to the host (`.item()`, `.tolist()`, `bool(t)`, a blocking copy) waits for everything queued on the device, so
the host cannot queue the next work meanwhile; torch reports each one in its sync debug mode, counted here.

What must wait, and is counted as such: the divergence guard's read of which rows' scores are usable, in a step with
an adapter M (a row of M may be reset and its segment redone, which the host must know to set up the next step), and
a decode step's tokens (they are decoded and streamed), one read for all its sequences. A text's start sends its
tokens to the device without waiting either. The steps run on the shipped default model with its head memory and the
sessions' slots, as the server runs them; the copy model and the neural cache are off here (their GPU paths are the
PyTorch references of CPU kernels, with reads per token)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, Stepper
from models.session import Session, SessionModel
from models.step_graphs import install_step_runner
from server.engine._slots import SessionSlots

pytestmark = pytest.mark.gpu

DEFAULT = Path(__file__).resolve().parent.parent / "checkpoints" / "default"
TEXT = b"It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 3
OFF = {"copy": None, "cache": None}


@contextlib.contextmanager
def syncs() -> Iterator[list[str]]:
    """Where the code inside waited for the device ("file:line" of each synchronising call, from torch's sync debug
    mode); the list is filled when the block ends."""
    found: list[str] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


@pytest.fixture(scope="module", params=["off", "auto"])
def sessions(request: pytest.FixtureRequest) -> SessionModel:
    """The default checkpoint's sessions on the device, its mLSTM's inference steps as the engine runs them
    (ADAPTLM_CUDA_GRAPHS: "auto", replayed CUDA graphs of bucketed shapes; "off", the model's own path)."""
    ckpt = load_checkpoint(DEFAULT, device="cuda")
    install_step_runner(ckpt.model, request.param)
    model = SessionModel.of(ckpt)
    assert "head" in model.memories
    return model


def _observed(sessions: SessionModel, asked: dict[str, dict[str, object] | None]) -> tuple[Session, SessionSlots]:
    """A session that has observed TEXT once (the first steps' one-time work: kernels' set-up, the rules' MS_g
    parts), in a slot as the server keeps it."""
    slots = SessionSlots(4, sessions.device)
    session = sessions.fresh(sessions.config(asked), id="s")
    resident = slots.acquire(session)
    assert resident is not None
    text = sessions.start(resident, TEXT, "observe", resident=True)
    while not text.job.done:
        sessions.step([text.job])
    return sessions.observed(resident, text, 0.0, 0.0), slots


def _observe_steps(sessions: SessionModel, session: Session, slots: SessionSlots) -> tuple[int, list[str], int]:
    """The start and steps of a second observe of TEXT on the slot: (steps, where they waited, updates counted)."""
    slots.commit(session.id, "r1")
    steps = 0
    with syncs() as waited:
        resident = slots.acquire(dataclasses.replace(session, revision="r1"))  # a hit: the slot's own rows
        assert resident is not None
        text = sessions.start(resident, TEXT, "observe", resident=True)  # its tokens go to the device unwaited
        while not text.job.done:
            sessions.step([text.job])
            steps += 1
    return steps, waited, text.job.rows[0].updates


def test_an_observe_step_of_the_default_session_waits_for_nothing(sessions: SessionModel) -> None:
    """The default session's learned part is the head memory (no adapter M): no step reads anything back; the
    updates are counted on the device and read at the end."""
    session, slots = _observed(sessions, dict(OFF))
    steps, waited, updates = _observe_steps(sessions, session, slots)
    assert steps > 3 and waited == [], waited
    assert updates == steps  # the head's steps, counted on the device, read once here


def test_an_observe_step_with_an_adapter_waits_once_for_the_guard(sessions: SessionModel) -> None:
    session, slots = _observed(sessions, {**OFF, "adapter": {}})
    steps, waited, updates = _observe_steps(sessions, session, slots)
    assert steps > 3 and len(waited) == steps, waited  # the guard's usable rows, one read a step
    assert len(set(waited)) == 1 and "_step.py" in waited[0], waited
    assert updates >= steps


def test_a_scoring_step_waits_for_nothing(sessions: SessionModel) -> None:
    warm = sessions.start(None, TEXT, "static")
    while not warm.job.done:
        sessions.step([warm.job])
    with syncs() as waited:
        text = sessions.start(None, TEXT, "static")
        while not text.job.done:
            sessions.step([text.job])
    assert waited == [], waited


def test_a_decode_step_waits_once_for_all_its_tokens(sessions: SessionModel) -> None:
    """Three sequences of a session with the head memory, as the generation executor steps them: draw every token
    on the device, one read back, decode each, one batched forward."""
    session, _ = _observed(sessions, dict(OFF))
    model = sessions.search_model
    model.eval()
    steppers = []
    for seed in range(3):
        stepper = Stepper(model, SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=seed),
                          state=sessions.view_state(session), last_token=session.last_token,
                          adapter=sessions.adapter(session))
        stepper.prefill(b"It is a ")
        steppers.append(stepper)

    def decode_step() -> None:
        drawn = [s.draw() for s in steppers]
        tokens = torch.stack([d[0] for d in drawn]).tolist()
        Stepper.feed_many(steppers, [s.take(t, d).token for s, t, d in zip(steppers, tokens, drawn, strict=True)])

    decode_step()  # the batch's first forward (its states stacked)
    with syncs() as waited:
        for _ in range(5):
            decode_step()
    assert len(waited) == 5 and len(set(waited)) == 1, waited  # the tokens' one read a step
