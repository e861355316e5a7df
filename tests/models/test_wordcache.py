"""The session word cache: counting words and pairs across observed texts, p_cache by hand, mixing with the
model's completions, bounds, serialisation."""

from __future__ import annotations

import json

import pytest

from models.suggest import Completion
from models.wordcache import WordCache, mix_completions, previous_word


def test_counts_words_and_pairs_across_texts() -> None:
    cache = WordCache()
    cache.observe("the meter at hpl. the met")  # "met" may go on: held
    assert cache.words == {"the": 2, "meter": 1, "at": 1, "hpl": 1}
    assert cache.pairs == {"the\tmeter": 1, "meter\tat": 1, "at\thpl": 1}  # no pair across the full stop
    assert cache.pending == "met"
    cache.observe("er reads 'ok'\nnew line")
    assert cache.words["meter"] == 2 and cache.words["ok"] == 1 and "met" not in cache.words
    assert cache.pairs["the\tmeter"] == 2 and cache.pairs["meter\treads"] == 1
    assert "ok\tnew" not in cache.pairs and cache.words["new"] == 1  # no pair across the line break
    assert cache.pending == "line" and "line" not in cache.words and "new\tline" not in cache.pairs
    cache.observe(" ends")
    assert cache.words["line"] == 1 and cache.pairs["new\tline"] == 1 and cache.pending == "ends"


def test_p_cache_by_hand() -> None:
    cache = WordCache()
    cache.observe("hpl meter. hpl meter. hpl method. the metal. ")
    # words extending "met": meter 2, method 1, metal 1 -> p_uni = 1/2, 1/4, 1/4
    assert cache.candidates("met", None, 24) == pytest.approx({"meter": 0.5, "method": 0.25, "metal": 0.25})
    # after "hpl": pairs meter 2, method 1, metal 0 (3 in all): (c + p_uni) / (3 + 1)
    assert cache.candidates("met", "hpl", 24) == pytest.approx(
        {"meter": (2 + 0.5) / 4, "method": (1 + 0.25) / 4, "metal": 0.25 / 4})
    assert sum(cache.candidates("met", "hpl", 24).values()) == pytest.approx(1.0)
    assert cache.candidates("met", "unknown", 24) == pytest.approx(cache.candidates("met", None, 24))
    assert cache.candidates("meter", None, 24) == {}  # a completion adds at least one character
    assert set(cache.candidates("m", None, 4)) == {"meter", "metal"}  # at most max_chars added
    assert cache.candidates("x", None, 24) == {}


def test_previous_word() -> None:
    assert previous_word("see the hpl ") == "hpl"
    assert previous_word("see the hpl  ") == "hpl"
    assert previous_word("see the hpl. ") is None
    assert previous_word("") is None and previous_word("hpl\n") is None


def test_mixing() -> None:
    model = [Completion("meter", 0.4), Completion("metro", 0.3), Completion("metal", 0.1)]
    cached = {"method": 0.9, "metal": 0.1}
    mixed = mix_completions(model, cached, 0.5, 3)
    assert [c.text for c in mixed] == ["method", "meter", "metro"]
    assert [c.prob for c in mixed] == pytest.approx([0.45, 0.2, 0.15])
    assert mix_completions(model, {}, 0.5, 2) == model[:2]  # nothing cached: the model alone
    assert mix_completions(model, cached, 0.0, 3) == model


def test_bounded_and_serialised() -> None:
    cache = WordCache(max_words=8)
    cache.observe(" ".join(f"w{i}" for i in range(20)) + " w1 w1 w2 ")
    assert len(cache.words) <= 8 and cache.words["w1"] == 3 and cache.words["w2"] == 2
    again = WordCache.from_dict(json.loads(json.dumps(cache.to_dict())), max_words=8)
    assert again.to_dict() == cache.to_dict()
    assert again.candidates("w", None, 24) == cache.candidates("w", None, 24)
    for bad in ({"words": {"a": -1}}, {"words": {"a": True}}, {"words": []}, {"pairs": {"a\tb": 1.5}},
                {"last": 3}, {"pending": None}):
        with pytest.raises(ValueError):
            WordCache.from_dict(bad)


def test_a_cache_that_is_not_an_object_is_refused() -> None:
    """Session blobs are user input: a list or a string where the cache's object belongs is a ValueError (the
    import answers 422), not an AttributeError (a 500)."""
    for bad in (["x"], "x", 3, None):
        with pytest.raises(ValueError):
            WordCache.from_dict(bad)  # type: ignore[arg-type]
