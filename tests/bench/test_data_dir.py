"""The corpora directory of the bench scripts: $ADAPTLM_DATA, and a clear exit (status 2) where a script needs it and
it is missing, instead of a path outside the repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._common import data_dir, data_file


def test_the_corpora_directory_is_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTLM_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    assert data_file("gutenberg/a.txt") == tmp_path / "gutenberg" / "a.txt"


@pytest.mark.parametrize("value", [None, "", "missing"])
def test_without_it_a_script_exits_2_with_a_message(value: str | None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    if value is None:
        monkeypatch.delenv("ADAPTLM_DATA", raising=False)
    else:
        monkeypatch.setenv("ADAPTLM_DATA", str(tmp_path / value) if value else "")
    with pytest.raises(SystemExit) as exit_:
        data_file("gutenberg/a.txt")
    assert exit_.value.code == 2
    assert "ADAPTLM_DATA" in capsys.readouterr().err
