"""The session word cache's weight (dyneval.json "session" "cache_weight", models/wordcache.py) with the copy model
on, chosen by keystroke savings on held-out personal text that no benchmark types: SMS bytes 30-38 KB after the
file's first 30 KB (the keyboard benchmark types its last 20 KB), and a slice from the middle of the e-mails (bytes
1,030,000-1,038,000 after the 30 KB before them; the benchmarks use the file's first 100 KB and last 40 KB). Same
simulator as `bench.keyboard` (adaptlm_client.keysim), in this process: the session's sparse settings, the checkpoint's
copy model, 3 suggestions. A word model's suggestions are the server's (`word_suggestions`): for one, each weight
types through a session of a local `adaptlm serve` (adaptlm_client.keysim.SessionSuggester), warmed up afresh.

    python -m bench.cache_weight [--checkpoint DIR] [--texts sms,emails] [--weights 0,0.25,0.5,0.75,1] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy as copy_module
import dataclasses
import time
from pathlib import Path

from adaptlm_client import Client
from adaptlm_client.keysim import KeysimResult, SessionSuggester, messages, simulate, split_text
from bench._common import DEFAULT_CHECKPOINT, ROOT, data_file, machine_line
from bench.server import serve
from models.checkpoint import load_checkpoint
from models.copymodel import CopyModel
from models.keysim import ModelSuggester
from models.tokenizer import byte_level

SLICES = {  # name -> (file, warm-up start, typed start, typed end), bytes
    "sms": ("messages/sms_ham.train.txt", 0, 30_000, 38_000),
    "emails": ("messages/enron-farmer-d.first2672.txt", 1_000_000, 1_030_000, 1_038_000),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--texts", default=",".join(SLICES))
    ap.add_argument("--weights", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "cache_weight", help="server logs (word models)")
    args = ap.parse_args()
    ckpt = load_checkpoint(args.checkpoint)
    copy = CopyModel(ckpt.dyneval.copy) if ckpt.dyneval.copy is not None else None
    words = byte_level(ckpt.tokenizer) is None  # the in-process simulator runs the byte search
    print(f"# word-cache weight with the copy model {'on' if copy else 'off'}, {ckpt.name}"
          f"{' (through its server)' if words else ''}: {machine_line()}")
    print("| text | cache_weight | KSR | top-1 | top-3 | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")

    def row(name: str, weight: float, r: KeysimResult, start: float) -> None:
        summary = r.summary()
        print(f"| {name} | {weight:g} | {r.ksr:.4f} | {summary['top1_accuracy']:.3f} | {summary['top3_accuracy']:.3f} "
              f"| {time.perf_counter() - start:.0f} |", flush=True)

    for name in args.texts.split(","):
        rel, w0, t0, t1 = SLICES[name]
        data = data_file(rel).read_bytes()[w0:t1]
        warm, typed = split_text(data, last_bytes=t1 - t0)
        if words:  # the server's sessions, the session defaults but the weight
            args.out.mkdir(parents=True, exist_ok=True)
            with serve(args.checkpoint, args.out / f"{name}.server.log") as url, Client(url, timeout=600) as client:
                for weight in (float(w) for w in args.weights.split(",")):
                    start = time.perf_counter()
                    with SessionSuggester(client, cache_weight=weight) as suggester:
                        row(name, weight, simulate(suggester, messages(typed), k=3, warmup=messages(warm)), start)
            continue
        warmed = ModelSuggester(ckpt.model, ckpt.dyneval.session, stats=ckpt.stats, copy=copy)
        simulate(warmed, [], k=3, warmup=messages(warm))  # the session after the warm-up, once for every weight
        for weight in (float(w) for w in args.weights.split(",")):
            start = time.perf_counter()
            sim = copy_module.copy(warmed)  # the warmed session's record, its word cache at this weight; records
            sim.session = dataclasses.replace(  # never change (an observe makes a new one), so the two may share it
                warmed.session, config=warmed.sessions.config({"words": {"weight": weight}}), _views={})
            row(name, weight, simulate(sim, messages(typed), k=3), start)


if __name__ == "__main__":
    main()
