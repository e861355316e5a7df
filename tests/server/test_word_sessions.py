"""Sessions of a word-level checkpoint (issue 13): observed text is scored up to its last word, which stays pending
until what follows settles its tokens; pending text is part of the session (export, import, Redis, reset)."""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
import string
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from models.checkpoint import load_checkpoint
from models.word_tokenizer import WordTokenizer
from server.engine._export import _header_metadata
from server.settings import Settings

VALID = Path(__file__).resolve().parent.parent / "data" / "valid.txt"
TEXT = VALID.read_text(encoding="utf-8")[:600]


@pytest.fixture(scope="module")
def tok(word_checkpoint: Path) -> WordTokenizer:
    tokenizer = WordTokenizer.from_dict(json.loads((word_checkpoint / "config.json").read_text())["tokenizer"])
    return tokenizer


@pytest.fixture
def client(words_client: httpx.Client) -> httpx.Client:
    return words_client  # the word checkpoint's server (conftest.py), under the name these tests use


def new(client: httpx.Client, **settings: Any) -> str:
    r = client.post("/v1/sessions", json=settings)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def observe(client: httpx.Client, sid: str, text: str) -> dict[str, Any]:
    r = client.post(f"/v1/sessions/{sid}/observe", json={"text": text})
    assert r.status_code == 200, r.text
    return dict(r.json())


