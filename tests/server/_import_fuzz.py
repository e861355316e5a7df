"""Mutated session exports against a server, as hypothesis draws them: `python -m tests.server._import_fuzz
CHECKPOINT EXAMPLES`. Run in a process of its own (tests/server/test_session_import.py) so that a crash (a kernel
reading out of bounds) fails the test instead of killing the test runner.

Each example takes a valid export of a session with every memory of the checkpoint on, changes one tensor (its
shape, dtype or values) or one metadata field, and PUTs it over the session. The server must answer 4xx and keep the
session as it was, or 2xx and then serve it: observe, score, suggest, generate and export answer 2xx with finite
numbers. Exit status 0 when every example holds; otherwise hypothesis prints the smallest failing example."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from server.app import create_app
from server.settings import Settings

TEXT = "Dear Anne, the meeting moved to Tuesday. Dear Anne, the minutes follow.\n"
VALUES = [math.nan, math.inf, -math.inf, 3e38, -1e9, 1e6 + 1, -1e6, 1e6, 0.0, 1.0, -1.0, 2.0**31, -(2.0**31), 255.0]
JSON_VALUES = [10**400, -1, 2**53, 2**53 + 1, 1.5, 1e300, -1e300, "x", None, True, [], {}, 0, 1, 65535, 10**6]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]


def _header(blob: bytes) -> dict[str, Any]:
    return json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])  # type: ignore[no-any-return]


def _tensor_change(t: torch.Tensor, how: str, value: float, dim: int, dtype: torch.dtype, index: int) -> torch.Tensor:
    if how == "empty" and t.dim():
        return t.narrow(dim % t.dim(), 0, 0)
    if how == "twice" and t.dim():
        return torch.cat([t, t], dim % t.dim())
    if how == "unsqueeze":
        return t.unsqueeze(0)
    if how == "dtype":
        return t.to(dtype)
    out = t.clone()
    flat = out.view(-1) if out.numel() else out
    if how == "one" and out.numel():
        flat[index % out.numel()] = torch.tensor(value).to(out.dtype) if out.is_floating_point() \
            else int(max(min(value, 2**62), -(2**62))) if math.isfinite(value) else 0
        return out
    if out.is_floating_point():
        return out.fill_(value)
    return out.fill_(int(max(min(value, 2**62), -(2**62))) if math.isfinite(value) else -1)


def mutations(keys: list[str], fields: list[tuple[str, ...]]) -> st.SearchStrategy[tuple[Any, ...]]:
    tensor = st.tuples(st.just("tensor"), st.sampled_from(keys),
                       st.sampled_from(["empty", "twice", "unsqueeze", "dtype", "one", "fill", "drop"]),
                       st.sampled_from(VALUES), st.integers(0, 3), st.sampled_from(DTYPES), st.integers(0, 10**6))
    field = st.tuples(st.just("field"), st.sampled_from(fields), st.sampled_from(JSON_VALUES))
    extra = st.tuples(st.just("extra"), st.sampled_from(["state.x", "copy.y", "adapter.z", "nothing"]))
    return st.one_of(tensor, field, extra)


def apply(blob: bytes, change: tuple[Any, ...]) -> bytes:
    tensors = load_tensors(blob)
    meta = dict(_header(blob)["__metadata__"])
    session = json.loads(meta["session"])
    if change[0] == "tensor":
        _, key, how, value, dim, dtype, index = change
        if how == "drop":
            del tensors[key]
        else:
            tensors[key] = _tensor_change(tensors[key], how, value, dim, dtype, index).contiguous()
    elif change[0] == "field":
        _, path, value = change
        node = session
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node
        if isinstance(node, dict):
            node[path[-1]] = value
    else:
        tensors[change[1]] = torch.zeros(1)
    meta["session"] = json.dumps(session)
    return save_tensors(tensors, metadata=meta)


def _fields(session: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf path of the export's session metadata, and a new key in each object."""
    out = [(*prefix, "new")]
    for k, v in session.items():
        if isinstance(v, dict) and v:
            out += _fields(v, (*prefix, k))
        else:
            out.append((*prefix, k))
    return out


def _finite_numbers(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite_numbers(v) for v in value)
    return True


def main(checkpoint: str, examples: int) -> int:
    app = create_app(Settings(checkpoint=Path(checkpoint), suggest_budget_ms=0, max_tokens=8))
    with TestClient(app) as c:
        r = c.post("/v1/sessions", json={"initial_text": TEXT, "adaptation": {"cache_weight": 0.5}})  # word cache on
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        blob = c.get(f"/v1/sessions/{sid}/state").content
        keys = sorted(load_tensors(blob))
        fields = _fields(json.loads(_header(blob)["__metadata__"]["session"]))

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(mutations(keys, fields))
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
                    assert _finite_numbers(got.json()), (path, got.text[:300])

        check()
    print(f"{checkpoint}: {examples} mutated imports held")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
