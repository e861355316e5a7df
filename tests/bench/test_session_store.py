"""`python -m bench.session_store` at a tiny size: both stores filled, every timed insert evicting one session of the
owner over its share (the script asserts it), one row a case."""

from __future__ import annotations

import sys

import pytest

from bench.session_store import main


def test_a_tiny_run_prints_a_row_for_each_store_and_case(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["session_store", "--sizes", "40", "--keys", "4", "--inserts", "3"])
    main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| memory", "| redis"))]
    assert [row.split(" | ")[0:3] for row in rows] == [
        ["| memory", "40", "protected (3 of 4 shares)"], ["| memory", "40", "evictable (plain LRU)"],
        ["| redis", "40", "protected (3 of 4 shares)"], ["| redis", "40", "evictable (plain LRU)"]]


def test_bad_sizes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["session_store", "--sizes", "3", "--keys", "4"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
