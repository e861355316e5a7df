import json

import pytest
import torch

from models.tokenizer import ByteTokenizer, WordTokenizer, tokenizer_from_dict
from models.word_tokenizer import TextSize

TEXTS = [
    "The cat sat on the mat. The dog didn't.\n",
    "  Indented line,\twith a tab;  two spaces (and brackets)!\n\nblank line above \n",
    "naïve café — 日本語 🙂 l'homme ... end",
    "no newline at the end, the the the",
]
SPECIALS = ["\n", " \n", "<unk>", " <unk>"]


def test_vocabulary_in_frequency_order_ties_by_string() -> None:
    tok = WordTokenizer.build(["a b b c c c\n a"])
    # specials first, then " c" x3, then " b" x2, then the ties " a" and "a" (1 each) in code point order
    assert list(tok.vocab) == SPECIALS + [" c", " b", " a", "a"]
    assert tok.vocab_size == 8
    assert tok.encode("a b c\n") == [7, 5, 4, 0]
    # the order does not depend on the order of the texts
    assert WordTokenizer.build(["x y y", "z z z"]).vocab == WordTokenizer.build(["z z z", "x y y"]).vocab


@pytest.mark.parametrize("split", ["words", "whitespace"])
def test_round_trip_in_vocabulary_text(split: str) -> None:
    tok = WordTokenizer.build(TEXTS, split=split)
    for text in TEXTS + ["\n".join(TEXTS), "The cat sat on the the the mat.\n"]:
        ids = tok.encode(text)
        assert tok.unk not in ids and 3 not in ids
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")
        assert tok.decode(tok.encode_tensor(text)) == text
        assert tok.encode(text.encode("utf-8")) == ids  # bytes in: read as UTF-8


def test_words_split_rule() -> None:
    tok = WordTokenizer.build(TEXTS)
    assert tok.tokens("The dog didn't.\n") == ["The", " dog", " didn't", ".", "\n"]
    assert tok.tokens("a  b \n\tc...") == ["a", " ", " b", " \n", "\t", "c", ".", ".", "."]
    assert tok.tokens("café—日本語 🙂") == ["café", "—", "日本語", " 🙂"]
    # pre-tokenised corpora: a token is whatever lies between spaces; "<unk>" is one token in both
    assert tok.tokens(" a <unk> b-c") == [" a", " <unk>", " b", "-", "c"]
    ws = WordTokenizer.build(TEXTS, split="whitespace")
    assert ws.tokens(" a <unk> b-c @-@ d \n") == [" a", " <unk>", " b-c", " @-@", " d", " \n"]


def test_unknown_words_become_unk_keeping_their_space() -> None:
    tok = WordTokenizer.build(["the cat sat\n"])
    ids = tok.encode("the dog sat zzz\nqq")
    assert ids == [tok.encode("the")[0], 3, tok.encode(" sat")[0], 3, 0, 2]
    assert tok.decode(ids) == "the <unk> sat <unk>\n<unk>"
    assert tok.encode(tok.decode(ids)) == ids  # the decoded text encodes back to the same ids
    assert tok.token_bytes(2) == b"<unk>" and tok.token_bytes(3) == b" <unk>"
    assert tok.encode("\t\t") == [2]  # unknown whitespace has no leading space


def test_token_bytes_stream_last_token_and_size() -> None:
    tok = WordTokenizer.build(TEXTS)
    cat = tok.encode(" cat")[0]
    assert tok.token_bytes(cat) == b" cat"
    assert tok.token_bytes(0) == b"\n" and tok.bos == 0
    assert tok.token_bytes(tok.encode(" 日本語")[0]) == " 日本語".encode()
    inputs, targets = tok.stream("The cat sat")
    assert targets.tolist() == tok.encode("The cat sat")
    assert inputs.tolist() == [0] + targets.tolist()[:-1]
    inputs, _ = tok.stream(" on", last_token=cat)
    assert inputs.tolist() == [cat] and inputs.dtype == torch.long
    assert tok.last_token(b"The cat") == cat
    assert tok.last_token(b"first line\nThe cat sat on the mat.") == tok.encode(".")[0]
    assert tok.last_token(b"x\nblank line above \n") == 1  # " \n"
    assert tok.last_token(b"The cat\n") == 0
    assert tok.size("The cat sat.\n") == TextSize(tokens=5, bytes=13)
    assert tok.size("café") == TextSize(tokens=1, bytes=5)
    assert tok.size(b"") == TextSize(0, 0) and tok.encode_tensor("").shape == (0,)


