"""docs/operations.md's "Settings" table against server/settings.py: every setting has its row with its default, and
every ADAPTLM_* variable the docs and deploy assets name is a setting (or one of the tools' own variables)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from server.settings import TOOLS_VARIABLES as NOT_SETTINGS
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"


def settings_table() -> dict[str, tuple[str, str]]:
    """The rows of the "Settings" section's table: variable -> (default cell, meaning cell)."""
    section = OPERATIONS.read_text().split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(ADAPTLM_\w+)` \| (.*?) \| (.*) \|$", section, flags=re.MULTILINE)
    return {name: (default, meaning) for name, default, meaning in rows}


def env_name(field: str) -> str:
    return f"ADAPTLM_{field.upper()}"


def test_every_setting_has_its_row_and_default() -> None:
    table = settings_table()
    fields = Settings.model_fields
    assert set(table) == {env_name(f) for f in fields}, "docs/operations.md's Settings table and server/settings.py"
    for field, info in fields.items():
        default: Any = info.default
        cell = table[env_name(field)][0]
        if isinstance(default, bool) or not isinstance(default, int | float | str) or default == "":
            continue  # no value to write (none, a path of the installation): the cell says so in words
        written = re.match(r"`([^`]+)`", cell)
        assert written, f"{env_name(field)}: the default {default!r} is not written as `value` in {cell!r}"
        # the written value, read as the environment's would be, is the default
        assert getattr(Settings(**{field: written.group(1)}), field) == default, (field, cell)


def test_every_variable_named_is_a_setting() -> None:
    fields = {env_name(f) for f in Settings.model_fields}
    sources = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / "Makefile", *(ROOT / "docs").glob("*.md"),
               *(p for p in (ROOT / "deploy").rglob("*") if p.is_file())]
    for path in sources:
        for name in set(re.findall(r"ADAPTLM_[A-Z0-9_]*[A-Z0-9]", path.read_text())):
            assert name in fields or NOT_SETTINGS.fullmatch(name), f"{path.relative_to(ROOT)} names {name}, no setting"
