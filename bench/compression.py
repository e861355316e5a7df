"""Bits per byte of a checkpoint on several texts, next to xz -9 and zstd -19 on the same bytes.

Each text is scored as one stream from the model's initial state (batch 1, like `adaptlm score`).

    python -m bench.compression [--checkpoint DIR] [--limit 100000]
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import time

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.checkpoint import load_checkpoint
from models.scoring import score_bytes

TEXTS = [
    ("validation book: austen-persuasion (whole)", "gutenberg/austen-persuasion.txt", 0),
    ("unseen book: chesterton-brown", "gutenberg/chesterton-brown.txt", None),
    ("enwik8 (Wikipedia XML)", "enwik8/enwik8.head950k", None),
    ("Spanish: quijote-part1", "spanish/quijote-part1.txt", None),
    ("e-mails: enron-farmer-d", "messages/enron-farmer-d.first2672.txt", None),
    ("C code: linux.valid", "code/linux.valid.txt", None),
]


def xz_bpb(data: bytes) -> float:
    return 8 * len(lzma.compress(data, preset=9)) / len(data)


def zstd_bpb(data: bytes) -> float:
    exe = shutil.which("zstd")
    if exe is None:
        return float("nan")
    out = subprocess.run([exe, "-19", "-c", "-q"], input=data, capture_output=True, check=True).stdout
    return 8 * len(out) / len(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--limit", type=int, default=100_000)
    args = ap.parse_args()
    ck = load_checkpoint(args.checkpoint)
    print(f"# bits per byte, {ck.name}: {machine_line()}")
    print("| text | bytes | adaptlm (static) | xz -9 | zstd -19 | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, rel, limit in TEXTS:
        data = data_file(rel).read_bytes()
        if limit is None:
            data = data[: args.limit]
        t0 = time.perf_counter()
        bpb = score_bytes(ck.model, data).bits_per_byte
        dt = time.perf_counter() - t0
        print(f"| {label} | {len(data):,} | {bpb:.3f} | {xz_bpb(data):.3f} | {zstd_bpb(data):.3f} | {dt:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
