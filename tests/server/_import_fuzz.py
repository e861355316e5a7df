"""Mutated session exports against a server, as hypothesis draws them: `python -m tests.server._import_fuzz
EXAMPLES CHECKPOINT...`. Run in a process of its own (tests/server/test_session_import.py) so that a crash (a kernel
reading out of bounds) fails the test instead of killing the test runner; one process for all the checkpoints (the
server's imports and torch's start-up are seconds), each fuzzed whatever happened to the one before.

Each example takes a valid export of a session with every memory of the checkpoint on, changes one tensor (its
shape, dtype or values) or one metadata field, and PUTs it over the session. The server must answer 4xx and keep the
session as it was, or 2xx and then serve it: observe, score, suggest, generate and export answer 2xx with finite
numbers. Exit status 0 when every example holds; otherwise hypothesis prints the smallest failing example."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_tensors

from bench._mutations import DTYPES, EXTRAS, HOWS, JSON_VALUES, VALUES, apply, fields, finite_numbers, header
from server.app import create_app
from server.settings import Settings

TEXT = "Dear Anne, the meeting moved to Tuesday. Dear Anne, the minutes follow.\n"


def mutations(keys: list[str], paths: list[tuple[str, ...]]) -> st.SearchStrategy[tuple[Any, ...]]:
    tensor = st.tuples(st.just("tensor"), st.sampled_from(keys), st.sampled_from(HOWS), st.sampled_from(VALUES),
                       st.integers(0, 3), st.sampled_from(DTYPES), st.integers(0, 10**6))
    field = st.tuples(st.just("field"), st.sampled_from(paths), st.sampled_from(JSON_VALUES))
    extra = st.tuples(st.just("extra"), st.sampled_from(EXTRAS))
    return st.one_of(tensor, field, extra)


def main(checkpoint: str, examples: int) -> int:
    app = create_app(Settings(checkpoint=Path(checkpoint), suggest_budget_ms=0, max_tokens=8))
    with TestClient(app) as c:
        r = c.post("/v1/sessions", json={"initial_text": TEXT, "adaptation": {"cache_weight": 0.5}})  # word cache on
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        blob = c.get(f"/v1/sessions/{sid}/state").content
        keys = sorted(load_tensors(blob))
        paths = fields(json.loads(header(blob)["__metadata__"]["session"]))

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(mutations(keys, paths))
        def check(change: tuple[Any, ...]) -> None:
            assert c.put(f"/v1/sessions/{sid}/state", content=blob).status_code == 200
            before = c.get(f"/v1/sessions/{sid}/state").content
            r = c.put(f"/v1/sessions/{sid}/state", content=apply(blob, change))
            assert r.status_code in (200, 422, 409), (r.status_code, r.text)
            if r.status_code != 200:
                after = c.get(f"/v1/sessions/{sid}/state").content
                assert load_tensors(after).keys() == load_tensors(before).keys() and all(
                    bool((load_tensors(after)[k] == load_tensors(before)[k]).all()) for k in load_tensors(after)), \
                    "a refused import changed the session"
                return
            for method, path, body in (("post", f"/v1/sessions/{sid}/observe", {"text": "Dear Anne, hello.\n"}),
                                       ("post", "/v1/score", {"text": "Dear Anne", "session_id": sid}),
                                       ("post", f"/v1/sessions/{sid}/suggest", {"context": "Dear A"}),
                                       ("post", "/v1/generate", {"prompt": "Dear ", "max_tokens": 4,
                                                                 "session_id": sid}),
                                       ("get", f"/v1/sessions/{sid}", None),
                                       ("get", f"/v1/sessions/{sid}/state", None)):
                got = c.request(method.upper(), path, json=body)
                assert got.status_code == 200, (path, got.status_code, got.text[:300])
                if got.headers["content-type"].startswith("application/json"):
                    assert finite_numbers(got.json()), (path, got.text[:300])

        check()
    print(f"{checkpoint}: {examples} mutated imports held", flush=True)
    return 0


def main_all(examples: int, checkpoints: list[str]) -> int:
    """Each checkpoint in turn (its failure, hypothesis's smallest example, on stderr): 1 when one failed."""
    status = 0
    for checkpoint in checkpoints:
        try:
            main(checkpoint, examples)
        except Exception:
            print(f"{checkpoint}: a mutated import failed", file=sys.stderr)
            traceback.print_exc()
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main_all(int(sys.argv[1]), sys.argv[2:]))
