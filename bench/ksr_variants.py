"""Keystrokes saved by the session's learned part (issue 34): each variant of the learned part against the same session
with no weight learning (copy model + word cache only), typed in this process by the keystroke simulator
(`adaptlm_client.keysim.simulate`, Presage's KSR, 3 suggestions) with the engine's exact search (`models.keysim`,
as `bench.keyboard`'s in-process rows; a server's `--suggest-budget-ms 0`), on held-out slices only: the analysis
slices of `bench.keyboard_losses` (e-mails: typed from byte 1.53 MB, SMS: from byte 190 KB), never the keyboard
benchmark's typed texts.

    ADAPTLM_DATA=... OMP_NUM_THREADS=1 nice -n 19 python -m bench.ksr_variants [--texts emails,sms]
        [--variants none,head,head4x,head16x,headfast,M,full] [--warmup-bytes 16000] [--limit-bytes 8000]
        [--prose] [--out runs/ksr_variants] [--force] [--table-only]

Variants (session settings, `SessionModel.config`; every one keeps the checkpoint's copy model, word cache and
lexicon): `none` M and the head off (the `lr: 0` session); `M` the sparse adapter at the checkpoint's "session"
settings, head off; `head`, `head4x`, `head16x` the output rows' memory (models/adaptation/_head_memory.py) at
eta 6.912e-5 (its chosen rate, `bench.head_defaults`) times 1, 4 and 16, lambda 1e-4, M off; `headfast` the head
with a faster start, eta(n) = eta (1 + (F - 1) exp(-n / N)) after n bytes observed (F = 16, N = 4000: fixed
beforehand, not chosen on these texts), applied message by message (the bench sets the session's rate between
observes); `full` full dynamic evaluation (the checkpoint's "full" settings) with the copy model and the word cache
(`bench.keyboard`'s full-copy, the ceiling of weight learning). Each (text, variant) result goes to
OUT/<text>.<variant>.json as it finishes and is skipped on a later run unless --force; the table is printed from
every result present. `--prose` adds each session variant's bits on held-out prose (Persuasion bytes 20-40 KB, the
guard of `bench.head_defaults`) and its gain over `none`. CPU a keystroke: this thread's CPU time in `suggest`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adaptlm_client.keysim import messages, simulate, split_text
from bench._common import DEFAULT_CHECKPOINT, ROOT, data_file, machine_line
from bench.adapt_losses import HEAD_CHOICE
from bench.keyboard_losses import SLICES
from bench.session_defaults import TEXTS as CHOICE_TEXTS
from models.memory import State

HEAD_LR, HEAD_DECAY = HEAD_CHOICE["lr"], HEAD_CHOICE["decay"]
FAST_FACTOR, FAST_BYTES = 16.0, 4000.0
PROSE = CHOICE_TEXTS["prose"]  # the settings' guard (file, first byte, last byte)


def head(factor: float) -> dict[str, Any]:
    return {"adapter": None, "head": {"lr": HEAD_LR * factor, "decay": HEAD_DECAY}}


VARIANTS: dict[str, dict[str, Any] | None] = {  # name -> session settings (None: full dynamic evaluation)
    "none": {"adapter": None, "head": None},
    "M": {"adapter": {}, "head": None},
    "head": head(1),
    "head4x": head(4),
    "head16x": head(16),
    "headfast": head(1),
    "full": None,
}
WHAT = {
    "none": "no learned part (copy model + word cache; M and head off)",
    "M": "M, the sparse adapter, at the served rate (eta 1e-4, lambda 1e-3), head off",
    "head": f"head eta {HEAD_LR:g}, lambda {HEAD_DECAY:g}, M off",
    "head4x": f"head eta {4 * HEAD_LR:g}, lambda {HEAD_DECAY:g}, M off",
    "head16x": f"head eta {16 * HEAD_LR:g}, lambda {HEAD_DECAY:g}, M off",
    "headfast": f"head, faster start: eta x (1 + {FAST_FACTOR - 1:g} exp(-bytes / {FAST_BYTES:g})), M off",
    "full": "full dynamic evaluation + copy model + word cache (the ceiling)",
}


def fast_rate(observed: int) -> float:
    return HEAD_LR * (1 + (FAST_FACTOR - 1) * math.exp(-observed / FAST_BYTES))


class Timed:
    """A suggester whose `suggest` calls' thread CPU time is summed; `headfast` sets the head's rate before each
    observe from the bytes observed so far."""

    def __init__(self, inner: Any, fast: bool) -> None:
        self.inner, self.fast = inner, fast
        self.cpu, self.calls, self.observed = 0.0, 0, 0

    def suggest(self, context: str, k: int) -> list[str]:
        t0 = time.thread_time()
        out: list[str] = self.inner.suggest(context, k)
        self.cpu += time.thread_time() - t0
        self.calls += 1
        return out

    def observe(self, text: str) -> None:
        if self.fast:
            session = self.inner.session
            state = session.memories["head"]
            rate = torch.tensor([[fast_rate(self.observed), HEAD_DECAY]], dtype=torch.float64)
            memories = {**session.memories, "head": State({**state.tensors, "rate": rate})}
            self.inner.session = dataclasses.replace(session, memories=memories)
        self.inner.observe(text)
        self.observed += len(text.encode("utf-8"))


def slice_texts(name: str, warmup: int, limit: int) -> tuple[str, str]:
    rel, _, t0, t1 = SLICES[name]["analysis"]
    data = data_file(rel).read_bytes()[:t1]
    return split_text(data, last_bytes=t1 - t0, warmup_bytes=warmup, limit_bytes=limit)


def run(ckpt: Any, name: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from models.copymodel import CopyModel
    from models.keysim import ModelSuggester
    from models.session import SessionModel
    from trainer.evaluation import config_for

    warm, typed = slice_texts(name, args.warmup_bytes, args.limit_bytes)
    settings = VARIANTS[variant]
    if settings is None:
        config = config_for("dynamic", ckpt.dyneval)
        copy = CopyModel(ckpt.dyneval.copy) if ckpt.dyneval.copy is not None else None
        inner = ModelSuggester(ckpt.model, config, stats=ckpt.stats, cache_weight=ckpt.dyneval.cache_weight,
                               copy=copy, lexicon=ckpt.lexicon)
        record: dict[str, Any] = {"lr": config.lr, "decay": config.decay}
    else:
        inner = ModelSuggester(ckpt.model, sessions=SessionModel.of(ckpt), settings=settings, lexicon=ckpt.lexicon)
        record = {"settings": {k: (v.model_dump() if v is not None else None)
                               for k, v in inner.session.config.memories.items()}}
    sim = Timed(inner, variant == "headfast")
    t0, c0 = time.perf_counter(), time.process_time()

    def progress(r: Any) -> None:
        if r.messages % 50 == 0:
            print(f"  {name}/{variant}: {r.messages} messages, {r.chars:,} chars, KSR {r.ksr:.4f}, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    with torch.no_grad():
        result = simulate(sim, messages(typed), k=3, warmup=messages(warm), on_message=progress)
    record.update({"text": name, "variant": variant, "warmup_bytes": len(warm.encode()),
                   "typed_bytes": len(typed.encode()), "ksr": result.ksr, "chars": result.chars,
                   "typed": result.typed, "selections": result.selections,
                   "cpu_ms_a_keystroke": 1000 * sim.cpu / max(sim.calls, 1), "suggestions": sim.calls,
                   "process_cpu_s": time.process_time() - c0, "seconds": time.perf_counter() - t0,
                   "machine": machine_line()})
    return record


def prose_bits(ckpt: Any, variant: str) -> float | None:
    """Bits a byte a fresh session of the variant scores on the held-out prose (each segment before its update)."""
    from models.session import SessionModel

    settings = VARIANTS[variant]
    if settings is None:
        return None
    sm = SessionModel.of(ckpt)
    rel, a, b = PROSE
    data = data_file(rel).read_bytes()[a:b]
    session = sm.fresh(sm.config(settings))
    if variant == "headfast":  # the schedule at segment granularity is not in the memory: observe in 200-byte pieces
        bits, n = 0.0, 0
        for i in range(0, len(data), 200):
            state = session.memories["head"]
            rate = torch.tensor([[fast_rate(n), HEAD_DECAY]], dtype=torch.float64)
            session = dataclasses.replace(session, memories={**session.memories,
                                                             "head": State({**state.tensors, "rate": rate})})
            before = session.stats.bits
            session = sm.observe(session, data[i:i + 200], shadow=False)
            bits += session.stats.bits - before
            n += len(data[i:i + 200])
        return bits / len(data)
    return float(sm.observe(session, data, shadow=False).stats.bits) / len(data)


def table(out: Path, names: list[str], variants: list[str]) -> None:
    res = {}
    for p in out.glob("*.json"):
        r = json.loads(p.read_text())
        res[r.get("text"), r.get("variant")] = r
    prose = json.loads((out / "prose.json").read_text()) if (out / "prose.json").exists() else {}
    print("| variant | what changed | " + " | ".join(f"KSR {n} (vs none)" for n in names)
          + " | prose bpb (gain vs none) | CPU ms a keystroke |")
    print("| --- | --- | " + " | ".join("---:" for _ in names) + " | ---: | ---: |")
    for v in variants:
        cells = []
        for n in names:
            r, base = res.get((n, v)), res.get((n, "none"))
            cells.append("" if r is None else f"{r['ksr']:.4f}" + (
                f" ({100 * (r['ksr'] - base['ksr']):+.2f})" if base is not None and v != "none" else ""))
        pb, p0 = prose.get(v), prose.get("none")
        pcell = "" if pb is None else f"{pb:.4f}" + (f" ({100 * (1 - pb / p0):+.1f}%)" if p0 and v != "none" else "")
        cpu = [res[n, v]["cpu_ms_a_keystroke"] for n in names if (n, v) in res]
        print(f"| {v} | {WHAT[v]} | " + " | ".join(cells) + f" | {pcell} | "
              + (f"{sum(cpu) / len(cpu):.0f}" if cpu else "") + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--texts", default="emails,sms")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--warmup-bytes", type=int, default=16_000)
    ap.add_argument("--limit-bytes", type=int, default=8_000)
    ap.add_argument("--prose", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "ksr_variants")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    names, variants = args.texts.split(","), args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        from models.checkpoint import load_checkpoint

        torch.set_num_threads(1)
        ckpt = load_checkpoint(args.checkpoint)
        if args.prose:
            path = args.out / "prose.json"
            prose = json.loads(path.read_text()) if path.exists() else {}
            for v in variants:
                if v not in prose or args.force:
                    bits = prose_bits(ckpt, v)
                    if bits is not None:
                        prose[v] = bits
                        path.write_text(json.dumps(prose, indent=1))
                        print(f"prose {v}: {bits:.4f} bpb", flush=True)
        for n in names:
            for v in variants:
                path = args.out / f"{n}.{v}.json"
                if path.exists() and not args.force:
                    continue
                r = run(ckpt, n, v, args)
                path.write_text(json.dumps(r, indent=1))
                print(f"{n}/{v}: KSR {r['ksr']:.4f}, {r['cpu_ms_a_keystroke']:.0f} ms CPU a keystroke, "
                      f"{r['seconds']:.0f} s", flush=True)
    table(args.out, names, variants)


if __name__ == "__main__":
    main()
