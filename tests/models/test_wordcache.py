"""The session word cache: counting words, pairs, triples and recent words across observed texts, p_cache and its
confidence by hand, the orders and recency ranking as the evidence says, mixing with the model's completions
(the unigram fallback no longer outranks the model), bounds, serialisation (the old format included)."""

from __future__ import annotations

import json

import pytest

from models.suggest import Completion
from models.wordcache import (
    GAMMA,
    MAX_WORD_BYTES,
    MIX_CANDIDATES,
    WordCache,
    mix_completions,
    previous_word,
    previous_words,
)


def test_counts_words_pairs_and_triples_across_texts() -> None:
    cache = WordCache()
    cache.observe("the meter at hpl. the met")  # "met" may go on: held
    assert cache.words == {"the": 2, "meter": 1, "at": 1, "hpl": 1}
    assert cache.pairs == {"the\tmeter": 1, "meter\tat": 1, "at\thpl": 1}  # no pair across the full stop
    assert cache.triples == {"the\tmeter\tat": 1, "meter\tat\thpl": 1}
    assert cache.recent == ["the", "meter", "at", "hpl", "the"] and cache.pending == "met"
    cache.observe("er reads 'ok'\nnew line")
    assert cache.words["meter"] == 2 and cache.words["ok"] == 1 and "met" not in cache.words
    assert cache.pairs["the\tmeter"] == 2 and cache.pairs["meter\treads"] == 1
    assert cache.triples["the\tmeter\treads"] == 1 and cache.triples["meter\treads\tok"] == 1
    assert "ok\tnew" not in cache.pairs and cache.words["new"] == 1  # no pair across the line break
    assert not any(key.startswith(("reads\tok\t", "ok\tnew")) for key in cache.triples)
    assert cache.pending == "line" and "line" not in cache.words and "new\tline" not in cache.pairs
    cache.observe(" ends")
    assert cache.words["line"] == 1 and cache.pairs["new\tline"] == 1 and cache.pending == "ends"
    assert cache.recent[-3:] == ["ok", "new", "line"] and (cache.before_last, cache.last) == ("new", "line")
    cache.observe(" here, now")
    assert cache.triples["new\tline\tends"] == 1 and cache.triples["line\tends\there"] == 1
    assert "ends\there\tnow" not in cache.triples and cache.pairs.get("here\tnow") is None


def test_p_cache_and_confidence_by_hand() -> None:
    cache = WordCache(max_recent=0)  # no recency: the unigram level is the frequencies alone
    cache.observe("hpl meter. hpl meter. hpl method. the metal. ")
    # words extending "met": meter 2, method 1, metal 1 (4 in all, 3 kinds): m1 = 4 / (4 + 3)
    m1 = 4 / 7
    p, conf = cache.estimate("met", None, 24)
    assert p == pytest.approx({"meter": 0.5, "method": 0.25, "metal": 0.25}) and conf == pytest.approx(GAMMA * m1)
    # after "hpl": pairs meter 2, method 1 (3 in all, 2 kinds): m2 = 3 / 5, q2 = 2/3, 1/3, 0
    m2 = 3 / 5
    conf2 = m2 + (1 - m2) * GAMMA * m1
    s = {"meter": m2 * 2 / 3 + (1 - m2) * GAMMA * m1 * 0.5, "method": m2 / 3 + (1 - m2) * GAMMA * m1 * 0.25,
         "metal": (1 - m2) * GAMMA * m1 * 0.25}
    p, conf = cache.estimate("met", "hpl", 24)
    assert conf == pytest.approx(conf2) and p == pytest.approx({w: v / conf2 for w, v in s.items()})
    assert sum(p.values()) == pytest.approx(1.0) and cache.candidates("met", "hpl", 24) == p
    assert cache.estimate("met", "unknown", 24) == cache.estimate("met", None, 24)  # an unseen context: unigram
    assert cache.estimate("met", "hpl", 24, earlier="x") == cache.estimate("met", "hpl", 24)  # unseen triple
    assert cache.candidates("meter", None, 24) == {}  # a completion adds at least one character
    assert set(cache.candidates("m", None, 4)) == {"meter", "metal"}  # at most max_chars added
    assert cache.estimate("x", None, 24) == ({}, 0.0)
    # a triple: "see hpl" once, followed by metal
    cache.observe("see hpl metal. ")
    m1, m2, m3 = 5 / 8, 4 / 7, 1 / 2  # words: meter 2, method 1, metal 2; after hpl: 2, 1, 1; after see hpl: metal 1
    conf3 = m3 + (1 - m3) * (m2 + (1 - m2) * GAMMA * m1)
    p, conf = cache.estimate("met", "hpl", 24, earlier="see")
    assert conf == pytest.approx(conf3)
    assert p["metal"] == pytest.approx((m3 + (1 - m3) * (m2 / 4 + (1 - m2) * GAMMA * m1 * 2 / 5)) / conf3)


