"""POST /v1/completions against OpenAI's official Python client and raw HTTP: completing, streaming, scoring
with echo + logprobs, and the errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from safetensors.torch import load

from models.base import Adapter, State
from models.checkpoint import load_checkpoint
from models.sampling import SamplingParams, Stepper, generate
from models.scoring import score_bytes
from server.engine import Engine, EngineOverloaded, GenerationStream
from server.errors import OPENAI_ROUTES

PROMPT = "It is a truth universally acknowledged, that "


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Any:
    return load_checkpoint(tiny_checkpoint).model


@pytest.fixture(scope="module")
def oai(live: Any) -> Any:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> str:
    return tiny_checkpoint.name


def pick_stop(text: str) -> str:
    """A 3-character piece of `text` that first appears well inside it (the tiny model's greedy text is all
    spaces, so the tests sample with a seed instead)."""
    for i in range(5, len(text) - 3):
        piece = text[i : i + 3]
        if text.find(piece) == i and "\ufffd" not in piece:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def completion(client: httpx.Client, model: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream_chunks(client: httpx.Client, parse_sse: Any, model: str, **fields: Any) -> list[Any]:
    with client.stream("POST", "/v1/completions",
                       json={"model": model, "prompt": PROMPT, "stream": True, **fields}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_the_official_client_lists_and_completes(oai: Any, model: str) -> None:
    assert [m.id for m in oai.models.list()] == [model]
    c = oai.completions.create(model=model, prompt=PROMPT, max_tokens=20, seed=1)
    assert c.object == "text_completion"
    assert c.id.startswith("cmpl-") and c.created > 0 and c.model == model
    [choice] = c.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert 0 < len(choice.text) <= 20
    n = len(PROMPT.encode())
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (n, 20, n + 20)


def test_the_official_client_retrieves_the_model(oai: Any, model: str, live: Any) -> None:
    card = oai.models.retrieve(model)
    assert card.id == model and card.object == "model" and card.owned_by == "adaptlm"
    assert card.model_dump(exclude_unset=True) == httpx.get(f"{live.url}/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_the_official_client_streams_the_same_text(oai: Any, model: str) -> None:
    whole = oai.completions.create(model=model, prompt=PROMPT, max_tokens=30, seed=7).choices[0].text
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=30, seed=7, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_the_official_client_scores_a_prompt(oai: Any, model: str, reference: Any) -> None:
    text = "Scoring: héllo ✓"
    c = oai.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=0)
    [choice] = c.choices
    assert choice.text == text
    lp = choice.logprobs
    data = text.encode()
    expected = score_bytes(reference, data, logprobs=True).logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(data)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
    assert lp.tokens == [bytes([b]).decode("utf-8", errors="replace") for b in data]
    # Each byte points at the character it starts or continues.
    assert lp.text_offset == [len(data[:i].decode("utf-8", errors="ignore")) for i in range(len(data))]
    assert all(top == {lp.tokens[i]: lp.token_logprobs[i]} for i, top in enumerate(lp.top_logprobs) if i)
    assert c.usage.prompt_tokens == len(data) and c.usage.completion_tokens == 0


def test_logprobs_of_generated_tokens(client: httpx.Client, parse_sse: Any, model: str) -> None:
    fields = {"max_tokens": 25, "seed": 3, "logprobs": 3, "echo": True}
    [choice] = completion(client, model, **fields)["choices"]
    lp = choice["logprobs"]
    n = len(PROMPT.encode())
    assert len(lp["tokens"]) == n + 25
    assert choice["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 4 for top in lp["top_logprobs"][1:])
    assert all(max(top.values()) >= lp["token_logprobs"][i] for i, top in enumerate(lp["top_logprobs"]) if i)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][n] == len(PROMPT)
    # Streamed, the same entries arrive spread over the chunks.
    chunks = stream_chunks(client, parse_sse, model, **fields)
    streamed: dict[str, list[Any]] = {k: [] for k in lp}
    for c in chunks:
        for k in streamed:
            streamed[k] += (c["choices"][0]["logprobs"] or {}).get(k, [])
    assert streamed == lp
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_logprobs_leave_out_the_stop_string(client: httpx.Client, model: str) -> None:
    full = completion(client, model, max_tokens=40, seed=4)["choices"][0]["text"]
    stop = pick_stop(full)
    [choice] = completion(client, model, max_tokens=40, seed=4, stop=stop, logprobs=1)["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.find(stop)]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets and max(offsets) < len(choice["text"])  # no entry for the stop string's bytes
    if "\ufffd" not in full:  # then the text's UTF-8 is the generated bytes, one entry each
        assert len(offsets) == len(choice["text"].encode())


def test_stop_as_a_list(client: httpx.Client, model: str) -> None:
    full = completion(client, model, max_tokens=40, seed=4)["choices"][0]["text"]
    stop = pick_stop(full)
    [choice] = completion(client, model, max_tokens=40, seed=4, stop=["\x01", stop])["choices"]
    assert choice["text"] == full[: full.find(stop)] and choice["finish_reason"] == "stop"


def test_n_choices(client: httpx.Client, parse_sse: Any, model: str) -> None:
    body = completion(client, model, max_tokens=30, seed=11, n=3)
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert texts[0] == completion(client, model, max_tokens=30, seed=11)["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 90
    chunks = stream_chunks(client, parse_sse, model, max_tokens=30, seed=11, n=3)
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == texts[i]
        assert mine[-1]["finish_reason"] == "length"


def test_echo_without_logprobs(client: httpx.Client, parse_sse: Any, model: str) -> None:
    [choice] = completion(client, model, max_tokens=5, echo=True)["choices"]
    assert choice["text"].startswith(PROMPT) and choice["logprobs"] is None
    chunks = stream_chunks(client, parse_sse, model, max_tokens=0, echo=True)
    assert [c["choices"][0]["text"] for c in chunks] == [PROMPT, ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_as_a_list_of_one_and_neutral_fields(client: httpx.Client, model: str) -> None:
    """What clients send by default (LangChain sends the penalties as 0 and logit_bias {}) changes nothing."""
    plain = completion(client, model, max_tokens=12, seed=5)["choices"][0]["text"]
    body = completion(client, model, prompt=[PROMPT], max_tokens=12, seed=5, presence_penalty=0,
                      frequency_penalty=0.0, best_of=1, logit_bias={}, suffix=None, user="someone", stop=None, n=None,
                      temperature=None, top_p=None, logprobs=None, echo=None, stream=None)
    assert body["choices"][0]["text"] == plain and body["choices"][0]["finish_reason"] == "length"
    assert [c["text"] for c in completion(client, model, max_tokens=12, seed=5, n=2, best_of=2)["choices"]] == \
        [c["text"] for c in completion(client, model, max_tokens=12, seed=5, n=2)["choices"]]


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value"),
    ({"frequency_penalty": -0.1}, "frequency_penalty", "unsupported_value"),
    ({"logit_bias": {"50": 1}}, "logit_bias", "unsupported_value"),
    ({"best_of": 3}, "best_of", "unsupported_value"),
    ({"best_of": 2, "n": 3}, "best_of", "best_of_below_n"),
])
def test_unimplemented_fields_are_refused_not_ignored(client: httpx.Client, assert_error: Any, model: str,
                                                      fields: dict[str, Any], param: str, code: str) -> None:
    r = client.post("/v1/completions", json={"model": model, "prompt": "a", **fields})
    error = assert_error(r, 400, "invalid_request_error", param)
    assert error["code"] == code and param in error["message"]
    assert completion(client, model, max_tokens=1)["choices"][0]["finish_reason"] == "length"  # still serving


def test_several_prompts_as_openai_numbers_them(oai: Any, model: str) -> None:
    """A list of prompts: `n` choices of each, prompt p's choice j at index p * n + j, each the text a request of
    that prompt alone gives with the seed of its index (seed + p * n); the usage counts every prompt once and every
    choice."""
    prompts = [PROMPT, "Call me Ishmael. ", "x"]
    alone = [[c.text for c in oai.completions.create(model=model, prompt=p, max_tokens=10, seed=3 + 2 * i,
                                                     n=2).choices]
             for i, p in enumerate(prompts)]
    c = oai.completions.create(model=model, prompt=prompts, max_tokens=10, seed=3, n=2)
    assert [ch.index for ch in c.choices] == list(range(6))
    assert [ch.text for ch in c.choices] == [t for texts in alone for t in texts]
    assert all(ch.finish_reason == "length" for ch in c.choices)
    prompt_tokens = sum(len(p.encode()) for p in prompts)
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (prompt_tokens, 60)
    chunks = list(oai.completions.create(model=model, prompt=prompts, max_tokens=10, seed=3, n=2, stream=True,
                                         stream_options={"include_usage": True}))
    for ch in c.choices:
        mine = [k.choices[0] for k in chunks if k.choices and k.choices[0].index == ch.index]
        assert "".join(m.text for m in mine) == ch.text and mine[-1].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == prompt_tokens and chunks[-1].usage.completion_tokens == 60
    # the prompts stream together, as they are generated: the last prompt's first text comes before the first
    # prompt's end, not after it
    order = [(k.choices[0].index, k.choices[0].finish_reason) for k in chunks if k.choices]
    assert order.index(next(o for o in order if o[0] == 4)) < order.index((0, "length"))


def test_each_choice_of_a_request_samples_from_its_own_seed(oai: Any, model: str) -> None:
    """Choice i of a request samples from seed + i, whichever prompt it is of: the same prompt twice in a list gives
    two choices, as n=2 does (the same seed for every prompt drew the same numbers for each prompt's first choice,
    so that different prompts' samples went together); the same request again, the same choices."""
    prompts = [PROMPT, PROMPT]
    twice = [c.text for c in oai.completions.create(model=model, prompt=prompts, max_tokens=20, seed=5).choices]
    n2 = [c.text for c in oai.completions.create(model=model, prompt=PROMPT, max_tokens=20, seed=5, n=2).choices]
    assert twice == n2 and twice[0] != twice[1]
    assert [c.text for c in oai.completions.create(model=model, prompt=prompts, max_tokens=20, seed=5).choices] == twice


def test_the_schema_declares_400_not_422_on_the_openai_routes(client: httpx.Client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert OPENAI_ROUTES <= set(paths)  # the rule's route templates are the served ones
    for path in OPENAI_ROUTES:
        assert all("422" not in operation["responses"] for operation in paths[path].values()), path
    completions = paths["/v1/completions"]["post"]["responses"]
    assert {"400", "413"} <= set(completions)  # 413: a body over ADAPTLM_MAX_BODY_BYTES, refused before routing
    assert {"400", "413", "422"} <= set(paths["/v1/score"]["post"]["responses"])


def test_the_schema_bounds_the_prompts_by_max_n(client: httpx.Client) -> None:
    prompt = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    [array] = [b for b in prompt["anyOf"] if b.get("type") == "array"]
    assert (array["minItems"], array["maxItems"]) == (1, 8)  # Settings().max_n


def test_several_prompts_refused_midway_cancel_the_submitted(client: httpx.Client, assert_error: Any, model: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A full queue refuses the second prompt's generation: the request is a 429 and the first one's generation,
    already submitted, is cancelled rather than left running for nobody."""
    submit = Engine.generate
    submitted: list[GenerationStream] = []

    def second_refused(self: Engine, *args: Any, **kwargs: Any) -> GenerationStream:
        if submitted:
            raise EngineOverloaded("the server is busy", 1)
        submitted.append(submit(self, *args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(Engine, "generate", second_refused)
    r = client.post("/v1/completions", json={"model": model, "prompt": [PROMPT, PROMPT], "max_tokens": 200})
    assert assert_error(r, 429, "rate_limit_error")["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert len(submitted) == 1 and submitted[0].cancelled
    monkeypatch.undo()
    assert completion(client, model, max_tokens=2)["usage"]["completion_tokens"] == 2


def test_several_prompts_scored_with_echo(oai: Any, model: str, reference: Any) -> None:
    texts = ["Scoring: héllo", "It was the best of times"]
    c = oai.completions.create(model=model, prompt=texts, max_tokens=0, echo=True, logprobs=0)
    assert [ch.text for ch in c.choices] == texts
    for text, ch in zip(texts, c.choices, strict=True):
        expected = score_bytes(reference, text.encode(), logprobs=True).logprobs
        assert ch.logprobs.token_logprobs[0] is None
        assert ch.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
        assert ch.logprobs.text_offset[-1] == len(text) - 1
    assert c.usage.prompt_tokens == sum(len(t.encode()) for t in texts)


def test_top_p_0_is_the_most_likely_token(client: httpx.Client, model: str) -> None:
    """OpenAI takes top_p in [0, 1]; 0 leaves only the most likely token: the greedy text, whatever the seed."""
    greedy = completion(client, model, prompt="The ", max_tokens=12, temperature=0)["choices"][0]["text"]
    body = completion(client, model, prompt="The ", max_tokens=12, top_p=0, seed=9, n=2)
    assert [c["text"] for c in body["choices"]] == [greedy, greedy]


def test_stream_without_usage_ends_with_finish_and_done(client: httpx.Client, parse_sse: Any, model: str) -> None:
    chunks = stream_chunks(client, parse_sse, model, max_tokens=10)
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"max_tokens": -1}, "max_tokens", "greater_than_equal"),
    ({"max_tokens": 4097}, "max_tokens", "less_than_equal"),
    ({"temperature": 2.5}, "temperature", "less_than_equal"),
    ({"top_p": -0.1}, "top_p", "greater_than_equal"),
    ({"top_p": 1.5}, "top_p", "less_than_equal"),
    ({"n": 0}, "n", "greater_than_equal"),
    ({"n": 9}, "n", "less_than_equal"),
    ({"logprobs": 6}, "logprobs", "less_than_equal"),
    ({"prompt": ["a"] * 9}, "prompt", "too_many_choices"),
    ({"prompt": ["a", "b"], "n": 5}, "prompt", "too_many_choices"),
    ({"prompt": []}, "prompt", "too_short"),
    ({"prompt": [1, 2]}, "prompt", "token_prompt_unsupported"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "token_prompt_unsupported"),
    ({"prompt": ["a", None]}, "prompt.1", "string_type"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "too_long"),
    ({"stop": ""}, "stop.0", "string_too_short"),
    ({"suffix": "x"}, "suffix", "none_required"),
    ({"top_k": 5}, "top_k", "extra_forbidden"),
    ({"stream_options": {"other": 1}}, "stream_options.other", "extra_forbidden"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream_options_without_stream"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options", "stream_options_without_stream"),
])
def test_invalid_requests_are_400_as_openai_answers(client: httpx.Client, assert_error: Any, model: str,
                                                    fields: dict[str, Any], param: str, code: str) -> None:
    """OpenAI answers an invalid parameter with 400 `invalid_request_error`; the param and code say which."""
    r = client.post("/v1/completions", json={"model": model, "prompt": "a", **fields})
    assert assert_error(r, 400, "invalid_request_error", param)["code"] == code


def test_nan_temperature_is_400(client: httpx.Client, assert_error: Any, model: str) -> None:
    body = b'{"model": "' + model.encode() + b'", "prompt": "a", "temperature": NaN}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert assert_error(r, 400, "invalid_request_error", "temperature")["code"] == "finite_number"


@pytest.mark.parametrize(("body", "content_type", "code"), [
    (b'{"prompt": "a"', "application/json", "invalid_json"),
    (b"model=m&prompt=a", "application/x-www-form-urlencoded", "model_attributes_type"),
])
def test_a_body_that_is_not_a_json_object_is_400(client: httpx.Client, assert_error: Any, body: bytes,
                                                 content_type: str, code: str) -> None:
    r = client.post("/v1/completions", content=body, headers={"content-type": content_type})
    assert assert_error(r, 400, "invalid_request_error")["code"] == code


def test_unknown_model_is_404(client: httpx.Client, assert_error: Any) -> None:
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"})
    assert assert_error(r, 404, "not_found_error", "model")["code"] == "model_not_found"


def test_the_official_client_raises_typed_errors(oai: Any, model: str) -> None:
    """What code written against OpenAI catches: a bad parameter is a BadRequestError naming it."""
    for fields, param in (({"max_tokens": -1}, "max_tokens"), ({"presence_penalty": 0.5}, "presence_penalty"),
                          ({"n": 9}, "n"), ({"prompt": ["a", "b"], "n": 5}, "prompt")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(**{"model": model, "prompt": "a", **fields})
        assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
        assert info.value.param == param and info.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="a")


def test_a_prompt_over_the_text_limit_is_context_length_exceeded(oai: Any, model: str, live: Any) -> None:
    """OpenAI's answer to a prompt too long for the model, which applications (LangChain too) test for: a
    BadRequestError whose code is `context_length_exceeded`."""
    limit = live.app.state.settings.max_text_bytes
    for prompt in ("x" * (limit + 1), ["a", "é" * (limit // 2 + 1)]):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=model, prompt=prompt, max_tokens=1)
        assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
        assert info.value.type == "invalid_request_error" and f"at most {limit}" in info.value.message
    assert oai.completions.create(model=model, prompt="x", max_tokens=1).choices[0].finish_reason == "length"


def test_only_the_openai_surface_answers_400(oai: Any, model: str) -> None:
    """The project's own routes keep their 422 (the same client, calling them by path, raises
    UnprocessableEntityError); only the OpenAI routes speak OpenAI's 400."""
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="a", temperature=2.5)
    for path, body in (("/score", {"text": "a", "logprobs": "many"}), ("/generate", {"prompt": "a", "max_tokens": -1})):
        with pytest.raises(openai.UnprocessableEntityError) as info:
            oai.post(path, body=body, cast_to=object)
        assert info.value.status_code == 422 and info.value.type == "validation_error"


def test_an_error_after_the_stream_started(oai: Any, client: httpx.Client, parse_sse: Any, model: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    feed = Stepper.feed
    calls = itertools.count()

    def failing(self: Stepper, token: int) -> None:
        if next(calls) % 20 == 19:
            raise RuntimeError("secret-internal-detail")
        feed(self, token)

    monkeypatch.setattr(Stepper, "feed", failing)
    with client.stream("POST", "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 100,
                                                        "stream": True}) as r:
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"message": "internal server error", "type": "server_error",
                                                "param": None, "code": None}}
    with pytest.raises(openai.APIError, match="internal server error"):
        for _ in oai.completions.create(model=model, prompt=PROMPT, max_tokens=100, stream=True):
            pass


