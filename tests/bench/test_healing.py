"""`python -m bench.healing`: the first word it scores, and a run on a word checkpoint that prints one line a prompt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.healing import PROMPTS, first_word, main


def test_the_first_word_is_the_rest_of_the_word_or_the_next_one_with_its_spaces() -> None:
    assert first_word("there was a thi", "ng, and") == "ng"
    assert first_word("there was a ", "  He had") == "  He"
    assert first_word("a ", "<unk>, and") == "<unk>"
    assert first_word("I don'", "t know") == "t"
    assert first_word("storm", ", and") == ","
    assert first_word("x", "") == ""


def test_a_run_prints_every_prompts_continuation(word_checkpoint: Path, tiny_checkpoint: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["healing", "--checkpoint", str(word_checkpoint), "--byte-checkpoint",
                                      str(tiny_checkpoint), "--max-tokens", "3"])
    main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(PROMPTS) + 2 and lines[-1].startswith("first words: ")
    assert all(" bits  " in line and "<unk>" not in line.split(" + ", 1)[1] for line in lines[1:-1])
