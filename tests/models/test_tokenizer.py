import random

import torch

from models.registry import build_model, config_from_dict
from models.scoring import score_bytes
from models.tokenizer import KINDS, ByteTokenizer, Tokenizer, WordTokenizer, byte_level, tokenizer_from_dict, word_level


def test_round_trip_random_bytes() -> None:
    tok = ByteTokenizer()
    rng = random.Random(0)
    for n in (0, 1, 7, 1000):
        data = bytes(rng.randrange(256) for _ in range(n))
        ids = tok.encode(data)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode_bytes(ids) == data
        assert tok.decode_bytes(tok.encode_tensor(data)) == data


def test_text_round_trip_and_invalid_utf8() -> None:
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text.encode("utf-8"))
    # a lone continuation byte and a truncated multi-byte sequence decode with replacement, never raise
    assert tok.decode([0x80, 0x41, 0xE6, 0x97]) == "\ufffdA\ufffd"


def test_every_kind_answers_the_protocol() -> None:
    """What callers outside models/ ask instead of the kind: the unit, whether scores report per token, a text cut at
    its tokens (joining back to it) and the per-token texts (None for bytes); the byte and word searches' tokenizers."""
    words = WordTokenizer.build("the cat sat. the cat ran.\n")
    text = b"the cat zyzzyva.\n"
    kinds: list[Tokenizer] = [ByteTokenizer(), words]
    for tok in kinds:
        assert tokenizer_from_dict(tok.to_dict()) == tok and KINDS[tok.kind](tok.to_dict()) == tok
        pieces = tok.pieces(text)
        assert b"".join(pieces) == text and len(pieces) == len(tok.encode(text))
    assert (ByteTokenizer().unit, ByteTokenizer().reports_tokens, ByteTokenizer().token_texts(text)) == ("byte", False,
                                                                                                         None)
    assert (words.unit, words.reports_tokens) == ("word", True)
    assert words.token_texts(text) == ["the", " cat", " zyzzyva", ".", "\n"]
    assert byte_level(ByteTokenizer()) == ByteTokenizer() and byte_level(words) is None
    assert word_level(words) is words and word_level(ByteTokenizer()) is None


def test_score_continues_after_last_token_of_any_kind() -> None:
    """score_bytes reads on from the token given, not from bos, whatever the tokenizer (a state or not)."""
    torch.manual_seed(0)
    words = WordTokenizer.build("a b c\n")
    model = build_model(config_from_dict({"arch": "mlstm", "vocab_size": words.vocab_size, "embed_dim": 8,
                                          "hidden": 8}))
    after_bos = score_bytes(model, b"a b", tokenizer=words)
    after_c = score_bytes(model, b"a b", tokenizer=words, last_token=words.encode("c")[0])
    assert after_bos.tokens == after_c.tokens == 2 and after_bos.bits != after_c.bits
    assert score_bytes(model, b"a b", tokenizer=words, last_token=words.bos).bits == after_bos.bits