def test_user_names_a_session(oai: Any, client: httpx.Client, model: str, reference: Any) -> None:
    """`user` = a session id: the completion continues the session under its adapter (and leaves it unchanged);
    any other `user` is only an identifier. The greedy texts are checked against the library's on the same weights:
    which letters a 40-step model trained in this run writes depends on the CPU's numerics."""
    r = client.post("/v1/sessions", json={"adaptation": {"lr": 0.03}})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    assert client.post(f"/v1/sessions/{sid}/observe", json={"text": "zorblax " * 400}).status_code == 200
    before = client.get(f"/v1/sessions/{sid}").json()["stats"]
    blob = client.get(f"/v1/sessions/{sid}/state").content  # the export: adapter, state and next byte
    exported = load(blob)
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    last_byte = json.loads(header["__metadata__"]["session"])["last_token"]
    adapted = oai.completions.create(model=model, prompt="zorb", max_tokens=8, temperature=0, user=sid)
    plain = oai.completions.create(model=model, prompt="zorb", max_tokens=8, temperature=0, user="someone-else")
    greedy = SamplingParams(max_tokens=8, temperature=0)
    under_session = "".join(generate(reference, b"zorb", greedy, adapter=Adapter({"h": exported["adapter.h"]}),
                                     state=State({"h": exported["state.h"], "c": exported["state.c"]}),
                                     last_token=last_byte))
    assert adapted.choices[0].text == under_session
    assert plain.choices[0].text == "".join(generate(reference, b"zorb", greedy))
    assert adapted.choices[0].text != plain.choices[0].text  # the adapter shows in the greedy text
    # scoring under the session: the adapted session finds the word far more likely than the model does
    text = " zorblax zorblax"
    scored = [oai.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=0, user=u)
              for u in (sid, None)]
    session_lp, static_lp = (sum(c.choices[0].logprobs.token_logprobs[1:]) for c in scored)
    assert session_lp > static_lp + 10
    expected = score_bytes(reference, text.encode(), logprobs=True).logprobs
    assert scored[1].choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
    assert client.get(f"/v1/sessions/{sid}").json()["stats"] == before
