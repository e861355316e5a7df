"""What a keyboard user feels, per checkpoint: bench.families' "generate ms/byte" and "suggest ms" columns alone, each
the median of several runs, with the suggestions found (to compare two versions of the code side by side).

    python -m bench.latency [--checkpoints DIR ...] [--text FILE] [--runs 5] [--threads 1] [--typists 8]

generate ms/byte: a 256-byte prompt, then 64 bytes greedy, batch 1, the whole call divided by 64 (the prompt included,
unlike bench.families' decode-only column);
suggest ms: `advance` over a 256-byte context from the initial state, then `suggest` (word completions of a two-letter
prefix and next characters).

A second table, the server's keyboard path (`server.engine._suggest.run_suggestions` under the model the server runs for
adapting sessions, the network in `MemoryMixed`: the rounds of every search in progress batched into one model step; the
contexts' cursors cached, as for a keystroke after the first): "1 typist ms" one session's suggestion, "N typists ms" N
sessions' suggestions started together (N contexts of 200-260 bytes at different places in the text, so at different
fills), until the last answers; "typing ms" one session typing 96 keystrokes (contexts of 160 to 255 bytes: across the
compressive checkpoint's segment end at 192 and the character transformer's window slide at 256), each keystroke's
suggestion after the last's (the cursor cache feeding one byte), the mean, the 90th percentile and the slowest of the
keystrokes, each keystroke's time the median of --runs passes (a fresh session and cursor cache each: the same work),
so that the slowest is a keystroke's and not a pause of a busy machine's; "at" the slowest keystroke's context length.
The segment end at 192 evicts nothing (the compressive memory has just filled); "typing past 384 ms" the same over 40
keystrokes (contexts of 360 to 399 bytes, the first of them fed whole) across the first segment end that evicts and
compresses, and the character transformer's second slide.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench._common import family_args, family_text, machine_line, suggest_afresh, word_context
from models.base import LanguageModel
from models.checkpoint import Checkpoint, load_checkpoint
from models.memory import build_memories
from models.sampling import SamplingParams, generate
from models.session import Session, SessionModel
from models.suggest import Suggestions
from server.engine._suggest import (
    SUGGEST_BATCH,
    SUGGEST_MAX_EXPANSIONS,
    SUGGEST_MIN_PROB,
    SUGGEST_ROUND_ROWS,
    CursorCache,
    SuggestJob,
    run_suggestions,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    family_args(ap)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--typists", type=int, default=8, help="sessions suggesting at once in the second table (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = family_text(args).read_bytes()[:2000]
    print(f"# latency on cpu ({machine_line()})")
    print("| checkpoint | generate ms/byte | suggest ms | completions |")
    print("| --- | ---: | ---: | --- |")
    for path in args.checkpoints:
        ck = load_checkpoint(Path(path), device=torch.device("cpu"))
        model = ck.model
        prompt = text[:256]
        "".join(generate(model, prompt, SamplingParams(max_tokens=8, temperature=0.0)))  # warm-up
        gen = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            "".join(generate(model, prompt, SamplingParams(max_tokens=64, temperature=0.0)))
            gen.append((time.perf_counter() - t0) * 1e3 / 64)
        context = word_context(text, 1000, 1256)
        times = []
        for _ in range(args.runs + 1):
            t0 = time.perf_counter()
            found = suggest_afresh(model, context, ck.tokenizer)
            times.append((time.perf_counter() - t0) * 1e3)
        words = ", ".join(f"{c.text} {c.prob:.5f}" for c in found.completions)
        print(f"| {Path(path).name} | {statistics.median(gen):.2f} | {statistics.median(times[1:]):.1f} | {words} |")
    if args.typists:
        _typists(args.checkpoints, text, args.typists, args.runs)


def _typists(checkpoints: list[str], text: bytes, n: int, runs: int) -> None:
    print(f"\n| checkpoint | 1 typist ms | {n} typists ms | typing ms mean / p90 / max (at) "
          "| typing past 384 ms mean / max (at) | typist 1's completions |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for path in checkpoints:
        served = _served(load_checkpoint(Path(path), device=torch.device("cpu")))
        model = served.search_model
        contexts = [word_context(text, 100 + 97 * j, 300 + 97 * j + 7 * j) for j in range(n)]
        sessions = [_session(served, f"s{j}") for j in range(n)]
        cache = CursorCache(model=served)
        _suggest(model, cache, sessions, contexts)  # the cursors, cached
        one = [_suggest(model, cache, sessions[:1], contexts[:1])[0] for _ in range(runs)]
        many = [_suggest(model, cache, sessions, contexts)[0] for _ in range(runs)]
        words = ", ".join(f"{c.text} {c.prob:.5f}" for c in _suggest(model, cache, sessions, contexts)[1].completions)
        typing, at = _typing(served, text, range(160, 256), runs)
        past, past_at = _typing(served, text, range(360, 400), runs)
        print(f"| {Path(path).name} | {statistics.median(one):.1f} | {statistics.median(many):.1f} | "
              f"{statistics.mean(typing):.1f} / {typing[len(typing) * 9 // 10]:.1f} / {typing[-1]:.1f} ({at}) | "
              f"{statistics.mean(past):.1f} / {past[-1]:.1f} ({past_at}) | {words} |")


def _typing(served: SessionModel, text: bytes, ends: range, runs: int) -> tuple[list[float], int]:
    """One session typing, a keystroke at each context length of `ends` (bytes of the text from 1000), each
    keystroke's suggestion after the last's -> each keystroke's ms, the median of `runs` passes, sorted; the slowest
    one's length."""
    passes = []
    for _ in range(runs):
        typist, cache = _session(served, "typing"), CursorCache(model=served)
        passes.append([_suggest(served.search_model, cache, [typist],
                                [text[1000 : 1000 + end].decode("utf-8", "ignore")])[0]
                       for end in ends])
    keys = sorted((statistics.median(ms), end) for end, *ms in zip(ends, *passes, strict=True))
    return [ms for ms, _ in keys], keys[-1][1]


