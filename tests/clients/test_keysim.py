"""The keystroke-savings simulator (adaptlm_client.keysim): its accounting against a hand computation with a scripted
suggester, the text selection helpers, and a server session as the suggester (the SDK, and `adaptlm keyboard-sim
--url` as a user runs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from adaptlm.cli import main
from adaptlm_client import Client, NotFoundError, SuggestedWord, SuggestResponse
from adaptlm_client.keysim import (
    KeysimResult,
    SessionSuggester,
    messages,
    simulate,
    split_text,
    split_words,
    type_message,
)
from tests.clients.conftest import LiveServer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


class Scripted:
    """Suggests what `script` says for a context (nothing otherwise); records every call."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = script
        self.calls: list[tuple[str, int]] = []
        self.observed: list[str] = []

    def suggest(self, context: str, k: int) -> Sequence[str]:
        self.calls.append((context, k))
        return self.script.get(context, [])[:k]

    def observe(self, text: str) -> None:
        self.observed.append(text)


SCRIPT = {
    "": ["the", "a", "it"],  # message 1, word "the" before any key: top-1
    "the ": ["dog", "man", "cat"],  # "cat": third
    "the cat ": ["ran", "is", "was"],  # "sat": not offered ...
    "the cat s": ["sat", "sits"],  # ... until its first letter is typed
    "I": ["I'll", "It"],
    "I'": ["I'm", "I've"],
    "I'm o": ["on"],
    "I'm of": ["off", "often"],
}
TEXTS = ["the cat sat.\n", "I'm off\n", "ok\n"]


def test_ksr_and_next_word_accuracy_by_hand() -> None:
    # message 1, "the cat sat.\n" (13 characters):
    #   ""          -> the, a, it: "the" is top-1 (top-1 and top-3 hits); 1 selection, the space after it is free
    #   "the "      -> dog, man, cat: "cat" third (top-3 hit only); 1 selection, space free
    #   "the cat "  -> ran, is, was: miss; type "s" (1 key)
    #   "the cat s" -> sat: 1 selection; the next character is "." (not a space): type ".", "\n" (2 keys)
    #   typed 3, selections 3
    # message 2, "I'm off\n" (8 characters):
    #   "" -> the, a, it: miss (the scripted "" is shared: neither top-1 nor top-3); type "I"
    #   "I" -> I'll, It: miss; type "'"
    #   "I'" -> I'm: 1 selection, the space after it is free
    #   "I'm " -> nothing; type "o"; "I'm o" -> on: type "f"; "I'm of" -> off: 1 selection; type "\n"
    #   typed 5 (I ' o f \n), selections 2
    # message 3, "ok\n" (3 characters): "" -> miss, "o" -> nothing: type o, k, \n: typed 3, never offered
    # KSR = 1 - (3 + 5 + 3 + 3 + 2) / (13 + 8 + 3) = 1 - 16 / 24 = 1/3
    # next word: 6 words; top-1: "the" only -> 1/6; top-3: "the", "cat" -> 2/6
    fake = Scripted(SCRIPT)
    result = simulate(fake, TEXTS, k=3, warmup=["earlier\n"])
    assert (result.chars, result.typed, result.selections) == (24, 11, 5)
    assert result.ksr == pytest.approx(1 / 3)
    assert (result.words, result.top1, result.top3) == (6, 1, 2)
    summary = result.summary()
    assert summary["ksr"] == pytest.approx(1 / 3)
    assert summary["top1_accuracy"] == pytest.approx(1 / 6) and summary["top3_accuracy"] == pytest.approx(2 / 6)
    # one query before each word and after each typed character of it but its last, until it is taken
    assert [c for c, _ in fake.calls] == ["", "the ", "the cat ", "the cat s",
                                          "", "I", "I'", "I'm ", "I'm o", "I'm of", "", "o"]
    assert summary["suggest_calls"] == 12 and summary["suggest_ms_p99"] >= summary["suggest_ms_p50"] >= 0
    # the warm-up first, then each message when it is finished
    assert fake.observed == ["earlier\n", *TEXTS]
    assert result.observed_chars == 8 + 24 and result.messages == 3


def test_one_suggestion_takes_only_the_first_but_top3_is_still_measured() -> None:
    # k = 1: "the" is still taken ("" -> the), "cat" is not ("the " -> dog), the query before a word asks for 3
    # message 1: the(sel, space free) c a t(typed 3: "c" gets no script -> "the c" unscripted, "the ca" too)
    #   " " typed, then "sat": "the cat " -> ran: typed "s"; "the cat s" -> sat: selected; ".\n" typed
    #   typed 3 + 1 + 1 + 2 = 7, selections 2; KSR = 1 - 9 / 13
    fake = Scripted(SCRIPT)
    result = simulate(fake, TEXTS[:1], k=1)
    assert (result.typed, result.selections, result.chars) == (7, 2, 13)
    assert result.ksr == pytest.approx(1 - 9 / 13)
    assert (result.top1, result.top3) == (1, 2)
    assert [k for c, k in fake.calls if c in ("", "the ", "the cat ")] == [3, 3, 3]
    assert [k for c, k in fake.calls if c not in ("", "the ", "the cat ")] == [1, 1, 1]


def test_a_selection_before_punctuation_saves_only_the_rest_of_the_word() -> None:
    # "go\n": "" -> nothing: type "g"; "g" -> go: 1 selection; the next character is "\n", typed
    # typed 2, selections 1, characters 3: KSR = 1 - 3 / 3 = 0 (taking "go" saved "o" and cost the selection)
    fake = Scripted({"g": ["go"]})
    result = KeysimResult()
    type_message(fake, "go\n", 3, result)
    assert (result.typed, result.selections, result.chars) == (2, 1, 3)
    assert result.ksr == 0.0
    assert fake.observed == []  # type_message types only; simulate observes