def exported(client: httpx.Client, sid: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    blob = client.get(f"/v1/sessions/{sid}/state").content
    return load_tensors(blob), json.loads(_header_metadata(blob)["session"])


def test_observe_in_pieces_equals_observe_at_once(client: httpx.Client, tok: WordTokenizer) -> None:
    sid = new(client)
    segment = client.get(f"/v1/sessions/{sid}").json()["adaptation"]["segment"]
    data = TEXT.encode("utf-8")
    # a cut inside a word whose stable part is a whole number of segments (each request's segments start afresh)
    cut = next(p for p in range(len(data) - 1, 0, -1) if data[p - 1 : p + 1].isalpha()
               and len(tok.tokens(tok.split_stable(data[:p])[0])) % segment == 0
               and len(tok.tokens(tok.split_stable(data[:p])[0])) > 0)
    first = observe(client, sid, data[:cut].decode())
    assert first["pending_bytes"] > 0 and first["bytes"] + first["pending_bytes"] == cut
    assert first["tokens"] == len(tok.tokens(tok.split_stable(data[:cut])[0]))
    second = observe(client, sid, data[cut:].decode())
    whole = new(client)
    once = observe(client, whole, TEXT)
    stable, pending = tok.split_stable(data)
    assert once["bytes"] == len(stable) and once["pending_bytes"] == len(pending) == second["pending_bytes"]
    assert first["bytes"] + second["bytes"] == once["bytes"] and first["tokens"] + second["tokens"] == once["tokens"]
    assert first["bits"] + second["bits"] == pytest.approx(once["bits"], rel=1e-4)
    assert first["static_bits"] + second["static_bits"] == pytest.approx(once["static_bits"], rel=1e-4)
    assert first["updates"] + second["updates"] == once["updates"] > 0
    (a, meta_a), (b, meta_b) = exported(client, sid), exported(client, whole)
    assert meta_a["pending"] == meta_b["pending"] == base64.b64encode(pending).decode()
    assert meta_a["last_token"] == meta_b["last_token"] == tok.encode(stable)[-1]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_an_observe_that_only_grows_the_word_scores_nothing(client: httpx.Client) -> None:
    sid = new(client)
    first = observe(client, sid, "It was the be")
    assert first["bytes"] == len("It was the") and first["pending_bytes"] == len(" be") and first["tokens"] == 3
    grown = observe(client, sid, "s")
    assert grown == {**grown, "bits": 0.0, "bytes": 0, "tokens": 0, "bits_per_byte": None, "updates": 0,
                     "static_bits_per_byte": None, "pending_bytes": len(" bes")}
    done = observe(client, sid, "t of")
    assert done["bytes"] == len(" best") and done["pending_bytes"] == len(" of")
    body = client.get(f"/v1/sessions/{sid}").json()
    assert body["stats"]["bytes_observed"] == len("It was the best")


def test_the_session_says_what_it_read_including_its_pending_word(client: httpx.Client) -> None:
    """A client whose observe got no answer (a timeout, a 502) asks the session what it read before sending the text
    again (docs/operations.md): an observe that only grew the pending word leaves bytes_observed as it was, so
    bytes_observed alone could not tell; bytes_observed + pending_bytes is every byte the session read."""
    sid = new(client)
    sent = "It was the be"
    observe(client, sid, sent)
    before = client.get(f"/v1/sessions/{sid}").json()["stats"]
    assert before["bytes_observed"] + before["pending_bytes"] == len(sent)
    observe(client, sid, "s")  # its answer "lost": was it read?
    after = client.get(f"/v1/sessions/{sid}").json()["stats"]
    assert after["bytes_observed"] == before["bytes_observed"]  # the question bytes_observed alone cannot answer
    assert after["bytes_observed"] + after["pending_bytes"] == len(sent + "s")
    assert client.post(f"/v1/sessions/{sid}/reset").json()["stats"]["pending_bytes"] == 0


def test_a_score_that_adapts_on_only_the_pending_word_is_read_by_the_sdk(words_url: str) -> None:
    """A score with `adapt` reads the text as an observe does: one that only grows the pending word scores nothing, and
    its answer says so as the observe's does (bits_per_byte null), in a shape the SDK reads."""
    from adaptlm_client import Client

    with Client(words_url) as sdk:
        session = sdk.create_session()
        grown = sdk.score("It was the be", session_id=session.id, adapt=True)
        assert grown.bytes == len("It was the") and grown.bits_per_byte == pytest.approx(grown.bits / grown.bytes)
        nothing = sdk.score("s", session_id=session.id, adapt=True)
        assert (nothing.bits, nothing.bytes, nothing.tokens, nothing.bits_per_byte) == (0.0, 0, 0, None)
        assert math.copysign(1.0, nothing.bits) == 1.0  # 0.0, not -0.0
        assert nothing.logprobs is None and session.get().stats.bytes_observed == len("It was the")


def test_a_session_adapts_once_per_segment_of_words(client: httpx.Client, tok: WordTokenizer) -> None:
    """`adaptation.segment` counts the model's tokens (a word model's words), as the schema says (it said bytes): an
    observe of n settled tokens makes ceil(n / segment) updates."""
    sid = new(client)
    segment = client.get(f"/v1/sessions/{sid}").json()["adaptation"]["segment"]
    body = observe(client, sid, TEXT + "\n")
    assert body["tokens"] == len(tok.tokens(TEXT + "\n")) and body["bytes"] == len((TEXT + "\n").encode())
    assert body["updates"] == math.ceil(body["tokens"] / segment) < math.ceil(body["bytes"] / segment)
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "words" in schemas["AdaptationSettings"]["properties"]["segment"]["description"]


def test_a_session_adapts_on_repeated_text(client: httpx.Client) -> None:
    sid = new(client)
    text = TEXT[:300] + "\n"
    first, again = observe(client, sid, text), observe(client, sid, text)
    assert again["bytes"] == first["bytes"] and again["bits"] < first["bits"]


def test_score_and_generation_continue_after_the_pending_text(client: httpx.Client, tok: WordTokenizer) -> None:
    typed, whole = new(client), new(client)
    observe(client, typed, "It was the be")
    observe(client, whole, "It was the b")  # the same stable text, another part of the word pending
    score = client.post("/v1/score", json={"text": "st of times.", "session_id": typed}).json()
    same = client.post("/v1/score", json={"text": "est of times.", "session_id": whole}).json()
    assert score["bits"] == pytest.approx(same["bits"], rel=1e-5) and score["tokens"] == same["tokens"] == 4
    one = client.post("/v1/generate", json={"prompt": "st", "session_id": typed, "max_tokens": 6, "seed": 2}).json()
    two = client.post("/v1/generate", json={"prompt": "est", "session_id": whole, "max_tokens": 6,
                                            "seed": 2}).json()
    assert one["text"] == two["text"] and one["usage"]["completion_tokens"] == 6


def test_a_session_score_gives_the_texts_of_the_tokens_it_scored(client: httpx.Client) -> None:
    """With a session, a score's tokens are those of its pending text and the text (with `adapt`, up to the last word,
    which stays pending): their texts say so, joined as `bytes` counts them."""
    sid = new(client)
    observe(client, sid, "It was the be")  # " be" pending
    peek = client.post("/v1/score", json={"text": "st of times.", "session_id": sid, "logprobs": True}).json()
    assert peek["token_texts"] == [" best", " of", " times", "."]
    assert len(peek["logprobs"]) == peek["tokens"] == 4 and peek["bytes"] == len(" best of times.")
    adapt = client.post("/v1/score", json={"text": "st of times", "session_id": sid, "logprobs": True,
                                           "adapt": True}).json()
    assert adapt["token_texts"] == [" best", " of"] and len(adapt["logprobs"]) == 2
    assert adapt["bytes"] == len(" best of")
    nothing = client.post("/v1/score", json={"text": "s", "session_id": sid, "logprobs": True, "adapt": True}).json()
    assert nothing["token_texts"] == nothing["logprobs"] == [] and nothing["bytes"] == 0  # " timess" pending


def test_completions_echo_offsets_count_from_the_prompt_after_the_pending_text(client: httpx.Client,
                                                                               tok: WordTokenizer) -> None:
    sid = new(client)
    observe(client, sid, "It was the be")  # " be" stays pending: the prompt finishes its word
    model = client.get("/v1/models").json()["data"][0]["id"]
    prompt = "st of times."
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 0, "echo": True,
                                             "logprobs": 0, "user": sid})
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    lp = choice["logprobs"]
    tokens = tok.tokens(" be" + prompt)  # the first token is the pending word and the prompt's start
    assert lp["tokens"] == [t if tok.encode(t)[0] >= 4 else tok.vocab[tok.encode(t)[0]] for t in tokens]
    assert body["usage"]["prompt_tokens"] == len(tokens) and choice["text"] == prompt
    # each later token's offset is where it starts in the prompt as sent; the first one starts before it: 0
    starts = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))
    assert lp["text_offset"] == [max(0, s - len(" be")) for s in starts]
    assert [prompt[o:] for o in lp["text_offset"][1:]] == ["".join(tokens[i:]) for i in range(1, len(tokens))]


