"""The grid behind the checkpoint's session defaults (dyneval.json "session"): sparse adaptation (H = 256) of one
stream, score-then-update, for each (eta, lambda), on held-out personal text (the first 30 KB of SMS messages;
the keyboard benchmark uses the file's last 20 KB) and on in-domain prose that adaptation must not hurt.

    python -m bench.session_defaults [--checkpoint DIR] [--lrs 4e-5,1e-4,2e-4,5e-4] [--decays 0,1e-3,1e-2]
                                     [--segments 20] [--adapter-size 256] [--cache]

`--segments` (tokens per update: bytes for a byte model, words for a word model) adds a column of the grid: the
thesis uses 5 for word-level and 20 for character-level RNNs (sec. 4.5), and each segment length has its own best eta.

`--cache` adds, for each setting, the same sessions with the neural cache (the checkpoint's dyneval.json "cache"
section: `adaptlm tune --mode cache`), as a session with `neural_cache` runs it; and the cache alone (static + cache).
"""

from __future__ import annotations

import argparse
import itertools

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.checkpoint import load_checkpoint
from trainer.evaluation import run_eval

TEXTS = {  # name -> (file, first byte, last byte)
    "SMS": ("messages/sms_ham.train.txt", 0, 30_000),
    "prose": ("gutenberg/austen-persuasion.txt", 20_000, 40_000),
}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--lrs", type=floats, default=[4e-5, 1e-4, 2e-4, 5e-4])
    ap.add_argument("--decays", type=floats, default=[0.0, 1e-3, 1e-2])
    ap.add_argument("--segments", type=lambda t: [int(x) for x in t.split(",") if x], default=None,
                    help="tokens per update, comma-separated (default: the checkpoint's session segment)")
    ap.add_argument("--adapter-size", type=int, default=256)
    ap.add_argument("--cache", action="store_true", help="also with the neural cache (dyneval.json 'cache')")
    args = ap.parse_args()
    ck = load_checkpoint(args.checkpoint)
    data = {name: data_file(rel).read_bytes()[a:b] for name, (rel, a, b) in TEXTS.items()}
    static = {name: run_eval(ck, text, "static")[0]["bits_per_byte"] for name, text in data.items()}
    modes = ["sparse", "sparse+cache"] if args.cache else ["sparse"]
    cols = [(n, m) for n in data for m in modes]
    label = {"sparse": "", "sparse+cache": " +cache"}
    print(f"# session defaults grid, {ck.name}, sparse H={args.adapter_size}: {machine_line()}")
    if args.cache:
        print(f"# neural cache: {ck.dyneval.cache}")
    segments = args.segments or [ck.dyneval.session.segment]
    print("| segment | eta | lambda | " + " | ".join(f"{n}{label[m]} bpb | gain" for n, m in cols) + " |")
    print("| ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in cols) + " |")
    print("| static | | | " + " | ".join(f"{static[n]:.3f} | " if m == "sparse" else
                                      "{:.3f} | {:+.1f}%".format(*_gain(run_eval(ck, data[n], "cache")[0], static[n]))
                                      for n, m in cols) + " |", flush=True)
    for segment, lr, decay in itertools.product(segments, args.lrs, args.decays):
        cells = []
        for name, mode in cols:
            record = run_eval(ck, data[name], mode, lr=lr, decay=decay, adapter_units=args.adapter_size,
                              segment=segment)[0]
            cells.append("{:.3f} | {:+.1f}%".format(*_gain(record, static[name])))
        print(f"| {segment} | {lr:g} | {decay:g} | " + " | ".join(cells) + " |", flush=True)


def _gain(record: dict[str, float], static: float) -> tuple[float, float]:
    return record["bits_per_byte"], 100 * (1 - record["bits_per_byte"] / static)


if __name__ == "__main__":
    main()
