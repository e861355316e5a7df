"""Typists' keystrokes in this process, through the server's keyboard path: what a keystroke costs.

A session of the checkpoint with its default memories (adapter, copy model, word cache) types messages a character
at a time and observes each when it is typed, as the load test's typist does (loadtest/messages.txt by default);
each keystroke's suggestions run as the engine runs them (`server.engine._suggest.SuggestRounds` over the
session's cursor cache, k=3, 5 next characters), under the server's precision (`--precision`, auto: bf16 where the
CPU multiplies it natively). With `--typists N`, N sessions type at once, each from its own place in the messages, a
keystroke each per tick, their searches batched in the same rounds (as the engine batches concurrent typists); the
times are then a tick's divided by N. The copy model's kernels are compiled and `--warmup` messages typed by another
session first, uncounted. Prints each keystroke's time (p50, p90, p99, mean; wall and the thread's CPU time, which a
busy machine disturbs less), the model rows and batched steps per keystroke and the rows read from the last
keystroke's search, and with --profile the functions that take the time (cProfile, `--sort`, cumulative by default).

A word checkpoint (checkpoints/words) answers a keystroke with `word_suggestions`, as the server does: each keystroke
runs twice, side by side, from scratch (the whole message fed) and continuing from the states the session's last
keystrokes kept (`WordStateCache`, the server's), with the model steps per keystroke of each and the largest relative
difference between their probabilities (and the keystrokes whose completions differ: two words as probable within
that difference may trade places).

    python -m bench.keystrokes [--checkpoint DIR] [--text FILE] [--keys 2000] [--typists 1] [--profile 25]
        [--memories JSON]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from bench._common import DEFAULT_CHECKPOINT, ROOT, machine_line
from models.checkpoint import Checkpoint, load_checkpoint
from models.precision import PRECISIONS, inference_precision, resolve_precision
from models.session import Session, SessionModel
from models.suggest import SUGGEST_MIN_PROB, Suggestions
from models.tokenizer import ByteTokenizer
from models.word_suggest import word_suggestions
from models.word_tokenizer import WordTokenizer
from server.engine._suggest import (
    SUGGEST_BATCH,
    SUGGEST_MAX_EXPANSIONS,
    SUGGEST_ROUND_ROWS,
    CursorCache,
    SuggestJob,
    SuggestRounds,
    WordStateCache,
    feed_window,
)

MESSAGES = ROOT / "loadtest" / "messages.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--text", default=str(MESSAGES), help="messages, one a line (# starts a comment)")
    ap.add_argument("--keys", type=int, default=2000, help="at most this many keystrokes")
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions by cumulative time")
    ap.add_argument("--sort", default="cumulative", help="the profile's order (pstats: cumulative, tottime, ...)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--typists", type=int, default=1,
                    help="sessions typing at once, a keystroke each per tick, their searches batched (byte models); "
                         "the times are then a tick's divided by the typists")
    ap.add_argument("--precision", default="auto", choices=PRECISIONS,
                    help="the model work's precision, as the server's ADAPTLM_PRECISION (auto: bf16 where native)")
    ap.add_argument("--memories", type=json.loads, default=None,
                    help='the sessions\' memories as the API takes them (JSON), e.g. \'{"head": {"lr": 6.912e-5, '
                         '"decay": 1e-4}, "adapter": null}\' (default: the checkpoint\'s)')
    ap.add_argument("--warmup", type=int, default=1,
                    help="messages typed first, not counted, by a session of their own (what runs once: "
                         "allocator pools, first calls)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ck = load_checkpoint(Path(args.checkpoint), device=torch.device("cpu"))
    # as the server's worker runs its model work (server/engine/_loading.py)
    args.precision = resolve_precision(args.precision, ck.device, bf16_model=ck.model.bf16_inference)
    with inference_precision(args.precision, ck.device):
        run(ap, args, ck)


def run(ap: argparse.ArgumentParser, args: argparse.Namespace, ck: Checkpoint) -> None:
    messages = [line for line in Path(args.text).read_text("utf-8").splitlines() if line and not line.startswith("#")]
    served = SessionModel.of(ck)
    for memory in served.memories.values():
        memory.warm_up(torch.device("cpu"))  # as the server does at start-up
    if isinstance(ck.tokenizer, WordTokenizer):
        session = served.fresh(served.config(args.memories), id="typist", ttl_s=60.0, now=0.0)
        warm = served.fresh(served.config(args.memories), id="warm", ttl_s=60.0, now=0.0)
        for message in messages[: args.warmup]:
            for i in range(1, len(message) + 1):
                word_suggestions(served.search_model, ck.tokenizer, warm, message[:i], k=3, n_chars=5,
                                 max_chars=24, sessions=served, states=WordStateCache())
            warm = served.observe(warm, (message + "\n").encode("utf-8"))
        words(served, ck.tokenizer, session, messages, args)
        return
    if not isinstance(ck.tokenizer, ByteTokenizer):
        ap.error("a byte-level or word-level checkpoint")
    tokenizer = ck.tokenizer

    def typist() -> SuggestRounds:
        return SuggestRounds(served.search_model, CursorCache(model=served, tokenizer=tokenizer),
                             min_prob=SUGGEST_MIN_PROB, batch=SUGGEST_BATCH, max_expansions=SUGGEST_MAX_EXPANSIONS,
                             round_rows=SUGGEST_ROUND_ROWS, lexicon=ck.lexicon)

    warm, rounds = served.fresh(served.config(args.memories), id="warm", ttl_s=60.0, now=0.0), typist()
    for message in messages[: args.warmup]:
        for i in range(1, len(message) + 1):
            job = SuggestJob(warm, message[:i], 3, 24, 5)
            rounds.start([job])
            while rounds.active:
                rounds.round()
        warm = served.observe(warm, (message + "\n").encode("utf-8"))
    rounds = typist()
    times, cpu, rows, steps, reused = [], [], [], [], []
    profile = cProfile.Profile() if args.profile else None
    keys = [(message, i) for message in messages for i in range(1, len(message) + 1)][: args.keys]
    # each typist types the same keystrokes from its own place in them, all typists a key at each tick
    config = served.config(args.memories)
    typists = [served.fresh(config, id=f"typist{j}", ttl_s=60.0, now=0.0) for j in range(args.typists)]
    for tick in range(len(keys) // args.typists):
        typed = [keys[(tick + j * len(keys) // args.typists) % len(keys)] for j in range(args.typists)]
        jobs = [SuggestJob(s, message[:i], 3, 24, 5) for s, (message, i) in zip(typists, typed, strict=True)]
        if profile is not None:
            profile.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        n = [rounds.start(jobs) or 0]
        while rounds.active:
            r, _ = rounds.round()
            n.append(r or 0)
        times.append((time.perf_counter() - t0) * 1e3 / len(jobs))
        cpu.append((time.thread_time() - c0) * 1e3 / len(jobs))
        if profile is not None:
            profile.disable()
        for job in jobs:
            assert job.result is not None, job.error
        rows.append(sum(n) / len(jobs))
        steps.append(sum(x > 0 for x in n) / len(jobs))
        reused.append(sum(getattr(job.result, "reused", 0) for job in jobs) / len(jobs))
        for j, (message, i) in enumerate(typed):
            if i == len(message):  # sent: the session reads it, as the load test's typist's does
                typists[j] = served.observe(typists[j], (message + "\n").encode("utf-8"))
    times.sort()
    cpu.sort()
    print(f"# {len(times) * args.typists} keystrokes, {args.typists} typist(s), {Path(args.checkpoint).name}, "
          f"{args.precision}, {machine_line()}")
    print("| | p50 | p90 | p99 | mean | model rows / key | model steps / key | rows reused / key |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ms in ("wall ms", times), ("CPU ms (this thread)", cpu):
        print(f"| {name} | {ms[len(ms) // 2]:.2f} | {ms[len(ms) * 9 // 10]:.2f} | {ms[len(ms) * 99 // 100]:.2f} "
              f"| {statistics.mean(ms):.2f} | {statistics.mean(rows):.1f} | {statistics.mean(steps):.2f} "
              f"| {statistics.mean(reused):.1f} |")
    if profile is not None:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.profile)


def words(served: SessionModel, tokenizer: WordTokenizer, session: Session, messages: list[str],
          args: argparse.Namespace) -> None:
    """A word checkpoint's keystrokes, each from scratch and from the kept states (module docstring)."""
    states = WordStateCache()
    cpu: dict[str, list[float]] = {"from scratch": [], "kept states": []}
    calls: dict[str, list[int]] = {name: [] for name in cpu}
    worst, differ = 0.0, 0
    profile = cProfile.Profile() if args.profile else None
    keys = [(message, i) for message in messages for i in range(1, len(message) + 1)][: args.keys]
    for n, (message, i) in enumerate(keys):
        context = feed_window(message[:i])  # as the server's Suggest
        found: dict[str, Suggestions] = {}
        # alternate which runs first, so that neither always finds the caches warm
        for name in sorted(cpu, reverse=n % 2 == 1):
            kept = name == "kept states"
            if profile is not None and kept:
                profile.enable()
            c0 = time.thread_time()
            found[name] = word_suggestions(served.search_model, tokenizer, session, context, k=3, n_chars=5,
                                           max_chars=24, sessions=served, states=states if kept else None)
            cpu[name].append((time.thread_time() - c0) * 1e3)
            if profile is not None and kept:
                profile.disable()
            calls[name].append(found[name].model_calls)
        got, want = found["kept states"], found["from scratch"]
        differ += [(c.text, c.space_before) for c in got.completions] != \
            [(c.text, c.space_before) for c in want.completions]
        pairs = [*zip([c.prob for c in got.completions], [c.prob for c in want.completions], strict=False),
                 *zip([c.prob for c in got.next_chars], [c.prob for c in want.next_chars], strict=False)]
        worst = max([worst, *(abs(p - q) / q for p, q in pairs)])
        if i == len(message):  # sent: the session reads it, as the load test's typist's does
            session = served.observe(session, (message + "\n").encode("utf-8"))
    print(f"# {len(keys)} keystrokes, {Path(args.checkpoint).name}, "
          f"{args.precision}, {machine_line()}; largest relative difference "
          f"between the two's probabilities: {worst:.1e}; keys whose completions differ (a tie within it): {differ}")
    print("| CPU ms (this thread) | p50 | p90 | p99 | mean | model steps / key | keys without a step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ms in cpu.items():
        ms = sorted(ms)
        print(f"| {name} | {ms[len(ms) // 2]:.2f} | {ms[len(ms) * 9 // 10]:.2f} | {ms[len(ms) * 99 // 100]:.2f} "
              f"| {statistics.mean(ms):.2f} | {statistics.mean(calls[name]):.2f} "
              f"| {sum(c == 0 for c in calls[name]) / len(keys):.0%} |")
    if profile is not None:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.profile)


if __name__ == "__main__":
    main()
