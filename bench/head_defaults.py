"""The grid behind the output rows' session memory (models/adaptation/_head_memory.py; dyneval.json "head"): its rate
eta and decay lambda, and whether the sparse adapter M stays on beside it, chosen on the held-out personal text of
bench/session_defaults.py (the first 30 KB of SMS messages; the keyboard benchmark uses the file's last 20 KB) with
in-domain prose as a guard (Persuasion bytes 20-40 KB).

    ADAPTLM_DATA=... python -m bench.head_defaults [--checkpoint DIR] [--lrs 3.456e-5,6.912e-5,...]
        [--decays 1e-4] [--with-adapter 6.912e-5,...] [--decay-grid 6.912e-5:0,1e-3]

Every setting is a session as the server runs one (`SessionModel`, its batched step, the copy model and every memory
of the checkpoint's defaults), observing the text from a fresh start; the figures are the bits it scored (each
segment before the update it caused). Rows: static + copy (nothing learned), the session with M (the "session"
settings, served before the head), then the head memory with M off at each rate and decay, and with M on at the rates
of --with-adapter (each row names both memories, whichever the checkpoint serves by default).
The choice: the best SMS bits among the settings with a decay (lambda > 0: a long-lived session's delta must not
drift without bound, as the "session" section keeps lambda 1e-3 for M) that do not hurt prose (no more bits than
static + copy there); cost is CPU time a byte relative to static + copy in the same run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from bench.session_defaults import TEXTS
from models.checkpoint import load_checkpoint
from models.session import SessionModel


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def observe(sm: SessionModel, asked: dict[str, Any], data: bytes) -> tuple[float, float, int]:
    """A fresh session of `asked` observes `data` -> (bits per byte, CPU seconds, session bytes)."""
    session = sm.fresh(sm.config(asked))
    t0 = time.process_time()
    after = sm.observe(session, data, shadow=False)
    return after.stats.bits / len(data), time.process_time() - t0, after.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--lrs", type=floats, default=[3.456e-5, 6.912e-5, 1.3824e-4, 2.7648e-4])
    ap.add_argument("--decays", type=floats, default=[1e-4])
    ap.add_argument("--decay-grid", default="6.912e-5:0,1e-3",
                    help="LR:DECAY,DECAY...: more decays at one rate (M off)")
    ap.add_argument("--with-adapter", type=floats, default=[6.912e-5, 1.3824e-4],
                    help="rates of the head memory beside M (the session's settings), decay the first of --decays")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ck = load_checkpoint(args.checkpoint)
    sm = SessionModel.of(ck)
    if "head" not in sm.memories:
        raise SystemExit(f"{ck.name} cannot serve the head memory (a weight-normalised output layer and its MS_g)")
    data = {name: data_file(rel).read_bytes()[a:b] for name, (rel, a, b) in TEXTS.items()}
    rows: list[tuple[str, dict[str, Any]]] = [("static + copy", {"adapter": None, "head": None}),
                                              ("session with M", {"adapter": {}, "head": None})]
    grid = [(lr, d) for lr in args.lrs for d in args.decays]
    at, _, more = args.decay_grid.partition(":")
    grid += [(float(at), d) for d in floats(more) if (float(at), d) not in grid]
    rows += [(f"head eta {lr:g} lambda {d:g}", {"adapter": None, "head": {"lr": lr, "decay": d}}) for lr, d in grid]
    rows += [(f"M + head eta {lr:g} lambda {args.decays[0]:g}",
              {"adapter": {}, "head": {"lr": lr, "decay": args.decays[0]}})
             for lr in args.with_adapter]
    print(f"# head memory grid, {ck.name}: {machine_line()}")
    names = list(data)
    print("| setting | " + " | ".join(f"{n} bpb | vs static + copy | vs session with M" for n in names)
          + " | time vs static + copy | session bytes |")
    print("| --- | " + " | ".join("---: | ---: | ---:" for _ in names) + " | ---: | ---: |", flush=True)
    ref: dict[str, dict[str, float]] = {}
    base_rate = 0.0
    for label, asked in rows:
        cells, seconds, size = [], 0.0, 0
        bits = {}
        for name in names:
            bpb, s, size = observe(sm, asked, data[name])
            bits[name], seconds = bpb, seconds + s
        rate = seconds / sum(len(d) for d in data.values())
        if label == "static + copy":
            base_rate = rate
        ref[label] = bits
        for name in names:
            static, served = ref["static + copy"][name], ref.get("session with M", {}).get(name)
            cells.append(f"{bits[name]:.4f} | {100 * (1 - bits[name] / static):+.1f}% | "
                         + (f"{100 * (1 - bits[name] / served):+.1f}%" if served else ""))
        print(f"| {label} | " + " | ".join(cells) + f" | {rate / base_rate:.2f}x | {size:,} |", flush=True)
    unadapted = ref["static + copy"]
    fit = {k: v for k, v in ref.items() if "head" in k and not k.endswith("lambda 0")
           and v["prose"] <= unadapted["prose"]}
    if fit:
        best = min(fit, key=lambda k: fit[k]["SMS"])
        print(f"\nchosen: {best} (SMS {fit[best]['SMS']:.4f}, prose {fit[best]['prose']:.4f} bpb)")
    else:
        print("\nno head setting leaves prose unhurt")


if __name__ == "__main__":
    main()
