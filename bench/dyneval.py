"""Dynamic-evaluation tables: bits per byte of static, neural cache, full and sparse dynamic evaluation
on several texts, next to xz -9e and 7-Zip PPMd; adapted state per stream; speed; batched sparse throughput.

    python -m bench.dyneval [--checkpoint DIR] [--limit 100000] [--texts book,spanish,...]
                            [--sizes 64,128,256,512] [--streams 1,8,32,128] [--plot docs/img/dyneval.png]
                            [--copy] [--modes static,session,session+copy,...]

Every mode uses the checkpoint's tuned settings (dyneval.json); run `adaptlm tune` first. Modes (columns): static,
cache, full, sparse (one column per adapter size), session (sparse with the "session" settings, as sessions are
served), and static+copy, session+copy, full+copy: the same with the copy model (models/copymodel.py, dyneval.json
"copy", `python -m bench.copy_defaults`) mixed in. `--copy` adds session and the three copy modes to the default
columns; `--modes` picks the columns.
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

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.adaptation import DynEvalConfig, evaluate_many
from models.checkpoint import Checkpoint, load_checkpoint
from models.copymodel import CopyConfig, CopyModel
from trainer.evaluation import config_for, loss_curve, plot_curves

TEXTS = {
    "book": ("unseen book (chesterton-brown)", "gutenberg/chesterton-brown.txt"),
    "spanish": ("Spanish (quijote-part1)", "spanish/quijote-part1.txt"),
    "emails": ("e-mails (enron-farmer-d)", "messages/enron-farmer-d.first2672.txt"),
    "code": ("C code (linux.valid)", "code/linux.valid.txt"),
    "enwik8": ("enwik8 (Wikipedia XML)", "enwik8/enwik8.head950k"),
}
MODES = ("static", "cache", "full", "sparse", "session", "static+copy", "session+copy", "full+copy")
DEFAULT_MODES = "static,cache,full,sparse"
COPY_MODES = "session,static+copy,session+copy,full+copy"


def copy_config(ck: Checkpoint) -> CopyConfig:
    """The checkpoint's copy-model settings (dyneval.json "copy"), the defaults where it has none."""
    section = ck.dyneval.get("copy")
    return CopyConfig.from_dict(section) if section else CopyConfig()


