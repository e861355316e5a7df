"""Ranking variants of a keyboard session's suggestions, replayed offline on held-out text (`bench.keyboard_losses`'
analysis slices). The simulator's queries (the message typed so far, `message[:start + p]`) and the session's state
(adapter, copy model, word cache: they change only when a message is observed) do not depend on which suggestions the
typist takes, so one pass records, for every word and every number p of its characters typed, the model's WIDTH most
probable completions and the word cache's estimate (as typed and read with capitals, `WordCache.titled`); any ranking
over those then replays exactly, in seconds.

    python -m bench.keyboard_replay record --texts emails,sms      # slow: one exact search of WIDTH words per query
    python -m bench.keyboard_replay replay --texts emails,sms [--grid "[dict(width=3, fold=False), dict(width=8)]"]

Variant keys: `width` (the model's completions mixed, 3 = the shown bar only), `fold` (the capitalised reading of the
cache), `weight` (cache_weight), `beta` (rank by p * (characters added) ** beta: expected keys saved), `lex` (a
factor on the completions that are neither a word of the training text, case-folded, nor a word the session typed:
a dictionary prior, which a byte model's search does not have, as the analysis first tried it), `prior` (the
shipped prior, `models.lexicon.Lexicon.rank`: True for the checkpoint's lexicon.txt, or a lexicon file's path; the
session's words stand in for its word cache, unbounded, as typed and with a capital first letter).

After a mark (a word that follows "(" or "-" directly: `models.suggest.takes_space`) the search also finds words after
a space; they are recorded as the keyboard would insert them, with the space (never the word typed there, as in
`adaptlm_client.keysim`), with the search's `space_share` ("space"), by which the replay splits the cache's words as
`WordCache.mix` does (records made before it have none: all direct).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from adaptlm_client.keysim import messages, split_text, split_words
from bench._common import DEFAULT_CHECKPOINT, ROOT, data_file
from bench.keyboard_losses import SLICES, training_words

WIDTH = 10
TOP_CACHED = 40  # the cache's most probable words kept per query
WORD = r"[^\W_]+(?:['\u2019][^\W_]+)*"
DEFAULT_GRID = "[dict(width=3, fold=False), dict(width=3), dict(width=8), dict(width=8, beta=0.5), " \
               "dict(width=8, lex=0.2), dict(width=8, lex=0.1)]"


def _slice(name: str) -> tuple[str, str]:
    rel, w0, t0, t1 = SLICES[name]["analysis"]
    return split_text(data_file(rel).read_bytes()[w0:t1], last_bytes=t1 - t0)


def record(name: str, out: Path, checkpoint: str) -> None:
    import torch

    from models.checkpoint import load_checkpoint
    from models.copymodel import CopyModel
    from models.keysim import ModelSuggester
    from models.suggest import advance, split_word, suggest
    from models.wordcache import WordCache, previous_words

    ckpt = load_checkpoint(checkpoint)
    copy = CopyModel(ckpt.dyneval.copy) if ckpt.dyneval.copy is not None else None
    warm, typed = _slice(name)
    sim = ModelSuggester(ckpt.model, ckpt.dyneval.session, stats=ckpt.stats, copy=copy)
    for m in messages(warm):
        sim.observe(m)

    def top(d: dict[str, float]) -> list[tuple[str, float]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[:TOP_CACHED]

    def as_typed(cache: WordCache, prefix: str, previous: str | None, earlier: str | None) -> Any:
        titled, cache._titled = cache._titled, cache  # the cache read without capitalising
        try:
            return cache.estimate(prefix, previous, 24, earlier)
        finally:
            cache._titled = titled

    with (out / f"{name}.jsonl").open("w") as f, torch.no_grad():
        for m in messages(typed):
            words = []
            for start, end in split_words(m):
                queries = []
                for p in range(end - start):
                    context = m[:start + p]
                    cursor = advance(sim._forward, sim.state, sim.tokenizer.token_bytes(sim.last) + context.encode(),
                                     sim.adapter)
                    found = suggest(sim._forward, cursor, context, sim.adapter, k=WIDTH, max_chars=24, n_chars=0)
                    before, prefix = split_word(context)
                    earlier, previous = previous_words(before)
                    cached, conf = sim.words.estimate_at(context, 24)
                    raw, raw_conf = as_typed(sim.words, prefix, previous, earlier)
                    queries.append({"model": [[" " + c.text if c.space_before else c.text, c.prob]
                                              for c in found.completions], "cache": top(cached),
                                    "conf": conf, "cache_typed": top(raw), "conf_typed": raw_conf,
                                    "space": found.space_share})
                words.append({"word": m[start:end], "start": start, "end": end, "q": queries})
            f.write(json.dumps({"m": m, "words": words}) + "\n")
            f.flush()
            sim.observe(m)


def bar(q: dict[str, Any], prefix: str, lexicon: set[str], seen: set[str], *, width: int = 8, fold: bool = True,
        weight: float = 0.5, beta: float = 0.0, lex: float = 1.0, k: int = 3, shipped: Any = None,
        cased: Any = None) -> list[str]:
    cached, conf = (q["cache"], q["conf"]) if fold else (q["cache_typed"], q["conf_typed"])
    lam = weight * conf if cached else 0.0
    mixed = {t: (1 - lam) * p for t, p in q["model"][:width]}
    space = q.get("space", 0.0)  # after a mark: the share of the cache's words offered after a space
    for t, p in cached:
        for key, share in (t, 1.0 - space), (" " + t, space):
            if share > 0:
                mixed[key] = mixed.get(key, 0.0) + lam * p * share

    def score(item: tuple[str, float]) -> tuple[float, str]:
        t, p = item
        if lex != 1.0 and t.lower() not in seen and t.lower() not in lexicon:
            p *= lex
        return -(p * (len(t) - len(prefix)) ** beta), t

    if shipped is not None:  # models.lexicon's rule, as the server ranks
        from models.suggest import Completion

        ranked = [Completion(t, p) for t, p in sorted(mixed.items(), key=lambda kv: (-kv[1], kv[0]))]
        return [c.text for c in shipped.rank(ranked, k, cased)]
    return [t for t, _ in sorted(mixed.items(), key=score)[:k]]


def ksr(records: list[dict[str, Any]], warm: str, lexicon: set[str], checkpoint: str = str(DEFAULT_CHECKPOINT),
        **variant: Any) -> float:
    """The simulator's accounting (adaptlm_client.keysim.type_message) over the recorded queries."""
    chars = typed = selections = 0
    seen = {w.lower() for w in re.findall(WORD, warm)}
    from models.lexicon import LEXICON_FILE, Lexicon
    from models.wordcache import WordCache, counted_words

    shipped = variant.pop("prior", None)
    if shipped is not None:
        variant["shipped"] = Lexicon.read(Path(checkpoint) / LEXICON_FILE if shipped is True else shipped)
        # the session's words, unbounded (no observe: no pruning), as its word cache reads them (`WordCache.has`)
        variant["cased"] = cased = WordCache(words=dict.fromkeys(counted_words(warm), 1))
    for r in records:
        m = r["m"]
        chars += len(m)
        i = 0
        for w in r["words"]:
            typed += w["start"] - i
            i = w["end"]
            for p, q in enumerate(w["q"]):
                if w["word"] in bar(q, w["word"][:p], lexicon, seen, **variant):
                    selections += 1
                    if w["end"] < len(m) and m[w["end"]] == " ":
                        i = w["end"] + 1
                    break
                typed += 1
        typed += len(m) - i
        seen.update(x.lower() for x in re.findall(WORD, m))
        if shipped is not None:
            cased.words.update(dict.fromkeys(counted_words(m), 1))
    return 1 - (typed + selections) / chars


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("record", "replay"))
    ap.add_argument("--texts", default=",".join(SLICES))
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--grid", default=DEFAULT_GRID)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "keyboard_replay")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.texts.split(",")
    if args.what == "record":
        for name in names:
            t0 = time.perf_counter()
            record(name, args.out, args.checkpoint)
            print(f"{name}: recorded in {time.perf_counter() - t0:.0f} s", flush=True)
        return
    lexicon = {w.lower() for w in training_words()}
    # a recording in progress: its complete lines
    records = {n: [json.loads(line) for line in (args.out / f"{n}.jsonl").open() if line.endswith("\n")]
               for n in names}
    print("| variant | " + " | ".join(f"{n} KSR ({len(records[n])} messages)" for n in names) + " |")
    print("| --- | " + " | ".join("---:" for _ in names) + " |")
    for variant in eval(args.grid, {"__builtins__": {}, "dict": dict}):  # noqa: S307 (a grid the user typed)
        print(f"| {variant} | " + " | ".join(f"{ksr(records[n], _slice(n)[0], lexicon, args.checkpoint, **variant):.4f}"
                                            for n in names) + " |", flush=True)


if __name__ == "__main__":
    main()
