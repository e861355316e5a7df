"""One typist's keystrokes in this process, through the server's keyboard path: what a keystroke costs.

A session of the checkpoint with its default memories (adapter, copy model, word cache) observes a few messages,
then types the next ones a character at a time; each keystroke's suggestions run as the engine runs them
(`server.engine._suggest.SuggestRounds` over the session's cursor cache, k=3, 5 next characters). Prints each
keystroke's time (p50, p90, p99, mean; wall and the thread's CPU time, which a busy machine
disturbs less), the model rows and batched steps per keystroke, and with --profile the
functions that take the time (cProfile, cumulative).

    python -m bench.keystrokes [--checkpoint DIR] [--text FILE] [--observe 3000] [--keys 600] [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.checkpoint import load_checkpoint
from models.session import SessionModel
from server.engine._suggest import (
    SUGGEST_BATCH,
    SUGGEST_MAX_EXPANSIONS,
    SUGGEST_MIN_PROB,
    SUGGEST_ROUND_ROWS,
    CursorCache,
    SuggestJob,
    SuggestRounds,
)

MESSAGES = "messages/enron-farmer-d.first2672.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--text", help=f"the typist's text (default: {MESSAGES} of $ADAPTLM_DATA)")
    ap.add_argument("--observe", type=int, default=3000, help="characters observed before typing")
    ap.add_argument("--keys", type=int, default=600, help="keystrokes typed (each a character of the text)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions by cumulative time")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = (Path(args.text) if args.text else data_file(MESSAGES)).read_text("utf-8", errors="ignore")
    ck = load_checkpoint(Path(args.checkpoint), device=torch.device("cpu"))
    served = SessionModel.of(ck)
    session = served.fresh(served.config(), id="typist", ttl_s=60.0, now=0.0)
    session = served.observe(session, text[: args.observe].encode("utf-8"))
    typed = text[args.observe : args.observe + args.keys]
    rounds = SuggestRounds(served.search_model, CursorCache(model=served, tokenizer=ck.tokenizer),
                           min_prob=SUGGEST_MIN_PROB, batch=SUGGEST_BATCH, max_expansions=SUGGEST_MAX_EXPANSIONS,
                           round_rows=SUGGEST_ROUND_ROWS, lexicon=ck.lexicon)
    times, cpu, rows, steps, reused = [], [], [], [], []
    profile = cProfile.Profile() if args.profile else None
    start = 0  # the message being typed starts after the last newline: the server's context is the message
    for i in range(1, len(typed) + 1):
        if typed[i - 1] == "\n":
            start = i
            continue
        job = SuggestJob(session, typed[start:i], 3, 24, 5)
        if profile is not None:
            profile.enable()
        t0, c0 = time.perf_counter(), time.thread_time()
        n = [rounds.start([job]) or 0]
        while rounds.active:
            r, _ = rounds.round()
            n.append(r or 0)
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
        if profile is not None:
            profile.disable()
        assert job.result is not None, job.error
        rows.append(sum(n))
        steps.append(sum(x > 0 for x in n))
        reused.append(getattr(job.result, "reused", 0))
    times.sort()
    cpu.sort()
    print(f"# {len(times)} keystrokes, {Path(args.checkpoint).name}, {machine_line()}")
    print("| | p50 | p90 | p99 | mean | model rows / key | model steps / key | rows reused / key |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ms in ("wall ms", times), ("CPU ms (this thread)", cpu):
        print(f"| {name} | {ms[len(ms) // 2]:.2f} | {ms[len(ms) * 9 // 10]:.2f} | {ms[len(ms) * 99 // 100]:.2f} "
              f"| {statistics.mean(ms):.2f} | {statistics.mean(rows):.1f} | {statistics.mean(steps):.2f} "
              f"| {statistics.mean(reused):.1f} |")
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
