"""What the next word after a mark costs: the byte search after "Hi," "Done." (nothing of the word typed, the context
ending in punctuation) with the word after a space (`space=True`, what `models.suggest.suggest` does there now) and
without (`space=False`: the search as it was before it, the words glued to the mark only), side by side from the same
cursors; beside them, for scale, the search after two letters of a word and after a space, which the change leaves as
they were (the same code path: the same completions, expansions and model calls).

    python -m bench.after_mark [--checkpoint checkpoints/default] [--text tests/data/valid.txt] [--runs 5]

Contexts: 200 bytes of the text ending after a comma, full stop, semicolon, "!" or "?" that a space follows in the
text (the word after it is the next word), at least 400 bytes apart; as many ending two letters into a word, and
after a space. The server's settings: k = MIX_CANDIDATES (8: the width a session with a word cache searches), 8
branches a round, min_prob 1e-3, 5 next characters. Each context's time is the median of --runs, the two arms
interleaved; the table gives the mean and the median over the contexts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench._common import DEFAULT_CHECKPOINT, ROOT, machine_line
from models.base import LanguageModel
from models.checkpoint import load_checkpoint
from models.scoring import BOS
from models.suggest import Cursor, Suggestions, advance, complete_word, next_chars, split_word
from models.wordcache import MIX_CANDIDATES


def contexts(text: bytes, kind: str, n: int, length: int = 200, apart: int = 400) -> list[str]:
    """n contexts of `length` bytes ending after a mark followed by a space ("mark"), two letters into a word
    ("word"), or after a space ("space")."""
    found: list[tuple[int, str]] = []
    for i in range(length, len(text) - 2):
        c, before, after = chr(text[i]), chr(text[i - 1]), chr(text[i + 1])
        if not (kind == "mark" and c in ",.;!?" and after == " "
                or kind == "word" and c.isalpha() and before.isalpha() and text[i - 2] == 0x20 and after.isalpha()
                or kind == "space" and c == " " and before.isalpha()):
            continue
        if not found or i + 1 - found[-1][0] >= apart:
            found.append((i + 1, text[i + 1 - length : i + 1].decode("utf-8", errors="ignore")))
        if len(found) == n:
            break
    return [context for _, context in found]


def timed(model: LanguageModel, cursor: Cursor, context: str, space: bool, runs: int) -> tuple[float, Suggestions]:
    """-> (the median ms of the search and the next characters, what the search found)"""
    times, found = [], None
    for _ in range(runs):
        start = time.perf_counter()
        found = complete_word(model, cursor, split_word(context)[1], k=MIX_CANDIDATES, max_chars=24, min_prob=1e-3,
                              batch=8, space=space)
        next_chars(model, cursor, 5)
        times.append(time.perf_counter() - start)
    assert found is not None
    return 1000 * statistics.median(times), found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--text", default=str(ROOT / "tests" / "data" / "valid.txt"))
    ap.add_argument("--contexts", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.checkpoint).model.eval()
    text = Path(args.text).read_bytes()
    print(machine_line())
    print("| contexts | search | ms, mean | ms, median | expansions | model calls | completions (after a space) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in ("mark", "word", "space"):
        arms: dict[str, list[tuple[float, Suggestions]]] = {}
        for context in contexts(text, kind, args.contexts):
            cursor = advance(model, model.init_state(1), bytes([BOS]) + context.encode())
            for space in ((False, True) if kind == "mark" else (False,)):
                arms.setdefault("with the space" if space else "as before", []).append(
                    timed(model, cursor, context, space, args.runs))
        for arm, rows in arms.items():
            ms = [t for t, _ in rows]
            mean = statistics.mean
            print(f"| {kind} ({len(rows)}) | {arm} | {mean(ms):.2f} | {statistics.median(ms):.2f} "
                  f"| {mean(f.expansions for _, f in rows):.0f} | {mean(f.model_calls for _, f in rows):.1f} "
                  f"| {mean(len(f.completions) for _, f in rows):.1f} "
                  f"({mean(sum(c.space_before for c in f.completions) for _, f in rows):.1f}) |")


if __name__ == "__main__":
    main()