def columns(ck: Checkpoint, modes: list[str], sizes: list[int]) -> list[tuple[str, DynEvalConfig, bool]]:
    """-> (header, settings, with the copy model) for each column."""
    out = []
    for mode in modes:
        base, copy = mode.removesuffix("+copy"), mode.endswith("+copy")
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        if base == "sparse":
            out += [(f"sparse H={k}", config_for("sparse", ck.dyneval, adapter_units=k), False) for k in sizes]
        elif base == "session":
            out.append((mode.replace("+", " + "), ck.dyneval.session, copy))
        else:
            name = "dynamic" if base == "full" else base  # `adaptlm eval`'s name for full dynamic evaluation
            out.append((mode.replace("+", " + "), config_for(name, ck.dyneval), copy))
    return out


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
    ap.add_argument("--copy", action="store_true", help=f"add the columns {COPY_MODES}")
    ap.add_argument("--modes", help=f"the columns, from {', '.join(MODES)} (default {DEFAULT_MODES})")
    args = ap.parse_args()
    ck = load_checkpoint(args.checkpoint)
    training_only = set(ck.model.training_only_parameters())  # never read at inference (zero-filled if not shipped)
    n_params = sum(p.numel() for n, p in ck.model.named_parameters() if n not in training_only)
    site = max(site.dim for site in ck.model.adaptation_sites())
    sizes = [int(s) for s in args.sizes.split(",") if s and int(s) <= site]  # sizes beyond the site do not exist
    print(f"# dynamic evaluation, {ck.name} ({n_params:,} parameters): {machine_line()}")
    modes = (args.modes or DEFAULT_MODES + ("," + COPY_MODES if args.copy else "")).split(",")
    cols = columns(ck, [m for m in modes if m], sizes)
    copy = CopyModel(copy_config(ck), ck.config.vocab_size) if any(c for _, _, c in cols) else None
    copy_bytes = sum(t.numel() * t.element_size() for t in copy.init_state(1).tensors.values()) if copy else 0
    print(f"settings: { {k: v for k, v in ck.dyneval.items() if k != 'copy'} }")
    print(f"session: {ck.dyneval.session}")
    if copy is not None:
        print(f"copy: {copy.config.to_dict() | {'weights': 'prior' if copy.config.weights else 'none'}}")
    print()
    head = [name for name, _, _ in cols]
    print("| text | xz -9e | PPMd o8 | " + " | ".join(head) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in head) + " |")
    speed: dict[str, list[float]] = {}
    state: dict[str, int] = {}
    for i, key in enumerate(args.texts.split(",")):
        label, rel = TEXTS[key]
        data = data_file(rel).read_bytes()[: args.limit]
        cells, curves = [], {}
        static_bpb = None
        for name, cfg, with_copy in cols:
            res = evaluate_many(ck.model, [data], cfg, stats=ck.stats, tokenizer=ck.tokenizer,
                                copy=copy if with_copy else None)[0]
            bpb = res.bits_per_byte
            if name == "static":
                static_bpb = bpb
            if static_bpb is None or name == "static":
                cells.append(f"{bpb:.3f}")
            else:
                cells.append(f"{bpb:.3f} ({100 * (static_bpb - bpb) / static_bpb:+.1f}%)")
            speed.setdefault(name, []).append(res.tokens / max(res.seconds, 1e-9))  # a word model's: words
            state[name] = res.state_bytes + (copy_bytes if with_copy else 0)
            if i == 0:
                curves[name] = loss_curve(res.logprobs, 2000)
        print(f"| {label} | {xz_bpb(data):.3f} | {ppmd_bpb(data):.3f} | " + " | ".join(cells) + " |", flush=True)
        if i == 0 and args.plot:
            plot_curves(Path(args.plot), curves, f"{label}: loss against position")
    print()
    print("| mode | adapted state per stream (bytes) | vs model parameters | tokens/s (mean) | time vs static |")
    print("| --- | ---: | ---: | ---: | ---: |")
    static_speed = sum(speed["static"]) / len(speed["static"]) if "static" in speed else float("nan")
    for name in head:
        tps = sum(speed[name]) / len(speed[name])
        frac = state[name] / 4 / n_params  # bytes against the float32 parameters' bytes
        print(f"| {name} | {state[name]:,} | {100 * frac:.2f}% | {tps:,.0f} | {static_speed / tps:.2f}x |")
    if args.no_batched:
        return
    print()
    # batched sparse adaptation: B independent streams in one batch vs the same streams one at a time
    text = data_file(TEXTS["book"][1]).read_bytes()
    cfg = config_for("sparse", ck.dyneval)
    print(f"| streams | batched tokens/s | one at a time tokens/s | speed-up | ({args.stream_bytes} bytes each, "
          f"H={cfg.adapter_units}) |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for b in [int(s) for s in args.streams.split(",") if s]:
        texts = [text[j * args.stream_bytes : (j + 1) * args.stream_bytes] for j in range(b)]
        t0 = time.perf_counter()
        total = sum(r.tokens for r in evaluate_many(ck.model, texts, cfg, stats=ck.stats, max_streams=b,
                                                    tokenizer=ck.tokenizer))
        batched = time.perf_counter() - t0
        one = min(b, 8)  # time a sample of single-stream runs and scale (tokens per second of the sample)
        t0 = time.perf_counter()
        sample = sum(evaluate_many(ck.model, [t], cfg, stats=ck.stats, tokenizer=ck.tokenizer)[0].tokens
                     for t in texts[:one])
        single = time.perf_counter() - t0
        rate, alone = total / batched, sample / single
        print(f"| {b} | {rate:,.0f} | {alone:,.0f} | {rate / alone:.2f}x | |", flush=True)


if __name__ == "__main__":
    main()