def test_a_word_offered_after_a_space_is_not_the_word_after_the_mark() -> None:
    """After "(" the typist wants "the" glued to it; a " the" the keyboard would insert after a space (`space_before`,
    given with its space) is no match, and counts as a slot of the bar."""
    fake = Scripted({"(": [" the", "a", "the"]})
    result = KeysimResult()
    type_message(fake, "(the)\n", 2, result)
    assert (result.top1, result.top3, result.selections) == (0, 1, 0)  # "the" third: not among the k = 2 shown
    session = SessionSuggester.__new__(SessionSuggester)  # the SDK's answer, mapped: the space before, as inserted

    class Answer:
        def suggest(self, context: str, **_: object) -> SuggestResponse:
            words = [SuggestedWord(text="there", prob=0.5, space_before=True), SuggestedWord(text="a", prob=0.1)]
            return SuggestResponse(prefix="", completions=words, next_chars=[])

    session.session, session.max_chars = Answer(), None  # type: ignore[assignment]
    assert session.suggest("Hi,", 3) == [" there", "a"]


def test_words_and_messages() -> None:
    assert split_words("I'm don't 'tis") == [(0, 3), (4, 9), (11, 14)]  # an opening apostrophe is not predicted
    assert split_words("-- 42, ’quote’ x") == [(3, 5), (8, 14), (15, 16)]
    assert messages("a b\n\nc") == ["a b\n", "\n", "c"]
    long = "word " * 300 + "\n"
    pieces = messages(long, max_chars=100)
    assert "".join(pieces) == long and all(len(p) <= 100 for p in pieces)
    assert all(p.endswith(" ") for p in pieces[:-1])


def test_split_text_measures_the_last_bytes_from_a_line_start() -> None:
    data = b"one\ntwo\nthree\nfour\n"
    assert split_text(data) == ("", data.decode())
    assert split_text(data, last_bytes=8) == ("one\ntwo\nthree\n", "four\n")  # 8 bytes start inside "three"
    assert split_text(data, last_bytes=11) == ("one\ntwo\n", "three\nfour\n")  # on a line start
    assert split_text(data, last_bytes=11, warmup_bytes=5) == ("two\n", "three\nfour\n")
    assert split_text(data, last_bytes=11, warmup_bytes=0) == ("", "three\nfour\n")
    assert split_text(data, last_bytes=11, limit_bytes=8) == ("one\ntwo\n", "three\n")
    assert split_text(data, limit_bytes=2) == ("", "one\n")  # at least one whole line
    assert split_text("é\nà\n".encode(), last_bytes=3) == ("é\n", "à\n")


def test_a_session_as_the_suggester(live: LiveServer, client: Client) -> None:
    text = (DATA / "valid.txt").read_text(encoding="utf-8")[:200]
    with SessionSuggester(client, lr=0.0) as static:
        assert static.session.info is not None and static.session.info.adaptation.lr == 0.0
        # what the simulator asks is what the route answers
        direct = client.suggest(static.session.id, "It is a tr", k=3, n_chars=0)
        assert static.suggest("It is a tr", 3) == [w.text for w in direct.completions]
        result = simulate(static, messages(text), k=3)
        sid = static.session.id
        assert client.get_session(sid).stats.bytes_observed == len(text.encode())
    with pytest.raises(NotFoundError):
        client.get_session(sid)  # deleted at the end of the block
    summary = result.summary()
    assert 0 <= summary["ksr"] < 1 and 0 <= summary["top1_accuracy"] <= summary["top3_accuracy"] <= 1
    assert summary["suggest_calls"] >= summary["words"] > 20


def test_keyboard_sim_against_a_server(live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes((DATA / "valid.txt").read_bytes()[:1500])
    last = 230  # from a line start: 203 bytes typed
    runs = {}
    for adapt in ("--no-adapt", "--adapt"):
        args = ["keyboard-sim", "--text", str(path), "--url", live.url, "--last-bytes", str(last), "--warmup-bytes",
                "300", adapt, "--json"]
        if adapt == "--adapt":  # as a user runs it: the command's own process
            r = subprocess.run([sys.executable, "-m", "adaptlm", *args], capture_output=True, cwd=ROOT, timeout=300,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
            assert r.returncode == 0, r.stderr.decode()
            stdout = r.stdout.decode()
        else:  # the same command in this process
            capsys.readouterr()
            assert main(args) == 0, capsys.readouterr().err
            stdout = capsys.readouterr().out
        runs[adapt] = out = json.loads(stdout)
        assert out["url"] == live.url and out["suggestions"] == 3
        assert last - 100 <= out["measured_bytes"] <= last and out["warmup_bytes"] <= 300
        assert out["chars"] == out["measured_bytes"]  # this text is ASCII
        assert out["observed_chars"] == out["measured_bytes"] + out["warmup_bytes"]
        assert 0 <= out["ksr"] < 1 and out["typed"] + out["selections"] <= out["chars"]
        assert 0 <= out["top1_accuracy"] <= out["top3_accuracy"] <= 1
        assert out["suggest_ms_p99"] >= out["suggest_ms_p50"] > 0
    assert runs["--no-adapt"]["adaptation"] == "static" and runs["--adapt"]["adaptation"] == "sparse"
    assert runs["--no-adapt"]["lr"] == 0.0 and runs["--no-adapt"]["cache_weight"] == 0.0  # the model alone
    assert runs["--adapt"]["lr"] > 0
    # the same text was typed both times
    assert runs["--no-adapt"]["words"] == runs["--adapt"]["words"]