@pytest.mark.parametrize(("observed", "prompt"), [("It was the be", " of times."),  # " be" a token of its own
                                                  ("It was the best of times. ", " It was")])  # " " likewise
def test_echo_logprobs_list_the_pending_tokens_before_the_prompt(client: httpx.Client, tok: WordTokenizer,
                                                                 observed: str, prompt: str) -> None:
    """The pending text's tokens, where they do not run into the prompt's first word, are listed too (at offset 0):
    the prompt's log-probs include the pending words'; the text offsets of the others are into the prompt."""
    sid = new(client)
    pending = tok.split_stable(observed.encode())[1].decode()
    assert pending and observe(client, sid, observed)["pending_bytes"] == len(pending)
    model = client.get("/v1/models").json()["data"][0]["id"]
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 0, "echo": True,
                                             "logprobs": 1, "user": sid})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    tokens = tok.tokens(pending + prompt)
    assert len(tokens) > len(tok.tokens(prompt))
    assert lp["tokens"] == [t if tok.encode(t)[0] >= 4 else tok.vocab[tok.encode(t)[0]] for t in tokens]
    starts = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))
    assert lp["text_offset"] == [max(0, s - len(pending)) for s in starts] and choice["text"] == prompt
    assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
    with client.stream("POST", "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "echo": True,
                                                        "logprobs": 1, "user": sid, "stream": True}) as stream:
        events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events and all("error" not in e for e in events)
    listed = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert listed[: len(tokens)] == lp["tokens"]