def test_trigram_beats_bigram_beats_unigram_when_evidence_says_so() -> None:
    cache = WordCache()
    cache.observe("see the report. see the report. send the file. send the file. send the file. ")
    # words: the 5, file 3, send 3, report 2, see 2; after "the": file 3, report 2; after "see the": report 2
    def top(previous: str | None, earlier: str | None = None) -> str:
        p = cache.candidates("", previous, 24, earlier)
        return max(p, key=lambda w: p[w])
    assert top(None) == top("unseen") == "the"  # no context seen: the most frequent word
    assert top("the") == top("the", earlier="unseen") == "file"  # the bigram
    assert top("the", earlier="see") == "report"  # the trigram
    tri, bi, uni = (cache.estimate("", "the", 24, "see")[1], cache.estimate("", "the", 24)[1],
                    cache.estimate("", None, 24)[1])
    assert 1 > tri > bi > 0.5 > GAMMA >= uni > 0  # more evidence, more weight against the model
    # a pair seen many times weighs nearly the whole weight; seen once, about half
    once, many = WordCache(), WordCache()
    once.observe("the report. ")
    for _ in range(20):
        many.observe("the report. ")
    assert once.estimate("", "the", 24)[1] == pytest.approx(0.5 + 0.5 * GAMMA * 0.5)
    assert many.estimate("", "the", 24)[1] > 0.95


def test_recency_ranks_a_recent_word_above_an_older_one_of_equal_counts() -> None:
    filler = " ".join(f"w{i}" for i in range(40))
    for first, second in (("apple", "apricot"), ("apricot", "apple")):
        cache = WordCache()
        cache.observe(f"{first} {filler} {second} ")
        p = cache.candidates("ap", None, 24)
        assert cache.words[first] == cache.words[second] == 1 and p[second] > p[first]
    cache = WordCache(max_recent=8)  # bounded: only the last 8 words
    cache.observe(f"apple {filler} apricot ")
    assert cache.recent == [f"w{i}" for i in range(33, 40)] + ["apricot"]
    p = cache.candidates("ap", None, 24)
    assert p["apricot"] > p["apple"]


def test_the_unigram_fallback_does_not_outrank_the_models_words() -> None:
    """Issue 15: after "Thank you for the report. ", typing "I will send you the " offered "report", "Thank", "for":
    the words' own frequencies, mixed in at a fixed 0.5, beat every word the model expected after "the"."""
    model = [Completion("report", 0.02), Completion("best", 0.05), Completion("file", 0.04), Completion("same", 0.03)]
    cache = WordCache()
    cache.observe("Thank you for the report. ")
    mixed = cache.mix(model, "I will send you the ", 0.5, 3, 24)
    assert not {"Thank", "for"} & {c.text for c in mixed}
    assert [c.text for c in mixed] == ["report", "best", "file"]  # "report" was seen after "the"
    p, conf = cache.estimate("", "the", 24, earlier="you")
    assert mixed == mix_completions(model, p, 0.5 * conf, 3) and conf < 1
    # no cached pair: the cache weighs at most GAMMA of the weight and the model's order stands
    mixed = cache.mix(model, "I will send you a ", 0.5, 3, 24)
    assert cache.estimate("", "a", 24)[1] <= GAMMA
    assert [c.text for c in mixed] == ["best", "file", "report"]  # "report" from 0.02 to above "same" (recent)
    assert cache.mix(model, "I will send you the ", 0.0, 2, 24) == model[:2]  # weight 0: the model alone


