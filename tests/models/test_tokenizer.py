import random

from models.tokenizer import ByteTokenizer


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