def test_pending_text_is_exported_imported_and_reset(client: httpx.Client, assert_error: Any) -> None:
    sid = new(client)
    observe(client, sid, "It was the be")
    blob = client.get(f"/v1/sessions/{sid}/state").content
    copy = "c" * 32
    r = client.put(f"/v1/sessions/{copy}/state", content=blob, headers={"content-type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    assert exported(client, copy)[1]["pending"] == base64.b64encode(b" be").decode()
    assert observe(client, copy, "st of")["bits"] == pytest.approx(observe(client, sid, "st of")["bits"], rel=1e-5)
    # a pending text that holds settled words is refused, as is a next token outside the vocabulary
    tensors, meta = load_tensors(blob), json.loads(_header_metadata(blob)["session"])
    header = _header_metadata(blob)
    for bad in ({"pending": base64.b64encode(b"two words").decode()}, {"pending": "not base64!"},
                {"last_token": 10**6}):
        forged = save_tensors(tensors, metadata={**header, "session": json.dumps({**meta, **bad})})
        r = client.put(f"/v1/sessions/{'d' * 32}/state", content=forged,
                       headers={"content-type": "application/octet-stream"})
        assert "pending" in assert_error(r, 422, "validation_error")["message"] or "last_token" in r.text
    assert client.post(f"/v1/sessions/{sid}/reset").status_code == 200
    assert "pending" not in exported(client, sid)[1]
    assert observe(client, sid, "st")["pending_bytes"] == 2  # "st" alone: a word at the start of the text


def test_pending_text_is_bounded(client: httpx.Client, tok: WordTokenizer) -> None:
    """Text with no space in it (a blob, Chinese or Japanese) stayed pending whole and grew with every observe, and
    every suggestion read all of it (a 3.6 MB prefix took 0.6 s on the shipped model): past PENDING_MAX_BYTES the
    pending word, <unk> whatever follows, is scored as it stands; a suggestion then starts a new word; an export with
    more pending (written before the bound) imports with the bound's start of it, and observes on as the session
    would have."""
    from server.engine._session import PENDING_MAX_BYTES

    sid = new(client)
    half = "x" * (PENDING_MAX_BYTES // 2 + 1)
    first = observe(client, sid, "Dear " + half)
    assert first["bytes"] == len("Dear") and first["pending_bytes"] == len(" " + half)
    second = observe(client, sid, half)
    assert second["pending_bytes"] == 0 and second["bytes"] == len(" " + half + half)
    assert second["tokens"] == 1 and tok.encode(" " + half + half) == [3]  # " <unk>"
    for _ in range(3):  # no space ever: it never holds more than the bound
        assert observe(client, sid, half)["pending_bytes"] <= PENDING_MAX_BYTES
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "ab"})
    assert r.status_code == 200 and len(r.json()["prefix"]) <= PENDING_MAX_BYTES + 2, r.text[:200]
    blob = client.get(f"/v1/sessions/{sid}/state").content
    tensors, meta = load_tensors(blob), json.loads(_header_metadata(blob)["session"])
    long = base64.b64encode(b" " + b"x" * PENDING_MAX_BYTES).decode()
    header = {**_header_metadata(blob), "session": json.dumps({**meta, "pending": long})}
    r = client.put(f"/v1/sessions/{'e' * 32}/state", content=save_tensors(tensors, metadata=header),
                   headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text[:300]
    after = observe(client, "e" * 32, "y is here")  # the long word ends: " <unk>", then " is", " here" pending
    assert after["tokens"] == 2 and after["bytes"] == PENDING_MAX_BYTES + len("y is")
    assert after["pending_bytes"] == len(" here")


def test_a_session_that_read_text_without_spaces_exports_and_imports(client: httpx.Client) -> None:
    """The session's word cache counted such text as one word, kept whole across observes and written into the export
    three times: past 1 MB of header the import refused the session's own export ("bad header"), and so would the
    Redis store and the snapshot. Its words are bounded (models/wordcache.py MAX_WORD_BYTES)."""
    sid = new(client)
    for _ in range(2):
        observe(client, sid, "x" * 400_000)
    observe(client, sid, " and then some words.\n")
    blob = client.get(f"/v1/sessions/{sid}/state").content
    assert len(blob) < 100_000 + len(client.get(f"/v1/sessions/{new(client)}/state").content)
    r = client.put(f"/v1/sessions/{'f' * 32}/state", content=blob, headers={"content-type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    suggested = client.post(f"/v1/sessions/{'f' * 32}/suggest", json={"context": "and th"}).json()
    assert suggested["prefix"] == "th"


def test_pending_text_survives_a_redis_round_trip(word_checkpoint: Path, serve_app: Any, redis_url: str) -> None:
    with serve_app(Settings(checkpoint=word_checkpoint, session_store=redis_url)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as c:
        sid = new(c)
        observe(c, sid, "It was the be")
        assert exported(c, sid)[1]["pending"] == base64.b64encode(b" be").decode()
        assert observe(c, sid, "st of")["bytes"] == len(" best")


def next_token_probs(word_checkpoint: Path, text: str) -> torch.Tensor:
    """(V,) the word model's next-token probabilities after `text` read from the stream's start: the library alone."""
    ckpt = load_checkpoint(word_checkpoint)
    ckpt.model.eval()
    tok = ckpt.tokenizer
    assert isinstance(tok, WordTokenizer)
    with torch.no_grad():
        ids = torch.tensor([[tok.bos, *tok.encode(text)]])
        return ckpt.model.log_probs(ckpt.model(ids, ckpt.model.init_state(1)))[0, -1].double().exp()


def library_next_word(word_checkpoint: Path, stable: str, prefix: str) -> list[tuple[str, float]]:
    """The next-word distribution after `stable` (from the stream's start), restricted to entries starting with
    `prefix`, specials left out, most probable first: computed with the library alone."""
    tok = load_checkpoint(word_checkpoint).tokenizer
    assert isinstance(tok, WordTokenizer)
    probs = next_token_probs(word_checkpoint, stable)
    entries = [(tok.vocab[i], float(probs[i])) for i in range(4, tok.vocab_size) if tok.vocab[i].startswith(prefix)]
    return sorted(entries, key=lambda e: -e[1])


def test_suggestions_are_the_next_words_with_the_typed_prefix(client: httpx.Client, word_checkpoint: Path) -> None:
    sid = new(client)
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "It was the b", "k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = library_next_word(word_checkpoint, "It was the", " b")
    typed = sum(p for _, p in expected)  # the probability that the next word starts with "b"
    assert body["prefix"] == "b" and len(body["completions"]) == 3
    assert [c["text"] for c in body["completions"]] == [w[1:] for w, _ in expected[:3]]
    # given the typed "b", as a byte model's completions are given the context that holds it
    assert [c["prob"] for c in body["completions"]] == pytest.approx([p / typed for _, p in expected[:3]], rel=1e-4)
    assert typed < 0.5 and sum(c["prob"] for c in body["completions"]) <= 1.0
    assert all(c["char"] and c["prob"] > 0 for c in body["next_chars"])
    # the session's pending text counts: " b" typed into the session, "e" in the context
    observe(client, sid, "It was the b")
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "e", "k": 10})
    assert r.status_code == 200, r.text
    words = [c["text"] for c in r.json()["completions"]]
    assert r.json()["prefix"] == "be" and words and all(w.startswith("be") for w in words)
    # no vocabulary word starts so: no completions
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "qqxz"})
    assert r.status_code == 200 and r.json()["completions"] == [] and r.json()["next_chars"] == []


def test_next_chars_count_the_typed_word_ending_by_what_follows_it(client: httpx.Client, word_checkpoint: Path,
                                                                   tok: WordTokenizer) -> None:
    """After " the" (itself a word, and the start of " they", " then", ...): the chance of each next character is
    that of the longer words going on with it, plus p(" the") times that of the next token starting with it; all
    given the typed " the" (divided by the mass of the words that start so)."""
    sid = new(client, adaptation={"cache_weight": 0.0})
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "It was the", "n_chars": 32})
    assert r.status_code == 200, r.text
    got = {c["char"]: c["prob"] for c in r.json()["next_chars"]}
    ckpt = load_checkpoint(word_checkpoint)
    ckpt.model.eval()
    with torch.no_grad():
        ids = torch.tensor([[tok.bos, *tok.encode("It was"), tok.encode(" the")[0]]])
        lp = ckpt.model.log_probs(ckpt.model(ids, ckpt.model.init_state(1)))[0].double()
    p_word, after = math.exp(float(lp[-2, ids[0, -1]])), lp[-1].exp()
    expected: dict[str, float] = {}
    entries = library_next_word(word_checkpoint, "It was", " the")
    typed = sum(p for _, p in entries)
    p_word /= typed
    for w, p in entries:
        if len(w) > 4:
            expected[w[4]] = expected.get(w[4], 0.0) + p / typed
    for i in range(tok.vocab_size):
        if i != 2:  # "<unk>" without a space: its first letter is unknown
            expected[tok.vocab[i][0]] = expected.get(tok.vocab[i][0], 0.0) + p_word * float(after[i])
    best = sorted(expected.items(), key=lambda cp: -cp[1])[:32]
    assert list(got) == [c for c, _ in best] and " " in got  # the word ending, then a space
    assert list(got.values()) == pytest.approx([p for _, p in best], rel=1e-4)