def _served(ck: Checkpoint) -> SessionModel:
    """The server's sessions of the checkpoint (`SessionModel.of`): its keyboard search runs the network inside
    `MemoryMixed` (`search_model`), which mixes in a session's neural cache where it has one (none here). Without the
    copy model: the transformer checkpoints have none, and the mLSTM's row is there for the machine's drift."""
    return SessionModel.of(ck, {name: m for name, m in build_memories(ck).items() if name != "copy"})


def _session(served: SessionModel, sid: str) -> Session:
    """A session that adapts (an adapter of the sites' largest default size, which learns nothing; no head memory),
    without a neural cache, its word cache not mixed in."""
    size = max(s.adapter_size() for s in served.model.adaptation_sites())
    asked: dict[str, dict[str, float] | None] = {"adapter": {"lr": 0.0, "decay": 0.0, "size": size},
                                                 "words": {"weight": 0.0}}
    for off in ("cache", "head"):  # the head: on by default where a checkpoint ships it; here every family alike
        if off in served.memories:
            asked[off] = None
    return served.fresh(served.config(asked), id=sid, ttl_s=60.0, now=0.0)


def _suggest(model: LanguageModel, cache: CursorCache, sessions: list[Session], contexts: list[str]
             ) -> tuple[float, Suggestions]:
    """The suggestions of `sessions` at `contexts` started together -> (ms until the last answers, the second's, or
    the first's)."""
    jobs = [SuggestJob(s, c, 3, 24, 5) for s, c in zip(sessions, contexts, strict=True)]
    t0 = time.perf_counter()
    run_suggestions(model, jobs, cache, min_prob=SUGGEST_MIN_PROB, batch=SUGGEST_BATCH,
                    max_expansions=SUGGEST_MAX_EXPANSIONS, round_rows=SUGGEST_ROUND_ROWS)
    ms = (time.perf_counter() - t0) * 1e3
    result = jobs[min(1, len(jobs) - 1)].result
    assert result is not None
    return ms, result


if __name__ == "__main__":
    main()
