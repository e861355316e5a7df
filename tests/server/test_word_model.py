"""Serving a word-level checkpoint (issue 13): the tiny AWD-LSTM trained here, served for the stateless surfaces
(score, generate, completions, models, metrics, the CLI's lines) with word counts and texts; its sessions and
suggestions are tests/server/test_word_sessions.py's."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from models.checkpoint import Checkpoint, load_checkpoint
from models.sampling import SamplingParams, Stepper
from models.scoring import score_bytes
from models.word_tokenizer import WordTokenizer
from server.engine import Finished, GenerationStream, Token, TokenLogprob
from server.engine._loading import load_model
from server.protocol import CompletionResponse
from server.serving._completions import _complete, _Job

VALID = Path(__file__).resolve().parent.parent / "data" / "valid.txt"
PROMPT = "It was the "
UNKNOWN = " zyzzyva"  # not in the vocabulary: one " <unk>" token


@pytest.fixture(scope="module")
def reference(word_checkpoint: Path) -> Checkpoint:
    ckpt = load_checkpoint(word_checkpoint)
    ckpt.model.eval()
    assert isinstance(ckpt.tokenizer, WordTokenizer)
    return ckpt


@pytest.fixture
def client(words_client: httpx.Client) -> httpx.Client:
    return words_client  # the word checkpoint's server (conftest.py), under the name these tests use


def library_generation(ckpt: Checkpoint, prompt: str, params: SamplingParams) -> tuple[str, list[int], list[Any]]:
    """What models.sampling gives for the same checkpoint, prompt and parameters: text, token ids, logits."""
    stepper = Stepper(ckpt.model, params, tokenizer=ckpt.tokenizer)
    stepper.prefill(prompt.encode("utf-8"))
    text, ids, logits = [], [], []
    while stepper.finish_reason is None:
        step = stepper.step()
        text.append(step.text)
        ids.append(step.token)
        logits.append(step.logits)
    return "".join(text), ids, logits


def test_a_word_checkpoint_loads_with_sessions(word_checkpoint: Path) -> None:
    loaded = load_model(word_checkpoint, "float32", "cpu")
    assert isinstance(loaded.info.tokenizer, WordTokenizer) and loaded.info.tokenizer == loaded.ckpt.tokenizer
    assert loaded.info.sessions is not None and loaded.base is not None and not loaded.info.sessions_unavailable


def test_models_say_the_tokenizer_and_vocabulary(client: httpx.Client, reference: Checkpoint) -> None:
    [card] = client.get("/v1/models").json()["data"]
    assert card["tokenizer"] == "words" and card["vocab_size"] == reference.tokenizer.vocab_size == 2000


def test_score_reports_words_and_bytes_as_the_library(client: httpx.Client, reference: Checkpoint) -> None:
    text = VALID.read_text(encoding="utf-8")[:700] + UNKNOWN + " café.\n"
    data = text.encode("utf-8")
    r = client.post("/v1/score", json={"text": text, "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = reference.tokenizer.encode(text)
    assert body["bytes"] == len(data) and body["tokens"] == len(ids) < len(data)
    expected = score_bytes(reference.model, data, logprobs=True, tokenizer=reference.tokenizer)  # adaptlm score's
    assert expected.tokens == len(ids)
    assert body["bits"] == pytest.approx(expected.bits, rel=1e-5)
    assert body["bits_per_byte"] == pytest.approx(body["bits"] / len(data), rel=1e-12)
    assert body["bits_per_word"] == pytest.approx(body["bits"] / len(ids), rel=1e-12)
    assert body["bits_per_word"] == pytest.approx(expected.bits_per_token, rel=1e-5)
    assert body["perplexity"] == pytest.approx(2 ** body["bits_per_word"], rel=1e-12)
    assert body["perplexity"] < reference.tokenizer.vocab_size  # trained: better than a uniform guess
    assert expected.logprobs is not None and len(body["logprobs"]) == len(ids)  # one per word, not per byte
    assert body["logprobs"] == pytest.approx(expected.logprobs, rel=1e-4, abs=1e-4)
    assert -sum(body["logprobs"]) / math.log(2) == pytest.approx(body["bits"], rel=1e-6)


def test_score_gives_each_token_its_text_as_completions_echo_lists_it(client: httpx.Client,
                                                                     reference: Checkpoint) -> None:
    """A word model's logprobs come with each token's text as written (joined: the text; a byte model's are the
    text's bytes). /v1/completions' echo of the same text lists the same tokens (a word the vocabulary lacks as
    " <unk>", at the offset of its own letters) with the same log-probabilities."""
    tok = reference.tokenizer
    text = "It was the best" + UNKNOWN + " of times.\n"
    body = client.post("/v1/score", json={"text": text, "logprobs": True}).json()
    texts = body["token_texts"]
    assert texts == tok.tokens(text) and "".join(texts) == text and UNKNOWN in texts
    assert len(texts) == len(body["logprobs"]) == body["tokens"]
    echo = client.post("/v1/completions", json={"model": reference.name, "prompt": text, "max_tokens": 0,
                                                "echo": True, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert echo["tokens"] == [tok.vocab[i] for i in tok.encode(text)] and " <unk>" in echo["tokens"]
    ends = [*echo["text_offset"][1:], len(text)]
    assert [text[a:b] for a, b in zip(echo["text_offset"], ends, strict=True)] == texts
    assert echo["token_logprobs"][1:] == pytest.approx(body["logprobs"][1:], abs=1e-4)
    assert "token_texts" not in client.post("/v1/score", json={"text": text}).json()  # only with logprobs


def test_generate_is_the_library_stepper_with_max_tokens_words(client: httpx.Client, reference: Checkpoint) -> None:
    params = SamplingParams(max_tokens=12, seed=7)
    text, ids, _ = library_generation(reference, PROMPT, params)
    r = client.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 12, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == text
    # the words' own text, not bytes of ids; the prompt's trailing space is held back, the first word's (healing)
    assert PROMPT + text == PROMPT[:-1] + reference.tokenizer.decode(ids)
    assert body["finish_reason"] == "length"
    prompt_tokens = len(reference.tokenizer.encode(PROMPT))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 12,
                             "total_tokens": prompt_tokens + 12}
    assert len(text.encode("utf-8")) > 12  # words, several bytes each


def test_streaming_generation_equals_the_whole(client: httpx.Client, parse_sse: Any) -> None:
    request = {"prompt": PROMPT, "max_tokens": 10, "seed": 3, "temperature": 0.8, "stop": ["."]}
    whole = client.post("/v1/generate", json=request).json()
    with client.stream("POST", "/v1/generate", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in parse_sse(r.iter_lines())]
    assert "".join(e["text"] for e in events[:-1]) == whole["text"]
    assert events[-1]["finish_reason"] == whole["finish_reason"] and events[-1]["usage"] == whole["usage"]


def test_completions_count_words_and_give_their_texts(client: httpx.Client, reference: Checkpoint) -> None:
    tok = reference.tokenizer
    text, ids, logits = library_generation(reference, PROMPT, SamplingParams(max_tokens=8, seed=5))
    r = client.post("/v1/completions", json={"model": reference.name, "prompt": PROMPT, "max_tokens": 8, "seed": 5,
                                             "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    prompt_tokens = len(tok.encode(PROMPT))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8, "total_tokens": prompt_tokens + 8}
    lp = choice["logprobs"]
    # the first word's space is the prompt's (token healing): its entry, and its alternatives', show the rest
    held = [1] + [0] * (len(ids) - 1)
    shown = [tok.vocab[i][h:] for i, h in zip(ids, held, strict=True)]
    assert lp["tokens"] == shown and "".join(shown) == text
    assert lp["text_offset"] == list(itertools.accumulate([0] + [len(t) for t in shown[:-1]]))
    for token, h, logits_, chosen, top in zip(ids, held, logits, lp["token_logprobs"], lp["top_logprobs"],
                                              strict=True):
        logp = torch.log_softmax(logits_.float(), dim=-1)  # the first: among the tokens that start with " "
        assert chosen == pytest.approx(float(logp[token]), abs=1e-4)
        best = torch.topk(logp, 2).indices.tolist()
        assert set(top) == {tok.vocab[i][h:] for i in [*best, token]}


def test_completions_echo_scores_the_prompt_by_words(client: httpx.Client, reference: Checkpoint) -> None:
    tok = reference.tokenizer
    prompt = "It was the best" + UNKNOWN + " of times."
    r = client.post("/v1/completions", json={"model": reference.name, "prompt": prompt, "max_tokens": 0, "echo": True,
                                             "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    ids = tok.encode(prompt)
    lp = choice["logprobs"]
    assert choice["text"] == prompt and body["usage"]["prompt_tokens"] == len(ids)
    assert lp["tokens"] == [tok.vocab[i] for i in ids] and " <unk>" in lp["tokens"]
    # offsets into the prompt as sent: after the unknown word they count its own letters, not "<unk>"'s
    assert lp["text_offset"] == list(itertools.accumulate([0] + [len(t) for t in tok.tokens(prompt)[:-1]]))
    expected = score_bytes(reference.model, prompt.encode("utf-8"), logprobs=True, tokenizer=tok)
    assert expected.logprobs is not None
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected.logprobs[1:], abs=1e-4)


def test_the_cli_text_lines_give_a_word_model_its_bits_per_word(words_url: str, word_checkpoint: Path,
                                                                 tmp_path: Path) -> None:
    """`adaptlm score`, `adaptlm eval` and `adaptlm client score` print one line each; for a word model all three add
    bits per word and perplexity (`eval` and `client score` left them out: only --json had them), the same figure."""
    from tests._cli import run_cli

    text = VALID.read_text(encoding="utf-8")[:400]
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")

    def line(*args: str) -> str:
        r = run_cli(*args)
        assert r.returncode == 0, r.stderr
        [out] = r.stdout.splitlines()
        return out

    figures = re.compile(r"(?:static: )?([0-9.]+) bits per byte, ([0-9.]+) bits per word, perplexity ([0-9.]+) \(")
    lines = [line("score", str(tmp_path / "t.txt"), "--checkpoint", str(word_checkpoint)),
             line("eval", str(tmp_path / "t.txt"), "--checkpoint", str(word_checkpoint), "--mode", "static"),
             line("client", "score", text, "--url", words_url)]
    found = [figures.match(out) for out in lines]
    assert all(found), lines
    local, evaluated, served = ([float(x) for x in m.groups()] for m in found if m is not None)
    assert evaluated == pytest.approx(local, rel=1e-3) and served == pytest.approx(local, rel=1e-3)


def test_the_token_metrics_count_words(client: httpx.Client, reference: Checkpoint) -> None:
    """adaptlm_prompt_tokens and adaptlm_generated_tokens count the model's tokens: a word model's words, as the usage
    does (their help said bytes)."""

    def counts() -> tuple[dict[str, float], str]:
        text = client.get("/metrics").text
        values = {m[1]: float(m[2]) for m in re.finditer(r"^(adaptlm_(?:prompt|generated)_tokens_total)\{[^}]*\} (\S+)",
                                                          text, re.M)}
        return values, text

    before, _ = counts()
    usage = client.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 9, "seed": 1}).json()["usage"]
    after, text = counts()
    assert after["adaptlm_generated_tokens_total"] - before["adaptlm_generated_tokens_total"] == 9
    assert after["adaptlm_prompt_tokens_total"] - before["adaptlm_prompt_tokens_total"] == usage["prompt_tokens"]
    assert usage["prompt_tokens"] == len(reference.tokenizer.encode(PROMPT)) < len(PROMPT.encode())
    for name in ("adaptlm_prompt_tokens_total", "adaptlm_generated_tokens_total",
                 "adaptlm_time_to_first_token_seconds", "adaptlm_inter_token_latency_seconds"):
        [help_line] = [line for line in text.splitlines() if line.startswith(f"# HELP {name} ")]
        assert "word" in help_line, help_line


@pytest.mark.parametrize("prompt", [PROMPT, "It was the best of th"])
def test_a_prompt_ending_in_a_space_or_part_of_a_word_is_continued_as_typed(client: httpx.Client,
                                                                            reference: Checkpoint,
                                                                            prompt: str) -> None:
    """Token healing through the server: /v1/generate and /v1/completions (whole, streamed, echo and logprobs) give
    what models.sampling gives: the continuation of the prompt as typed, its held-back end not repeated; echo's
    logprobs list the prompt's tokens as written, then what each generated token adds, at its offset."""
    tok = reference.tokenizer
    assert isinstance(tok, WordTokenizer)
    kept, held = tok.heal(prompt.encode())
    assert held in (b" ", b" th")
    text, ids, _ = library_generation(reference, prompt, SamplingParams(max_tokens=6, temperature=0))
    assert (prompt + text).encode() == kept + tok.decode_bytes(ids) and tok.token_bytes(ids[0]).startswith(held)
    assert not text.startswith(" ") or held != b" "
    r = client.post("/v1/generate", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.json()["text"] == text
    request = {"model": reference.name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True,
               "logprobs": 1}
    [choice] = client.post("/v1/completions", json=request).json()["choices"]
    assert choice["text"] == prompt + text
    lp = choice["logprobs"]
    n = len(tok.encode(prompt))
    assert lp["tokens"][:n] == [tok.vocab[i] for i in tok.encode(prompt)]  # the prompt as written
    assert "".join(lp["tokens"][n:]) == text
    assert lp["text_offset"][n:] == list(itertools.accumulate([len(prompt)] + [len(t) for t in lp["tokens"][n:-1]]))
    assert all(held.decode() + t in tok.vocab for t in lp["top_logprobs"][n])  # alternatives that continue it too
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == prompt + text


def test_a_last_token_that_adds_nothing_past_the_held_text_keeps_its_logprobs_entry() -> None:
    """max_tokens 1 where the token covers only a start of the held text (" " of a held "  "): its text is empty,
    and its logprobs entry still comes out, whole and streamed (the chunk that finishes the choice); one entry per
    token counted. At a stop, the stop string's tokens still have none."""
    tok = WordTokenizer.build(["It was  I was"])
    space, i_ = tok.encode("  I")
    lp = TokenLogprob(-0.5, ((space, -0.5),))
    job = _Job(id="cmpl-x", created=0, model="words", prompts=["It was  "], tokenizer=tok, n=1, echo=False,
               logprobs=True)

    async def complete(events: list[Token | Finished]) -> CompletionResponse:
        stream = GenerationStream(1, 0.0, threading.Event())
        for event in events:
            stream._deliver(event)
        return await _complete([stream], job)

    partial = Token(0, space, "", 0, lp, 0.0, b"  ")
    [choice] = asyncio.run(complete([partial, Finished(0, "length", 1, 0.0, 0.0, 2)])).choices
    assert choice.text == "" and choice.logprobs is not None
    assert choice.logprobs.tokens == [""] and choice.logprobs.text_offset == [0]
    streamed = job.choices()[0]
    assert streamed.add(partial) == ("", None)
    block = streamed.finish(Finished(0, "length", 1, 0.0, 0.0, 2))
    assert block is not None and block.tokens == [""]
    stopped = job.choices()[0]  # a stop: the tokens whose text never went out have no entry
    stopped.add(partial)
    stopped.add(Token(0, i_, "", 0, lp, 0.0, b" "))
    assert stopped.finish(Finished(0, "stop", 2, 0.0, 0.0, 2)) is None and stopped.released == []