def test_the_word_cache_offers_a_typed_word_the_vocabulary_lacks(client: httpx.Client, tok: WordTokenizer) -> None:
    text = "Please ask Zyxquorra about it.\nZyxquorra will know.\n"
    assert tok.encode(" Zyxquorra")[0] == 3  # " <unk>": the model alone cannot spell it
    cached, plain = new(client, adaptation={"cache_weight": 0.5}), new(client, adaptation={"cache_weight": 0.0})
    for sid in (cached, plain):
        observe(client, sid, text)
    words = {}
    for sid in (cached, plain):
        r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "Then Zy", "k": 3})
        assert r.status_code == 200, r.text
        words[sid] = [c["text"] for c in r.json()["completions"]]
    assert words[cached][0] == "Zyxquorra" and "Zyxquorra" not in words[plain]
    # a word of the vocabulary the session used gains over the model's own ranking
    r = client.post(f"/v1/sessions/{cached}/suggest", json={"context": "Please a", "k": 3})
    assert r.json()["completions"][0]["text"] == "ask"


def test_a_word_typed_at_a_line_start_may_be_one_the_vocabulary_has_only_with_a_space(
        client: httpx.Client, word_checkpoint: Path, tok: WordTokenizer) -> None:
    """At a line's start the tokenizer writes a word that has only a spaced entry (" saw" but no "saw") as <unk>, so
    such words were never offered there. They share <unk>'s probability by their entries' frequency order
    (`WordTokenizer.unspaced`) and compete with the entries of their own, all given the typed letter."""
    stable = "It was.\n"
    probs = next_token_probs(word_checkpoint, stable)
    spaced, shares = tok.unspaced(b"")
    unspaced = {tok.vocab[i][1:]: float(probs[tok.unk]) * s for i, s in zip(spaced.tolist(), shares.tolist(),
                                                                            strict=True) if s > 0}

    def expected(letter: str) -> list[tuple[str, float]]:
        words = {w: float(probs[i]) for i, w in enumerate(tok.vocab) if i >= 4 and WORD.fullmatch(w)
                 and w.startswith(letter)}
        words.update({w: p for w, p in unspaced.items() if w.startswith(letter)})
        mass = sum(words.values()) + sum(float(probs[i]) for i, w in enumerate(tok.vocab) if i >= 4
                                         and w.startswith(letter) and not WORD.fullmatch(w))
        ranked = sorted(((w, p / mass) for w, p in words.items() if len(w) > 1), key=lambda wp: -wp[1])
        return [(w, p) for w, p in ranked if p >= 1e-3][:5]

    # a letter whose best words include one the vocabulary has only with a space
    letter = next(c for c in string.ascii_letters if any(w in unspaced for w, _ in expected(c)))
    sid = new(client, adaptation={"cache_weight": 0.0})
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": stable + letter, "k": 5, "n_chars": 32})
    assert r.status_code == 200, r.text
    body = r.json()
    best = expected(letter)
    assert [c["text"] for c in body["completions"]] == [w for w, _ in best]
    assert [c["prob"] for c in body["completions"]] == pytest.approx([p for _, p in best], rel=1e-4)
    chars = {c["char"]: c["prob"] for c in body["next_chars"]}  # and their next letters with them
    assert all(chars[w[1]] >= p * (1 - 1e-9) for w, p in best)
    # such a word typed whole may end there: the model reads it as <unk>, and what follows that starts with a space
    whole = next(w for w, _ in best if w in unspaced)
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": stable + whole, "n_chars": 32})
    assert r.status_code == 200 and " " in {c["char"] for c in r.json()["next_chars"]}, r.text