def test_a_capitalised_prefix_finds_the_words_typed_in_lowercase() -> None:
    """A word the session typed in lowercase, typed again with a capital first letter (a sentence start, an SMS
    written "Life is good"), is offered from that first letter, capitalised, with the counts of both forms; a
    prefix in other capitals reads the words as typed."""
    cache = WordCache()
    cache.observe("i love life. life is good. my life is mine. Life goes on. the lamp is on\n")
    p, conf = cache.estimate("L", None, 24)
    assert set(p) == {"Life", "Love", "Lamp"} and p["Life"] > 0.5  # "life" 3 + "Life" 1 against 1 each
    lower, lower_conf = cache.estimate("l", None, 24)
    assert set(lower) == {"life", "love", "lamp"} and "Life" not in lower
    # the context counts as it did: "life" followed "love", so "Life" follows "love" alike
    after = cache.candidates("L", "love", 24)
    assert after["Life"] == pytest.approx(cache.candidates("l", "love", 24)["life"], rel=0.05)
    assert cache.estimate("I", None, 24)[0].keys() == {"Is"}  # "is" typed as "Is"; "i" adds nothing to "I"
    assert cache.estimate("LI", None, 24) == ({}, 0.0)  # other capitals: as typed (none)
    cache.observe("LIFE\n")
    assert set(cache.estimate("LI", None, 24)[0]) == {"LIFE"} and "Life" in cache.estimate("Li", None, 24)[0]
    # derived: a new observe is seen by the next estimate
    cache.observe("lantern\n")
    assert "Lantern" in cache.estimate("La", None, 24)[0]
    assert cache.titled().titled() is cache.titled()


def test_the_mix_reads_more_of_the_models_words_than_it_shows() -> None:
    """A word the session typed after this context that the model ranks 4th: mixed with the model's 3 best its
    probability under the model counts 0, and a cached word the model does not expect beats it; with the model's
    MIX_CANDIDATES best it keeps its own and is shown."""
    model = [Completion("apple", 0.30), Completion("best", 0.25), Completion("file", 0.20),
             Completion("report", 0.15), Completion("same", 0.05)]
    cache = WordCache()
    cache.observe("the report. the zebra. the zebra. ")
    shown = [c.text for c in cache.mix(model[:3], "see the ", 0.5, 3, 24)]
    wide = [c.text for c in cache.mix(model[:MIX_CANDIDATES], "see the ", 0.5, 3, 24)]
    assert MIX_CANDIDATES > 3 and "report" not in shown and "zebra" in shown
    assert "report" in wide and "zebra" in wide


def test_previous_words() -> None:
    assert previous_word("see the hpl ") == "hpl" and previous_words("see the hpl ") == ("the", "hpl")
    assert previous_words("see the hpl  ") == ("the", "hpl")
    assert previous_words("see. hpl ") == (None, "hpl") and previous_words("hpl ") == (None, "hpl")
    assert previous_word("see the hpl. ") is None and previous_words("see the hpl. ") == (None, None)
    assert previous_word("") is None and previous_word("hpl\n") is None and previous_words("hpl") == (None, None)


def test_mixing() -> None:
    model = [Completion("meter", 0.4), Completion("metro", 0.3), Completion("metal", 0.1)]
    cached = {"method": 0.9, "metal": 0.1}
    mixed = mix_completions(model, cached, 0.5, 3)
    assert [c.text for c in mixed] == ["method", "meter", "metro"]
    assert [c.prob for c in mixed] == pytest.approx([0.45, 0.2, 0.15])
    assert mix_completions(model, {}, 0.5, 2) == model[:2]  # nothing cached: the model alone
    assert mix_completions(model, cached, 0.0, 3) == model


