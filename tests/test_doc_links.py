"""The README and the reference pages link only to what the repository has: every relative link names a file of the
checkout, and every `#anchor` a heading of the page it points to (as GitHub makes anchors of headings). The README's
results table links each figure to its section of docs/benchmarks.md: a renamed section breaks it here."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/api.md", "docs/architecture.md", "docs/cli.md", "docs/operations.md", "docs/keyboard.md"]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", _FENCE.sub("", markdown), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}: no such heading in {os.path.relpath(linked, page.parent)}")
    return broken


def test_anchors_are_githubs() -> None:
    text = "# Quality: bits per byte against PPMd and xz\n## Monitoring (`deploy/prometheus/`)\n## GPU\n## GPU\n"
    assert anchors(text) == {"quality-bits-per-byte-against-ppmd-and-xz", "monitoring-deployprometheus", "gpu",
                             "gpu-1"}


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page: str) -> None:
    assert broken_links(ROOT / page) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# One\n## Two: three\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#two-three) [ok](#here) [gone](c.md) [renamed](b.md#two) [web](https://example.org)\n"
                    "# Here\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#two: no such heading in b.md"]