@pytest.mark.parametrize("context", ["Then Zy", "Then Zyxq", "Please a", "Please ask Zyxquorra ab", "Then ", "Then\nZy",
                                     "It was (g", "Please ask,", "It was ("])
def test_next_chars_go_on_with_the_completions_the_word_cache_offers(client: httpx.Client, context: str) -> None:
    """The next characters count the word cache's words as the completions do, mixed in at the same weight: each
    completion's next character is at least as likely as the completion. A word the vocabulary lacks had none at all
    (the model has only " <unk>" for it): now its letters, from the cache alone. After a mark, a completion offered
    after a space goes on with the space."""
    sid = new(client, adaptation={"cache_weight": 0.5})
    observe(client, sid, "Please ask Zyxquorra about it.\nZyxquorra will know.\n")
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": context, "k": 5, "n_chars": 32})
    assert r.status_code == 200, r.text
    body = r.json()
    chars = {c["char"]: c["prob"] for c in body["next_chars"]}
    assert body["completions"]
    for c in body["completions"]:
        first = " " if c["space_before"] else c["text"][len(body["prefix"])]
        assert chars.get(first, 0.0) >= c["prob"] * (1 - 1e-9), (c, chars)
    if context.startswith("Then Zy"):  # the one cached word that starts so: its next letter, as likely as it
        [word] = body["completions"]
        assert list(chars) == [word["text"][len(body["prefix"])]] and chars == pytest.approx({c: word["prob"]
                                                                                              for c in chars})


