"""schemathesis against /openapi.json, over every operation, with a bounded number of examples each: no 5xx, and
every response (status, content type, body) as the schema says."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.settings import Settings

EXAMPLES = 15  # per operation and mode: 393 requests in all on 16 operations (docs/benchmarks.md)
# valid requests (each must be answered as documented) and invalid ones (each must be a documented 4xx)
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzzed(tiny_checkpoint: Path, serve_app: Any) -> Iterator[str]:
    # small limits, so that generated texts and generations stay quick
    settings = Settings(checkpoint=tiny_checkpoint, max_tokens=8, max_n=2, max_text_bytes=2048,
                        suggest_budget_ms=20)
    with serve_app(settings) as live:
        yield live.url


def test_every_operation_answers_as_its_schema_says(fuzzed: str) -> None:
    """Each operation of the schema, with EXAMPLES generated requests per mode (hypothesis, derandomized: the same
    ones on every run). schemathesis's pytest plugin is not used: it does not load on this pytest."""
    schema = schemathesis.openapi.from_url(f"{fuzzed}/openapi.json")
    counts: Counter[str] = Counter()
    failures: dict[str, str] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation, mode in itertools.product(operations, MODES):
        label = f"{operation.method.upper()} {operation.path}"

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def run(case: Any) -> None:
            counts[label] += 1  # noqa: B023  (run is called at once, in this iteration)
            case.call_and_validate(checks=CHECKS, timeout=60)

        try:
            run()
        except Unsatisfiable:  # an operation that takes nothing has no invalid request
            assert mode == GenerationMode.NEGATIVE, label
        except Exception as e:  # one operation's failure must not hide the others'
            failures[f"{label} ({mode.value})"] = str(e)[:2000]
    paths = httpx.get(f"{fuzzed}/openapi.json").json()["paths"]
    assert {f"{m.upper()} {p}" for p, item in paths.items() for m in item} == set(counts)
    print(json.dumps({"operations": len(counts), "examples": sum(counts.values()), "failures": len(failures),
                      "per_operation": dict(counts)}))
    assert not failures, "\n\n".join(f"{k}: {v}" for k, v in failures.items())


def test_streams_answer_as_their_schema_says(fuzzed: str) -> None:
    """The event streams, asked for explicitly (whether the generated examples reach a 200 stream depends on the
    schema's shape): each event is an object with its `data`, as OpenAPI describes an event stream."""
    schema = schemathesis.openapi.from_url(f"{fuzzed}/openapi.json")
    model = httpx.get(f"{fuzzed}/v1/models").json()["data"][0]["id"]
    for path, body, last in (("/v1/generate", {"prompt": "It", "max_tokens": 4, "stream": True, "seed": 1},
                              '"finish_reason"'),
                             ("/v1/completions", {"model": model, "prompt": "It", "max_tokens": 4, "stream": True,
                                                  "seed": 1}, "data: [DONE]")):
        response = schema[path]["POST"].Case(body=body).call_and_validate(checks=CHECKS, timeout=60)
        assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
        # a byte model's chunks are whole characters: 4 bytes may be fewer events, never none
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert len(events) >= 2 and last in events[-1]