def test_after_a_mark_a_cached_word_begins_where_the_model_says() -> None:
    """After a mark the model's completions are of two kinds (directly, after a space); a cached word is offered in
    both, p_cache split by the model's odds of the space, so its total weight is the one it had; the same word in the
    model's two kinds stays two completions. No space share: all direct, as before."""
    model = [Completion("there", 0.30, True), Completion("the", 0.10, True), Completion("the", 0.02)]
    cached = {"there": 0.5, "zorblax": 0.5}
    mixed = mix_completions(model, cached, 0.5, 6, space=0.9)
    got = {(c.text, c.space_before): c.prob for c in mixed}
    assert got == pytest.approx({("there", True): 0.15 + 0.5 * 0.9 * 0.5, ("zorblax", True): 0.5 * 0.9 * 0.5,
                                 ("the", True): 0.05, ("zorblax", False): 0.5 * 0.1 * 0.5,
                                 ("there", False): 0.5 * 0.1 * 0.5, ("the", False): 0.01})
    assert [(c.text, c.space_before) for c in mixed[:3]] == [("there", True), ("zorblax", True), ("the", True)]
    assert sum(got.values()) == pytest.approx(0.5 * 0.42 + 0.5)
    # the model sure of the space ("Hi,"): cached words only after it; sure it is not ("("): only directly
    assert all(c.space_before for c in mix_completions(model[:2], cached, 0.5, 9, space=1.0))
    assert not any(c.space_before for c in mix_completions(model[2:], cached, 0.5, 9, space=0.0))
    # through the cache: after "Hi," its unigram level (punctuation starts afresh), split the same way
    cache = WordCache()
    cache.observe("there we go. there it is. ")
    p, conf = cache.estimate("", None, 24)
    assert cache.mix(model, "Hi,", 0.5, 4, 24, space=0.9) == mix_completions(model, p, 0.5 * conf, 4, space=0.9)
    assert not any(c.space_before for c in cache.mix(model[2:], "Hi,", 0.5, 4, 24))


def test_bounded_and_serialised() -> None:
    cache = WordCache(max_words=8, max_recent=16)
    cache.observe(" ".join(f"w{i}" for i in range(20)) + " w1 w1 w2 w1 w1 w2 ")
    assert len(cache.words) <= 8 and cache.words["w1"] == 5 and cache.words["w2"] == 3
    assert len(cache.pairs) <= 8 and cache.pairs["w1\tw1"] == 2 and len(cache.triples) <= 8
    assert cache.triples["w1\tw1\tw2"] == 2 and len(cache.recent) == 16
    again = WordCache.from_dict(json.loads(json.dumps(cache.to_dict())), max_words=8, max_recent=16)
    assert again.to_dict() == cache.to_dict() and again.copy().to_dict() == cache.to_dict()
    assert again.estimate("w", "w1", 24, earlier="w1") == cache.estimate("w", "w1", 24, earlier="w1")
    assert WordCache.from_dict(cache.to_dict(), max_recent=4).recent == cache.recent[-4:]
    for bad in ({"words": {"a": -1}}, {"words": {"a": True}}, {"words": []}, {"pairs": {"a\tb": 1.5}},
                {"last": 3}, {"pending": None}, {"words": {"a\tb": 1}}, {"pairs": {"a": 1}},
                {"triples": {"a\tb": 1}}, {"triples": {"a\tb\t.": 1}}, {"triples": []},
                {"recent": "a"}, {"recent": ["a", "\ud800"]}, {"recent": ["'a"]},
                {"before_last": "a"}, {"last": "b", "before_last": 3}):
        with pytest.raises(ValueError):
            WordCache.from_dict(bad)


def test_a_cache_in_the_old_format_imports() -> None:
    """A session exported before triples and recent words existed still imports, and goes on counting."""
    old = {"words": {"the": 2, "meter": 1}, "pairs": {"the\tmeter": 1}, "last": "the", "pending": "me"}
    cache = WordCache.from_dict(json.loads(json.dumps(old)))
    assert cache.triples == {} and cache.recent == [] and cache.before_last is None
    assert cache.candidates("me", "the", 24) == pytest.approx({"meter": 1.0})
    cache.observe("ter reads ")
    assert cache.words["meter"] == 2 and cache.pairs["the\tmeter"] == 2 and cache.triples == {"the\tmeter\treads": 1}
    assert cache.recent == ["meter", "reads"]