WORD = re.compile(r"\w+(?:['’]\w+)*")  # the tokenizer's words: what a keyboard may offer


@pytest.mark.parametrize("context", ["It was the end,", "It was so.", "He said (", "Then \U0001f600"])
def test_after_a_mark_the_next_word_may_come_after_a_space(client: httpx.Client, word_checkpoint: Path,
                                                          tok: WordTokenizer, context: str) -> None:
    """After a mark (nothing typed, the context ending in punctuation or a symbol) the words the tokenizer writes after
    a space (" there": what follows "Hi," in text) are offered as well as those without it, marked `space_before`,
    as a byte model's search offers them; each with its probability given nothing typed (the mass of every entry but
    the specials, and <unk>'s shared by the spaced words without an entry of their own, as at a line start)."""
    sid = new(client, adaptation={"cache_weight": 0.0})
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": context, "k": 10, "n_chars": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    probs = next_token_probs(word_checkpoint, context)
    spaced, shares = tok.unspaced(b"")
    words = {(w[1:], True): float(probs[i]) for i, w in enumerate(tok.vocab) if i >= 4 and w[0] == " "
             and WORD.fullmatch(w[1:])}
    words.update({(w, False): float(probs[i]) for i, w in enumerate(tok.vocab) if i >= 4 and WORD.fullmatch(w)})
    words.update({(tok.vocab[i][1:], False): float(probs[tok.unk]) * p
                  for i, p in zip(spaced.tolist(), shares.tolist(), strict=True) if p > 0})
    mass = float(probs[4:].sum() + probs[tok.unk])
    ranked = sorted(((key, p / mass) for key, p in words.items() if len(key[0]) <= 24), key=lambda kp: -kp[1])
    best = [(key, p) for key, p in ranked if p >= 1e-3][:10]
    assert body["prefix"] == "" and body["completions"]
    assert [(c["text"], c["space_before"]) for c in body["completions"]] == [key for key, _ in best]
    assert [c["prob"] for c in body["completions"]] == pytest.approx([p for _, p in best], rel=1e-4)
    if not context.endswith("("):  # the word after a comma, a full stop or an emoji: after a space (" the" ...)
        assert body["completions"][0]["space_before"], body
    # typed, or after a space: as before, the flag false
    for typed in (context + "th", context + " "):
        r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": typed, "k": 10})
        assert r.status_code == 200 and not any(c["space_before"] for c in r.json()["completions"]), r.text


@pytest.mark.parametrize("context", ["", "It was.\n", "It was the ", "It was the", "It was the b", "It was. ",
                                     "He said \"", "It was (", "It was,", "It is well  "])
def test_completions_are_whole_words_that_extend_the_typed_part(client: httpx.Client, context: str) -> None:
    """As the byte search's: each completion is a word (no space, no punctuation, not empty) that adds 1..max_chars
    characters to the prefix, with probability >= 0.001; after a punctuation mark the word being typed is empty.
    (The next-word distribution holds " " and "  " runs, punctuation, and after a newline " the": none is a word.)"""
    sid = new(client, adaptation={"cache_weight": 0.0})
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": context, "k": 10, "max_chars": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    expected_prefix = re.search(r"\w*$", context)
    assert body["prefix"] == (expected_prefix[0] if expected_prefix else "")
    for c in body["completions"]:
        assert WORD.fullmatch(c["text"]) and c["text"].startswith(body["prefix"]), (context, c)
        assert 1 <= len(c["text"]) - len(body["prefix"]) <= 3 and c["prob"] >= 1e-3, (context, c)
    if context in ("It was. ", "It was the "):
        assert body["completions"]  # the next word: some are that likely


