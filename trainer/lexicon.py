"""`python -m trainer.lexicon --data FILE... --out CKPT_DIR`: write a checkpoint's lexicon.txt, the words of its
training text (models/lexicon.py). Exit 2 with a message on bad input."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from models.lexicon import LEXICON_FILE, LEXICON_MIN_COUNT, count_words, write_lexicon


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.lexicon",
                                 description=f"Write a checkpoint's {LEXICON_FILE}: the words of its training text.")
    ap.add_argument("--data", nargs="+", required=True, type=Path, help="the training text files (UTF-8)")
    ap.add_argument("--out", required=True, type=Path, help="the checkpoint directory")
    ap.add_argument("--min-count", type=int, default=LEXICON_MIN_COUNT, help="keep words seen this often")
    args = ap.parse_args(argv)
    if args.min_count < 1:
        ap.error("--min-count must be at least 1")
    if not args.out.is_dir():
        ap.error(f"{args.out}: not a directory")
    texts = []
    for path in args.data:
        try:
            data = path.read_bytes()
        except OSError as e:
            ap.error(f"{path}: cannot read it ({e.strerror or e})")
        text = data.decode("utf-8", errors="replace")  # a Latin-1 byte splits its word (U+FFFD is no letter)
        if "\ufffd" in text and "\ufffd".encode() not in data:
            print(f"{path}: not all UTF-8; the words around its {text.count(chr(0xFFFD)):,} other bytes are split "
                  "there", file=sys.stderr)
        texts.append(text)
    counts = count_words(texts)
    if not any(c >= args.min_count for c in counts.values()):  # refused before writing: a lexicon there stays
        ap.error(f"no word occurs {args.min_count} times in the data: no lexicon written")
    n = write_lexicon(args.out / LEXICON_FILE, counts, args.min_count)
    size = (args.out / LEXICON_FILE).stat().st_size
    print(f"{args.out / LEXICON_FILE}: {n:,} words (of {len(counts):,} distinct, seen >= {args.min_count} times), "
          f"{size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