def test_a_cache_that_is_not_an_object_is_refused() -> None:
    """Session blobs are user input: a list or a string where the cache's object belongs is a ValueError (the
    import answers 422), not an AttributeError (a 500)."""
    for bad in (["x"], "x", 3, None):
        with pytest.raises(ValueError):
            WordCache.from_dict(bad)  # type: ignore[arg-type]


def test_a_word_past_the_bound_is_not_counted_and_not_kept_whole() -> None:
    """Text without spaces (a blob, a script written without them) was one word of any length: kept pending across
    texts, counted, and written into the session's export three times (words, recent, last), so that a session which
    had read 400 KB of it could no longer be imported. A word over MAX_WORD_BYTES is not counted and breaks the
    pairs as a mark does; a pending one keeps only its start."""
    cache = WordCache()
    long = "x" * (MAX_WORD_BYTES + 1)
    cache.observe("good morning " + long + " again morning ")
    assert set(cache.words) == {"good", "morning", "again"}
    assert cache.pairs == {"good\tmorning": 1, "again\tmorning": 1} and cache.triples == {}
    assert cache.recent == ["good", "morning", "again", "morning"]
    exact = "é" * (MAX_WORD_BYTES // 2)  # at the bound (in UTF-8 bytes): a word
    cache.observe(f" {exact} ")
    assert exact in cache.words
    for _ in range(50):  # a word that never ends: its pending start is all that is kept
        cache.observe("y" * 10_000)
    assert len(cache.pending) == MAX_WORD_BYTES + 1
    cache.observe(" morning")
    assert not any(w.startswith("y") for w in cache.words) and cache.last is None
    assert len(json.dumps(cache.to_dict())) < 2000
    cache.observe("y" * (MAX_WORD_BYTES - 1))  # short pieces of a word that grows past the bound: not counted
    cache.observe("yy ")
    assert not any(w.startswith("y") for w in cache.words)


@pytest.mark.parametrize("seed", range(4))
def test_observing_in_pieces_counts_as_observing_at_once_past_the_bound(seed: int) -> None:
    """Texts of words under and over MAX_WORD_BYTES, quoted ones among them ('...', whose apostrophes are not the
    word's), with runs of apostrophes inside, cut anywhere into pieces: the pieces count what the whole text counts.
    A pending word over the bound kept its first MAX_WORD_BYTES + 1 characters, so a quoted one (or one whose
    apostrophes fell at the cut) was counted as the few letters kept, a word nobody wrote."""
    import random

    rng = random.Random(seed)
    parts = ["a", "word", "x" * (MAX_WORD_BYTES - 1), "y" * (MAX_WORD_BYTES + 12), "é" * 30, "'", "'" * 3,
             "\u2019" * (MAX_WORD_BYTES + 5), " ", " ", ". "]
    for _ in range(30):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 12))) + " end "
        whole, pieces = WordCache(), WordCache()
        whole.observe(text)
        cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(1, 4), len(text) - 1)))
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            pieces.observe(text[a:b])
            assert len(pieces.pending) <= 2 * MAX_WORD_BYTES + 4
        assert pieces.to_dict() == whole.to_dict(), (text, cuts)


def test_a_capitalised_prefix_leaves_words_with_inner_capitals_as_typed() -> None:
    """A word written with a capital inside it (iPhone, eBay, macOS) keeps its first letter at a sentence start:
    "I" does not offer "IPhone", a word nobody typed, and "iP" still offers "iPhone"."""
    cache = WordCache()
    cache.observe("my iPhone and eBay and life ")
    assert "IPhone" not in cache.candidates("I", None, 24)
    assert "EBay" not in cache.candidates("E", None, 24)
    assert "Life" in cache.candidates("L", None, 24)
    assert "iPhone" in cache.candidates("iP", None, 24)