def test_the_word_cache_completes_the_word_the_session_holds_pending(client: httpx.Client) -> None:
    """The word being typed is the session's pending text and the context together, for the word cache too: its
    words start with the prefix the model's do."""
    sid = new(client, adaptation={"cache_weight": 0.5})
    observe(client, sid, "Please ask Zyxquorra about it.\nThen Zy")  # " Zy" stays pending
    r = client.post(f"/v1/sessions/{sid}/suggest", json={"context": "", "k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prefix"] == "Zy"
    assert [c["text"] for c in body["completions"]][:1] == ["Zyxquorra"]
    assert all(c["text"].startswith("Zy") for c in body["completions"]), body


def test_the_keyboard_simulator_types_against_a_word_model(words_url: str, word_checkpoint: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`adaptlm keyboard-sim --url` types through word sessions and word completions; in-process (--checkpoint) it
    runs the byte search, so a word checkpoint there is a usage error (exit 2), not a traceback. The command is called
    in this process (its process, entry point and exit status are tested in tests/test_cli_keysim.py)."""
    from adaptlm.cli import main

    text = tmp_path / "messages.txt"
    text.write_text("She was not the first to come. She was the last.\n\nHe said it was so.\n", encoding="utf-8")
    base = ["keyboard-sim", "--text", str(text), "--json"]
    capsys.readouterr()
    assert main([*base, "--url", words_url, "--adapt"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["ksr"] < 1.0 and result["chars"] > 50
    # in this process too, the server's sessions (tests/server/test_one_session.py: the same keystrokes); full dynamic
    # evaluation of a word model is not simulated: one line, status 2
    assert main([*base, "--checkpoint", str(word_checkpoint), "--adapt"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["chars"] == result["chars"]
    with pytest.raises(SystemExit) as exited:
        main([*base, "--checkpoint", str(word_checkpoint), "--adapt", "--adapt-mode", "full"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "word model" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_generation_that_adapts_observes_the_text_as_typed(client: httpx.Client) -> None:
    """A prompt ending in a space, generated with adapt_while_generating: the session then observes the prompt and
    the continuation (the held-back space once, not again with the first word's): the bytes of their text."""
    sid = new(client)
    prompt = TEXT[:200].rsplit(" ", 1)[0] + " "
    r = client.post("/v1/generate", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "session_id": sid,
                                          "adapt_while_generating": True})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text and not text.startswith(" ")
    observe(client, sid, "\n")  # queued after the generation's adaptation; settles the pending word
    assert client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"] == len((prompt + text + "\n").encode())


@pytest.mark.parametrize("end", [" ", " thi"])  # token healing holds " " (or " thi") back and continues it as typed
def test_a_generation_that_adapts_observes_the_answer_without_its_stop_string(client: httpx.Client, end: str) -> None:
    """The session observes the prompt and the text the client received: a word token that completes a stop string
    was sampled whole (" deal" for the stop "e"), but neither the stop nor what the token adds past it is in the
    answer, so neither is observed."""
    prompt = TEXT[:200].rsplit(" ", 1)[0] + end
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    whole = client.post("/v1/generate", json={**body, "session_id": new(client)}).json()["text"]
    j = max(j for j in range(len(whole)) if whole.find(whole[j]) == j)  # the last character seen for the first time
    assert j > 0, whole
    sid = new(client)
    r = client.post("/v1/generate", json={**body, "stop": [whole[j]], "session_id": sid,
                                          "adapt_while_generating": True})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == whole[:j] and r.json()["finish_reason"] == "stop"
    observe(client, sid, "\n")  # queued after the generation's adaptation; settles the pending word
    observed = client.get(f"/v1/sessions/{sid}").json()["stats"]["bytes_observed"]
    assert observed == len((prompt + whole[:j] + "\n").encode())
