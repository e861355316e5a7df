"""Dynamic-evaluation tables: bits per byte of static, neural cache, full and sparse dynamic evaluation
on several texts, next to xz -9e and 7-Zip PPMd; adapted state per stream; speed; batched sparse throughput.

    python -m bench.dyneval [--checkpoint DIR] [--limit 100000] [--texts book,spanish,...]
                            [--sizes 64,128,256,512] [--streams 1,8,32,128] [--plot docs/img/dyneval.png]

Every mode uses the checkpoint's tuned settings (dyneval.json); run `adaptlm tune` first.
7-Zip comes from Debian's p7zip-full (`apt-get install p7zip-full`); without it that column is "n/a".
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench._common import DEFAULT_CHECKPOINT, SHARED, machine_line
from models.adaptation import evaluate_many
from models.checkpoint import load_checkpoint
from trainer.evaluation import config_for, loss_curve, plot_curves, run_eval

TEXTS = {
    "book": ("unseen book (chesterton-brown)", "gutenberg/chesterton-brown.txt"),
    "spanish": ("Spanish (quijote-part1)", "spanish/quijote-part1.txt"),
    "emails": ("e-mails (enron-farmer-d)", "messages/enron-farmer-d.first2672.txt"),
    "code": ("C code (linux.valid)", "code/linux.valid.txt"),
    "enwik8": ("enwik8 (Wikipedia XML)", "enwik8/enwik8.head950k"),
}


def xz_bpb(data: bytes) -> float:
    return 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)


def ppmd_bpb(data: bytes) -> float:
    exe = shutil.which("7z") or shutil.which("7za")
    if exe is None:
        return float("nan")
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "t.txt", Path(d) / "t.7z"
        src.write_bytes(data)
        subprocess.run([exe, "a", "-bd", "-m0=PPMd:o=8", str(dst), str(src)], check=True, capture_output=True)
        return 8 * dst.stat().st_size / len(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--limit", type=int, default=100_000)
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--sizes", default="64,128,256,512")
    ap.add_argument("--streams", default="1,8,32,128")
    ap.add_argument("--stream-bytes", type=int, default=2000)
    ap.add_argument("--plot", help="PNG of loss against position on the first text")
    ap.add_argument("--no-batched", action="store_true", help="leave out the batched-streams table")
    args = ap.parse_args()
    ck = load_checkpoint(args.checkpoint)
    training_only = set(ck.model.training_only_parameters())  # never read at inference (zero-filled if not shipped)
    n_params = sum(p.numel() for n, p in ck.model.named_parameters() if n not in training_only)
    site = max(site.dim for site in ck.model.adaptation_sites())
    sizes = [int(s) for s in args.sizes.split(",") if s and int(s) <= site]  # sizes beyond the site do not exist
    print(f"# dynamic evaluation, {ck.name} ({n_params:,} parameters): {machine_line()}")
    print(f"settings: {ck.dyneval}")
    print()
    head = ["static", "cache", "dynamic"] + [f"sparse H={k}" for k in sizes]
    print("| text | xz -9e | PPMd o8 | " + " | ".join(head) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in head) + " |")
    speed: dict[str, list[float]] = {}
    state: dict[str, int] = {}
    for i, key in enumerate(args.texts.split(",")):
        label, rel = TEXTS[key]
        data = (SHARED / rel).read_bytes()[: args.limit]
        cells, curves = [], {}
        static_bpb = 0.0
        runs = [("static", {}), ("cache", {}), ("dynamic", {})] + [("sparse", {"adapter_units": k}) for k in sizes]
        for name, (mode, kw) in zip(head, runs, strict=True):
            rec, res = run_eval(ck, data, mode, **kw)
            bpb = rec["bits_per_byte"]
            if mode == "static":
                static_bpb = bpb
                cells.append(f"{bpb:.3f}")
            else:
                cells.append(f"{bpb:.3f} ({100 * (static_bpb - bpb) / static_bpb:+.1f}%)")
            speed.setdefault(name, []).append(rec["tokens_per_s"])
            state[name] = rec["state_bytes"]
            if i == 0 and name in ("static", "cache", "dynamic", f"sparse H={sizes[-1]}"):
                curves[name] = loss_curve(res.logprobs, 2000)
        print(f"| {label} | {xz_bpb(data):.3f} | {ppmd_bpb(data):.3f} | " + " | ".join(cells) + " |", flush=True)
        if i == 0 and args.plot:
            plot_curves(Path(args.plot), curves, f"{label}: loss against position")
    print()
    print("| mode | adapted state per stream (bytes) | vs model parameters | tokens/s (mean) | time vs static |")
    print("| --- | ---: | ---: | ---: | ---: |")
    static_speed = sum(speed["static"]) / len(speed["static"])
    for name in head:
        tps = sum(speed[name]) / len(speed[name])
        frac = state[name] / 4 / n_params
        print(f"| {name} | {state[name]:,} | {100 * frac:.2f}% | {tps:,.0f} | {static_speed / tps:.2f}x |")
    print()
    # batched sparse adaptation: B independent streams in one batch vs the same streams one at a time
    text = (SHARED / TEXTS["book"][1]).read_bytes()
    cfg = config_for("sparse", ck.dyneval)
    print(f"| streams | batched tokens/s | one at a time tokens/s | speed-up | ({args.stream_bytes} bytes each, "
          f"H={cfg.adapter_units}) |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for b in [] if args.no_batched else [int(s) for s in args.streams.split(",") if s]:
        texts = [text[j * args.stream_bytes : (j + 1) * args.stream_bytes] for j in range(b)]
        t0 = time.perf_counter()
        evaluate_many(ck.model, texts, cfg, stats=ck.stats, max_streams=b)
        batched = time.perf_counter() - t0
        one = min(b, 8)  # time a sample of single-stream runs and scale
        t0 = time.perf_counter()
        for t in texts[:one]:
            evaluate_many(ck.model, [t], cfg, stats=ck.stats)
        single = (time.perf_counter() - t0) * b / one
        total = b * args.stream_bytes
        print(f"| {b} | {total / batched:,.0f} | {total / single:,.0f} | {single / batched:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
