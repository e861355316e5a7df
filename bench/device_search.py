"""The keyboard's word search on the host (`WordSearch`) and on the model's device (models/device_search.py), side by
side in one process through the engine's `SuggestRounds`: `--sessions` typists (sessions of the checkpoint, each
having observed a warm-up text) type a message each, a keystroke at a time in lockstep, every keystroke's suggestions
asked of both paths, the two alternating keystroke by keystroke. Per keystroke: model rounds, model rows, device-to-host
reads and bytes of the word search, CPU time; and whether the two paths' suggestions are the same (words, order, and
probabilities to 1e-5).

    python -m bench.device_search [--checkpoint DIR] [--sessions 1,8,32] [--keystrokes 40] [--device cpu]

The host path's reads: one a round (its (rows, 256) log-probs as float64); the device's: its done flags a round and
each search's result once (`DeviceSearches.reads`, `.bytes_read`). Both paths' cursors (`next_chars`) read the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from adaptlm_client.keysim import messages
from bench._common import DEFAULT_CHECKPOINT, machine_line
from models.checkpoint import load_checkpoint
from models.session import Session, SessionModel
from models.suggest import SUGGEST_MIN_PROB, Suggestions
from server.engine._suggest import (
    SUGGEST_BATCH,
    SUGGEST_MAX_EXPANSIONS,
    SUGGEST_ROUND_ROWS,
    CursorCache,
    SuggestJob,
    SuggestRounds,
)

TEXT = "tests/data/valid.txt"
V = 256


@dataclass
class Path_:
    name: str
    rounds: SuggestRounds
    cpu_s: float = 0.0
    model_rounds: int = 0
    rows: int = 0  # model rows: the contexts' feeding and the search's
    search_rows: int = 0
    keystrokes: int = 0
    answers: list[list[Suggestions | None]] = field(default_factory=list)

    def keystroke(self, sessions: list[Session], contexts: list[str]) -> None:
        jobs = [SuggestJob(s, c, 3, 24, 5) for s, c in zip(sessions, contexts, strict=True)]
        start = time.process_time()
        r = self.rounds
        fed = r.start(jobs)
        self.rows += fed or 0
        while r.busy:
            rows, _ = r.round()
            if rows:
                self.rows += rows
                self.search_rows += rows
                self.model_rounds += 1
        self.cpu_s += time.process_time() - start
        self.keystrokes += len(jobs)
        self.answers.append([j.result for j in jobs])


def _same(a: Suggestions | None, b: Suggestions | None) -> bool:
    if a is None or b is None:
        return a is b
    if [(c.text, c.space_before) for c in a.completions] != [(c.text, c.space_before) for c in b.completions]:
        return False
    return all(abs(x.prob - y.prob) <= 1e-5 * y.prob for x, y in zip(a.completions, b.completions, strict=True)) \
        and [c.char for c in a.next_chars] == [c.char for c in b.next_chars]


def run(checkpoint: str, n: int, keystrokes: int, device: str) -> None:
    ckpt = load_checkpoint(checkpoint)
    ckpt.model.to(device)
    model = SessionModel.of(ckpt)
    text = open(TEXT, encoding="utf-8").read()
    lines = [m for m in messages(text) if len(m) > keystrokes]
    warm = text[:2000].encode()
    first = model.observe(model.fresh(model.config(), id="s0"), warm)  # one observe; the others copies of it
    sessions = [dataclasses.replace(first, id=f"s{i}") for i in range(n)]
    paths = [Path_(name, SuggestRounds(model.search_model, CursorCache(model=model), min_prob=SUGGEST_MIN_PROB,
                                       batch=SUGGEST_BATCH, max_expansions=SUGGEST_MAX_EXPANSIONS,
                                       round_rows=SUGGEST_ROUND_ROWS, classes=None, lexicon=ckpt.lexicon,
                                       on_device=on))
             for name, on in (("host", False), ("device", True))]
    host, dev = paths
    assert dev.rounds.device is not None
    with torch.inference_mode():
        for i in range(1, keystrokes + 1):
            contexts = [lines[j % len(lines)][:i] for j in range(n)]
            for p in (paths if i % 2 else paths[::-1]):
                p.keystroke(sessions, contexts)
    same = sum(_same(a, b) for ha, da in zip(host.answers, dev.answers, strict=True)
               for a, b in zip(ha, da, strict=True))
    ds = dev.rounds.device
    k = host.keystrokes
    # one read of its search rows' float64 log-probs a round
    host_reads, host_bytes = host.model_rounds, host.search_rows * V * 8
    print(f"{n} sessions, {keystrokes} keystrokes each ({k} in all), {ckpt.name} on {device}:")
    print(f"  host:   {host.model_rounds / k * n:5.1f} rounds a keystroke, {host.rows / k:6.1f} rows/keystroke, "
          f"{host_reads / k:5.2f} reads/keystroke, {host_bytes / k:8.0f} B/keystroke, "
          f"{1000 * host.cpu_s / k:6.2f} ms CPU/keystroke")
    print(f"  device: {dev.model_rounds / k * n:5.1f} rounds a keystroke, {dev.rows / k:6.1f} rows/keystroke, "
          f"{ds.reads / k:5.2f} reads/keystroke ({ds.result_reads / k:.2f} of results), "
          f"{ds.bytes_read / k:8.0f} B/keystroke ({ds.result_bytes / k:.0f} of results), "
          f"{1000 * dev.cpu_s / k:6.2f} ms CPU/keystroke; "
          f"fallbacks to the host {dev.rounds.fallbacks}")
    print(f"  CPU time device/host {dev.cpu_s / host.cpu_s:.2f}x; identical suggestions {same}/{k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--sessions", default="1,8,32")
    ap.add_argument("--keystrokes", type=int, default=40)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    for n in (int(s) for s in args.sessions.split(",")):
        run(args.checkpoint, n, args.keystrokes, args.device)


if __name__ == "__main__":
    main()