def test_max_size_and_min_count_cut_the_vocabulary() -> None:
    text = "a a a a b b b c c d\n"
    full = WordTokenizer.build([text])
    assert list(full.vocab[4:]) == [" a", " b", " c", " d", "a"]  # " " sorts before "a"
    assert list(WordTokenizer.build([text], max_size=6).vocab) == SPECIALS + [" a", " b"]
    assert list(WordTokenizer.build([text], min_count=2).vocab) == SPECIALS + [" a", " b", " c"]
    assert list(WordTokenizer.build([text], max_size=4).vocab) == SPECIALS
    cut = WordTokenizer.build([text], min_count=3)
    assert cut.decode(cut.encode(text)) == "<unk> a a a b b b <unk> <unk> <unk>\n"
    with pytest.raises(ValueError, match="max_size"):
        WordTokenizer.build([text], max_size=3)
    with pytest.raises(ValueError, match="min_count"):
        WordTokenizer.build([text], min_count=0)


def test_to_dict_round_trip_through_json() -> None:
    tok = WordTokenizer.build(TEXTS, max_size=30)
    data = json.loads(json.dumps(tok.to_dict()))  # what config.json holds
    assert data["kind"] == "words" and data["vocab"][:4] == SPECIALS
    back = tokenizer_from_dict(data)
    assert isinstance(back, WordTokenizer)
    assert back == tok and hash(back) == hash(tok)
    assert back != WordTokenizer.build(TEXTS, max_size=31)
    assert back != WordTokenizer.build(TEXTS, max_size=30, split="whitespace")
    assert back != ByteTokenizer()


def test_byte_tokenizer_still_built_from_its_dict() -> None:
    for data in (None, "bytes", {"kind": "bytes"}, {}):
        tok = tokenizer_from_dict(data)
        assert isinstance(tok, ByteTokenizer) and tok == ByteTokenizer()
        assert tok.to_dict() == "bytes"
        assert tok.decode(tok.encode("héllo")) == "héllo"


