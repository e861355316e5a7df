"""`python -m bench.decode`: its batched step generates what each prompt generates alone (the digest two versions of
the code are compared by), and `--profile` accounts for every kind of op."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.decode import batch_ms, profile_steps
from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, Stepper


def test_the_batched_step_generates_each_prompts_bytes(tiny_checkpoint: Path) -> None:
    model = load_checkpoint(tiny_checkpoint).model
    prompts = [b"It is a truth", b"x", b"universally acknowledged"]
    _, got = batch_ms(model, prompts, 6, 1)
    want = bytearray()
    for p in prompts:
        s = Stepper(model, SamplingParams(max_tokens=6, temperature=0.0))
        s.prefill(p)
        tokens = [s.step().token for _ in range(6)]
        want += bytes(tokens[1:])  # the bytes of the steps timed: after the first
    assert got == bytes(want)


def test_profile_prints_the_kinds_of_a_steps_ops(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_steps(load_checkpoint(tiny_checkpoint).model, [b"ab", b"cd"], 4)
    out = capsys.readouterr().out
    assert out.startswith("batch 2: ") and "top-level aten ops a step" in out and "| projections, MLP, head |" in out
