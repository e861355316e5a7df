"""The checkpoint's lexicon (models/lexicon.py): counting, the file and its CLI, and the dictionary prior's ranking."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from models.lexicon import LEXICON_FILE, LEXICON_PENALTY, Lexicon, count_words, write_lexicon
from models.suggest import Completion
from models.wordcache import WordCache, counted_words
from trainer.lexicon import main


def test_words_are_counted_as_the_word_cache_counts_them() -> None:
    text = "The cat's 'hat', the cat's hat\nthe end" + " x" * 3 + " " + "a" * 60
    assert count_words([text, "the"]) == Counter({"the": 3, "cat's": 2, "hat": 2, "The": 1, "end": 1, "x": 3})
    cache = WordCache()
    cache.observe(text + " ")
    assert Counter(cache.words) == count_words([text])  # the same split, the same counts
    assert list(counted_words("don't 'quote'")) == ["don't", "quote"]


def test_the_file_keeps_words_seen_min_count_times_most_frequent_first(tmp_path: Path) -> None:
    counts = Counter({"the": 5, "and": 5, "whale": 2, "Ahab": 2, "once": 1})
    assert write_lexicon(tmp_path / LEXICON_FILE, counts, min_count=2) == 4
    assert (tmp_path / LEXICON_FILE).read_text(encoding="utf-8").splitlines() == ["and", "the", "Ahab", "whale"]
    lexicon = Lexicon.read(tmp_path / LEXICON_FILE)
    assert lexicon.listed == 4
    assert lexicon.known("whale") and lexicon.known("Whale")  # a sentence start, as the word cache's `titled`
    assert lexicon.known("Ahab") and not lexicon.known("ahab") and not lexicon.known("once")


@pytest.mark.parametrize("content", [b"one\ntwo words\n", b"caf\xe9\n", b"a,b\n"])
def test_a_file_that_is_no_word_list_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / LEXICON_FILE).write_bytes(content)
    with pytest.raises(ValueError):
        Lexicon.read(tmp_path / LEXICON_FILE)


def test_the_cli_builds_the_lexicon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("the whale, the sea; the whale\n", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"sea caf\xe9 caf\xe9\n")  # Latin-1: the word is cut at the byte
    out = tmp_path / "ck"
    out.mkdir()
    assert main(["--data", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out", str(out)]) == 0
    assert (out / LEXICON_FILE).read_text(encoding="utf-8").splitlines() == ["the", "caf", "sea", "whale"]
    assert "4 words" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "not a directory", "no word twice", "min count 0"])
def test_the_cli_refuses_bad_input_with_exit_2(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "a.txt"
    data.write_text("every word once\n", encoding="utf-8")
    out = tmp_path / "ck"
    out.mkdir()
    args = {"missing": ["--data", str(tmp_path / "nope.txt"), "--out", str(out)],
            "not a directory": ["--data", str(data), "--out", str(data)],
            "no word twice": ["--data", str(data), "--out", str(out)],
            "min count 0": ["--data", str(data), "--out", str(out), "--min-count", "0"]}[case]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert not (out / LEXICON_FILE).exists()
    (out / LEXICON_FILE).write_text("whale\n", encoding="utf-8")  # a lexicon already there: a refusal keeps it
    with pytest.raises(SystemExit):
        main(args)
    assert (out / LEXICON_FILE).read_text(encoding="utf-8") == "whale\n"


def test_a_fragment_is_demoted_below_a_word_and_a_session_word_is_kept() -> None:
    lexicon = Lexicon.of(["work", "world"])
    cache = WordCache()
    cache.observe("wozniak said ")  # typed in lowercase by the session: "Wozniak" counts as known
    completions = [Completion("wor", 0.30), Completion("Wozniak", 0.25), Completion("work", 0.20),
                   Completion("world", 0.02), Completion("wo2", 0.01)]
    ranked = lexicon.rank(completions, 3, cache)
    assert [c.text for c in ranked] == ["Wozniak", "work", "wor"]  # 0.25, 0.20, then 0.30 x 0.1 > 0.02
    assert {c.text: c.prob for c in ranked} == {"Wozniak": 0.25, "work": 0.20, "wor": 0.30}  # probs as given
    assert LEXICON_PENALTY == 0.1
    assert [c.text for c in lexicon.rank(completions, 3)] == ["work", "wor", "Wozniak"]  # no cache: unknown
    # a fragment far more probable than any word keeps its place
    assert lexicon.rank([Completion("wor", 0.9), Completion("work", 0.05)], 1)[0].text == "wor"


def test_the_word_cache_mix_ranks_under_the_lexicon() -> None:
    cache = WordCache()
    cache.observe("we met wozniak at work ")
    model = [Completion("wor", 0.4), Completion("world", 0.1), Completion("wozz", 0.05)]
    plain = cache.mix(model, "hello wo", 0.5, 3, 24)
    ranked = cache.mix(model, "hello wo", 0.5, 3, 24, Lexicon.of(["world"]))
    assert plain[0].text == "wor" and ranked[0].text != "wor"
    assert {c.text: c.prob for c in ranked}.items() <= {c.text: c.prob for c in cache.mix(model, "hello wo", 0.5, 9,
                                                                                            24)}.items()
    # cache weight 0: the model's completions alone, ranked under the lexicon all the same
    assert [c.text for c in cache.mix(model, "hello wo", 0.0, 2, 24, Lexicon.of(["world"]))] == ["world", "wor"]


def test_a_word_with_a_capital_inside_is_not_capitalised() -> None:
    """As the word cache's `titled` reads it: "iPhone" at a sentence start stays "iPhone"."""
    lexicon = Lexicon.of(["iPhone", "life"])
    cache = WordCache()
    cache.observe("eBay and love ")
    assert lexicon.known("Life") and lexicon.known("iPhone") and not lexicon.known("IPhone")
    assert cache.has("Love") and cache.has("eBay") and not cache.has("EBay")