@pytest.mark.parametrize(("data", "message"), [
    ("words", "needs an object"),
    ({"kind": "words"}, "'vocab' must be a list"),
    ({"kind": "words", "vocab": "abc"}, "'vocab' must be a list"),
    ({"kind": "words", "vocab": [" a", "\n"]}, "must start with"),
    ({"kind": "words", "vocab": SPECIALS + [" a", " a"]}, "twice"),
    ({"kind": "words", "vocab": SPECIALS + [" a b"]}, "not one token"),
    ({"kind": "words", "vocab": SPECIALS + [""]}, "not one token"),
    ({"kind": "words", "vocab": SPECIALS + [3]}, "not a string"),
    ({"kind": "words", "vocab": SPECIALS, "split": "bpe"}, "unknown split"),
    ({"kind": "words", "vocab": SPECIALS, "lower": True}, "unknown fields"),
    ({"kind": "sentencepiece"}, "unknown tokenizer"),
    (["words"], "must be an object or a name"),
])
def test_invalid_dicts_raise_value_error(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tokenizer_from_dict(data)  # type: ignore[arg-type]


@pytest.mark.parametrize("split", ["words", "whitespace"])
def test_text_in_pieces_tokenizes_as_a_whole(split: str) -> None:
    """split_stable: whatever follows, the stable part's tokens are the whole text's first tokens, so a session can
    score them now and keep the pending rest for its next piece; cut anywhere, even inside a character."""
    texts = ["Don't stop  the   music.\nIt's 5 o'clock,\tsaid  l'homme ",
             "  leading gap\n\n  two\u00a0spaces  \u3000ideographic\r\nend",
             "naïve café — 🙂 emoji <unk> <unk>x <un\n"]
    tok = WordTokenizer.build(texts, split=split)
    for text in texts:
        data = text.encode("utf-8")
        whole = tok.tokens(data)
        for i in range(len(data) + 1):
            stable, pending = tok.split_stable(data[:i])
            assert stable + pending == data[:i]
            first = tok.tokens(stable)
            assert first == whole[: len(first)], (text, i)
            assert first + tok.tokens(pending + data[i:]) == whole, (text, i)
        stable, pending = tok.split_stable(data)
        if data.endswith(b"\n"):
            assert pending == b""
    assert tok.split_stable(b"one two") == (b"one", b" two")
    assert tok.split_stable(b"one two\n") == (b"one two\n", b"")
    assert tok.split_stable(b"caf\xc3") == (b"", b"caf\xc3")


def test_words_with_a_prefix_are_found_by_bisection() -> None:
    tok = WordTokenizer.build(["so the then there they them a an and\nthe\nThe ok. <unk> caf\u00e9 cafe"])
    for prefix in (b"", b" th", b" the", b"the", b" thx", b" caf", b" caf\xc3", b"\n"):
        expected = sorted((i for i in range(4, tok.vocab_size) if tok.token_bytes(i).startswith(prefix)),
                          key=tok.token_bytes)
        assert tok.with_prefix(prefix) == expected, prefix
    assert [tok.vocab[i] for i in tok.with_prefix(b" the")] == [" the", " them", " then", " there", " they"]


def test_words_with_a_prefix_grouped_by_their_next_character() -> None:
    # the keyboard's next characters: each group the contiguous run of the prefix's words that go on with one
    # character (multi-byte ones whole), against a pass over the vocabulary
    tok = WordTokenizer.build(["so the then there they them a an and\nthe\nThe ok. <unk> caf\u00e9 cafe caf\u00e8s"])
    for prefix in (b"", b" ", b" th", b" the", b" caf", b" thx", b"the"):
        words = tok.with_prefix(prefix)
        assert tok.ids_with_prefix(prefix).tolist() == words
        n = len(prefix.decode())
        expected: dict[str, list[int]] = {}
        for j, i in enumerate(words):
            if len(tok.vocab[i]) > n:
                expected.setdefault(tok.vocab[i][n], []).append(j)
        groups = tok.by_next_char(prefix)
        assert {c: list(range(start, end)) for c, start, end in groups} == expected, prefix
        assert len(groups) == len(expected)  # one group a character
    assert [c for c, _, _ in tok.by_next_char(b" caf")] == ["e", "\u00e8", "\u00e9"]
    special, word = tok.token_id(b" <unk>"), tok.token_id(b" the")
    assert special is not None and word is not None and tok.is_special(special) and not tok.is_special(word)
    assert all(not tok.is_special(i) for i in tok.with_prefix(b""))  # the words leave the specials out


def test_a_next_token_distribution_by_first_character() -> None:
    tok = WordTokenizer.build("the cat, the hat.\nA cat sat.\n")
    assert tok.token_id(b" cat") == tok.encode(" cat")[0] and tok.token_id(b" dog") is None
    assert tok.token_id(b"\xff") is None
    probs = torch.softmax(torch.randn(tok.vocab_size, dtype=torch.float64), 0)
    by_char = tok.first_char_probs(probs)
    expected: dict[str, float] = {}
    for i, entry in enumerate(tok.vocab):
        if entry != "<unk>":  # an unknown word's first letter is unknown
            expected[entry[0]] = expected.get(entry[0], 0.0) + float(probs[i])
    assert by_char == pytest.approx(expected)
    assert sum(by_char.values()) == pytest.approx(1 - float(probs[2]))
    assert {" ", "\n", ",", ".", "t", "A"} <= set(by_char)


def test_the_word_being_typed_and_the_entries_a_keyboard_may_offer_for_it() -> None:
    tok = WordTokenizer.build(["so the then there they them a an and\nthe\nThe ok.  (it) don't , <unk> caf\u00e9"])
    # the typed word is what a word typed next continues; a mark or a gap before it is settled
    cases = {b"": (b"", b""), b" ": (b"", b" "), b"  ": (b" ", b" "), b" th": (b"", b" th"), b"don'": (b"", b"don'"),
             b" (": (b" (", b""), b"ok.": (b"ok.", b""), b" caf\xc3": (b" caf\xc3", b""), b"<": (b"<", b"")}
    for tail, expected in cases.items():
        assert tok.split_typed(tail) == expected, tail
    spaced = [" a", " an", " and", " caf\u00e9", " don't", " ok", " the", " them", " then", " there", " they"]
    for typed, max_chars, words in [(b"", 24, ["The", "it", "so", "the"]), (b" ", 24, spaced),
                                    (b" th", 2, [" the", " them", " then", " they"]),
                                    (b" the", 24, [" them", " then", " there", " they"])]:
        ids = tok.ids_with_prefix(typed)
        got = sorted(tok.vocab[i] for i, ok in zip(ids.tolist(), tok.offered(ids, typed, max_chars).tolist(),
                                                    strict=True) if ok)
        assert got == sorted(words), typed


def test_unspaced_shares_unk_among_the_words_known_only_with_a_space() -> None:
    """At a line's start a word without an entry of its own is written <unk>: the spaced words without one share it,
    by the frequency order of their entries (1 / rank); words with an entry of their own, and marks, get none."""
    tok = WordTokenizer.build(["the cat saw the dog , the cat ran ( far )\ncat\n"])
    rank = {t: i - 3 for i, t in enumerate(tok.vocab)}  # 1 for the most frequent entry
    ids, shares = tok.unspaced(b"")
    assert ids.tolist() == tok.ids_with_prefix(b" ").tolist()
    got = {tok.vocab[i]: s for i, s in zip(ids.tolist(), shares.tolist(), strict=True)}
    only = [" saw", " dog", " ran", " far"]  # " the" and " cat" have "the" and "cat"; " ," " (" " )" are no words
    assert {t for t, s in got.items() if s > 0} == set(only) and got[" the"] == got[" ,"] == 0
    z = sum(1 / rank[t] for t in only)
    assert got == pytest.approx({t: 1 / rank[t] / z if t in only else 0.0 for t in got})
    ids, shares = tok.unspaced(b"d")
    assert [tok.vocab[i] for i in ids.tolist()] == [" dog"] and shares.tolist() == pytest.approx([got[" dog"]])
    assert tok.unspaced(b"x")[0].numel() == 0


HEAL_TEXT = ("there was a thing, this and that; I think things. I don't know. They don't, don't they?  Two spaces.\n"
             "   Indented. Then there the them then.\n")


def test_heal_holds_back_the_tokens_that_what_follows_may_change() -> None:
    """Token healing: a trailing space, a word cut short, a word with an apostrophe still open; nothing after a
    mark, an end of line, or a word no entry continues."""
    tok = WordTokenizer.build([HEAL_TEXT])
    cases = {
        "there was a ": ("there was a", " "),
        "there was a thi": ("there was a", " thi"),
        "there was a thing": ("there was a", " thing"),  # " things" may follow
        "I don'": ("I", " don'"),  # " don't" is one token
        "I think things.": ("I think things.", ""),
        "I think\n": ("I think\n", ""),
        "a  ": ("a", "  "),  # before a word, the run leaves its last space to it: [" ", " the"]
        "a  th": ("a ", " th"),
        "ther": ("", "ther"),  # at a line's start: "there", no space
        "a zyzzy": ("a zyzzy", ""),  # no entry starts with " zyzzy": the model reads its " <unk>"
        "": ("", ""),
    }
    for prompt, (kept, held) in cases.items():
        assert tok.heal(prompt.encode()) == (kept.encode(), held.encode()), prompt
    assert tok.heal("a caf\u00e9"[:-1].encode() + b"\xc3") == ("a caf\u00e9"[:-1].encode() + b"\xc3", b"")
    assert ByteTokenizer().heal(b"there was a thi") == (b"there was a thi", b"")  # a byte is never cut


def test_continuing_allows_the_tokenizers_own_cuts_and_never_unk() -> None:
    tok = WordTokenizer.build([HEAL_TEXT])

    def texts(held: str) -> set[str]:
        ids = tok.continuing(held.encode())
        assert ids.tolist() == sorted(ids.tolist())
        return {tok.vocab[i] for i in ids.tolist()}

    assert texts(" thi") == {" thing", " things", " think", " this"}  # not " th" + "ing": no cut the tokenizer makes
    assert texts(" don'") == {" don't"}
    assert " " in texts(" ") and " \n" in texts(" ") and " the" in texts(" ") and "the" not in texts(" ")
    assert texts("  ") == {" ", "  "}  # " " then " Two", or a longer run ("  " + " Indented")
    assert not any("<unk>" in t for t in texts(" ")) and not texts(" zyzzy")
    assert tok.continuing(b" thi") is tok.continuing(b" thi")  # worked out once (a request's forks ask again)
    for i in range(1100):  # many held texts: the answers kept stay bounded, and right
        tok.continuing(b" " + str(i).encode())
    assert len(tok._continuing) <= 1024 and texts(" thi") == {" thing", " things", " think", " this"}


@pytest.mark.parametrize("split", ["words", "whitespace"])
def test_healing_keeps_every_cut_of_every_continuation_and_allows_its_tokens(split: str) -> None:
    """Whatever follows a prompt: the kept part's tokens begin the whole text's, and the whole text's own tokens
    after them are allowed one by one by `continuing` until the held-back text is covered (when they are all in
    the vocabulary)."""
    tok = WordTokenizer.build([HEAL_TEXT], split=split)
    follows = ["", "t", "ng", "s", "s.", " the", ".", "\n", " ", "  Two", "'t know", "n't", " \n", "\t", "k"]
    for end in range(len(HEAL_TEXT) + 1):
        prompt = HEAL_TEXT[:end].rsplit("\n", 1)[-1]
        kept, held = tok.heal(prompt.encode())
        assert kept + held == prompt.encode()
        for follow in follows:
            whole = tok.tokens(prompt + follow)
            first = tok.tokens(kept)
            assert whole[: len(first)] == first, (prompt, follow)
            rest, after = held, whole[len(first):]
            while rest and after and after[0] in tok.vocab:
                token = tok.vocab.index(after[0])
                assert token in tok.continuing(rest).tolist(), (prompt, follow, after[0])
                data = after.pop(0).encode()
                rest = rest[len(data):] if rest.startswith(data) else b"" if data.startswith(rest) else b"?"
                assert rest != b"?"


def test_heal_cuts_the_prompt_as_sent_when_it_has_invalid_utf8() -> None:
    """A prompt with bytes that are not UTF-8 (Latin-1 "caf\\xe9", which `adaptlm generate` passes on as given):
    nothing is held, as before token healing (the cut was a byte offset into the text with U+FFFD for each bad byte:
    "...a thi" held "hi", " thi" read as " t" + "his", and "caf\xe9 It was the bes" went on "teem")."""
    tok = WordTokenizer.build([HEAL_TEXT, "history"])
    assert tok.heal(b"there was a thi")[1] == b" thi" and tok.heal(b"hi")[1] == b"hi"
    for prompt in (b"\xff there was a thi", b"caf\xe9 there was a ", b"\xff\xfe I don'", b"\xe9t\xe9 thi"):
        assert tok.heal(prompt) == (prompt, b""), prompt
