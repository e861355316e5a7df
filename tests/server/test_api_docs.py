"""docs/api.md against the app: every route of /openapi.json has its `## METHOD /path` section, and every section
names a route the app answers (one of the schema's, or one left out of it such as GET /keyboard).

The app is built without starting it (no lifespan: no checkpoint is loaded), so this costs an import and a schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from starlette.routing import Match

from server.app import create_app
from server.settings import Settings

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
_SECTION = re.compile(r"^## (GET|POST|PUT|PATCH|DELETE) (/\S*)$", flags=re.MULTILINE)

Route = tuple[str, str]  # (method, path template)


def documented(text: str) -> list[Route]:
    return _SECTION.findall(text)


def schema_routes(app: FastAPI) -> set[Route]:
    return {(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops}


def answers(app: FastAPI, route: Route) -> bool:
    """Whether some route of the app takes this method on this path (its parameters filled with a sample value),
    asked of the router's routes as the app's own 405 answer asks them."""
    method, template = route
    path = re.sub(r"\{[^}]+\}", "sample-id-0000000001", template)
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}
    return any(r.matches(scope)[0] == Match.FULL for r in app.router.routes)


def problems(text: str, app: FastAPI, schema: set[Route]) -> list[str]:
    """What docs/api.md (as `text`) gets wrong about `app` (whose schema's routes are `schema`): undocumented routes,
    sections of no route, repeats."""
    sections = documented(text)
    found = [f"{m} {p}: in /openapi.json, no section in docs/api.md" for m, p in sorted(schema - set(sections))]
    found += [f"{m} {p}: a section of docs/api.md, no such route" for m, p in sections
              if (m, p) not in schema and not answers(app, (m, p))]
    found += [f"{m} {p}: more than one section" for m, p in sorted(set(sections)) if sections.count((m, p)) > 1]
    return found


@pytest.fixture(scope="module")
def app() -> FastAPI:
    return create_app(Settings())


@pytest.fixture(scope="module")
def schema(app: FastAPI) -> set[Route]:
    """Built once: without a running engine the app does not cache its schema (the checkpoint's limits are unknown)."""
    return schema_routes(app)


def test_every_route_has_its_section_and_every_section_its_route(app: FastAPI, schema: set[Route]) -> None:
    assert problems(API_DOC.read_text(), app, schema) == []
    assert len(documented(API_DOC.read_text())) > len(schema) >= 16  # GET /keyboard is outside the schema


def test_the_check_finds_a_missing_section_and_a_section_of_no_route(app: FastAPI, schema: set[Route]) -> None:
    """The check above can fail: a section taken out, a route the server lacks, a path's method changed."""
    text = API_DOC.read_text()
    without = re.sub(r"^## POST /v1/sessions/\{session_id\}/observe$", "## Observing", text, flags=re.MULTILINE)
    assert without != text
    assert problems(without, app, schema) == ["POST /v1/sessions/{session_id}/observe: in /openapi.json, no section in "
                                      "docs/api.md"]
    assert problems(text + "\n## POST /v1/chat/completions\n", app, schema) == [
        "POST /v1/chat/completions: a section of docs/api.md, no such route"]
    assert problems(text + "\n## DELETE /v1/models/{model}\n", app, schema) == [
        "DELETE /v1/models/{model}: a section of docs/api.md, no such route"]
    # a route outside the schema is found as the app answers it, and only on its own method
    assert answers(app, ("GET", "/keyboard")) and not answers(app, ("POST", "/keyboard"))
