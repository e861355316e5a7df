"""Observes of many sessions with and without session slots (server/engine/_slots.py), side by side in one process:
the engine's observe path (`SessionModel.start`, batched `step`s, `observed`; the slots' acquire and commit), CPU
seconds per round of `--sessions` observes of `--bytes` each, the two alternating round by round.

    python -m bench.session_slots [--checkpoint DIR] [--sessions 32] [--bytes 100] [--rounds 6]
                                  [--precision auto] [--memories adapter]

`--memories`: the sessions' memories asked on (a comma list among the checkpoint's; the others at their defaults),
e.g. `head` for the output rows' delta, `adapter:size=512` for M of another k.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from bench._common import DEFAULT_CHECKPOINT, data_file, machine_line
from models.base import State
from models.checkpoint import load_checkpoint
from models.precision import inference_precision, resolve_precision
from models.session import Session, SessionModel
from server.engine._slots import SessionSlots


def _asked(spec: str) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for item in filter(None, spec.split(",")):
        name, _, rest = item.partition(":")
        settings: dict[str, Any] = {}
        for pair in filter(None, rest.split(";")):
            key, _, value = pair.partition("=")
            settings[key] = int(value) if value.isdigit() else float(value)
        out[name] = settings
    return out


def _round(model: SessionModel, sessions: list[Session], texts: list[bytes], slots: SessionSlots | None,
           tag: str) -> list[Session]:
    started = []
    for s, text in zip(sessions, texts, strict=True):
        view = slots.acquire(s) if slots is not None else None
        started.append((s, model.start(view or s, text, "observe", resident=view is not None)))
    while not all(o.job.done for _, o in started):
        model.step([o.job for _, o in started if not o.job.done])
    out = []
    for s, o in started:
        record = dataclasses.replace(model.observed(s, o, 0.0, 0.0), revision=f"{tag}{s.id}")
        if slots is not None:
            slots.commit(s.id, record.revision)
        out.append(record)
    return out


def _states(x: Session, y: Session) -> list[tuple[State, State]]:
    """Two records' states and memory states, pair by pair."""
    pairs = [(x.state, y.state), (x.static_state, y.static_state)]
    return pairs + [(s, y.memories[n]) for n, s in x.memories.items() if isinstance(s, State)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--bytes", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--memories", default="")
    args = ap.parse_args()
    ckpt = load_checkpoint(args.checkpoint)
    model = SessionModel.of(ckpt)
    config = model.config(_asked(args.memories))
    corpus = data_file("messages/sms_ham.train.txt").read_bytes()
    precision = resolve_precision(args.precision, ckpt.device, bf16_model=ckpt.model.bf16_inference)
    n, size = args.sessions, args.bytes
    systems: dict[str, tuple[list[Session], SessionSlots | None]] = {}
    for name, slots in (("off", None), ("slots", SessionSlots(n, ckpt.device))):
        fresh = [dataclasses.replace(model.fresh(config, id=f"s{i}"), revision="r") for i in range(n)]
        systems[name] = (fresh, slots)
    spent = {name: 0.0 for name in systems}
    with inference_precision(precision, ckpt.device):
        for r in range(args.rounds + 1):  # round 0 warms up (and fills the slots: every observe a miss)
            at = r * n * size
            texts = [corpus[(at + i * size) % (len(corpus) - size):][:size] for i in range(n)]
            for name in (list(systems) if r % 2 else list(reversed(systems))):
                sessions, slots = systems[name]
                began = time.process_time()
                sessions = _round(model, sessions, texts, slots, f"{r}")
                if r:
                    spent[name] += time.process_time() - began
                systems[name] = (sessions, slots)
    a, b = systems["off"][0], systems["slots"][0]
    same = all(torch.equal(s.tensors[k], t.tensors[k]) for x, y in zip(a, b, strict=True)
               for s, t in _states(x, y) for k in s.tensors)
    print(machine_line())
    print(f"{n} sessions x {size} bytes, {args.rounds} rounds, precision {precision}, memories "
          f"{', '.join(config.memories)}; segment {model.segment}")
    for name, seconds in spent.items():
        print(f"  {name:6s} {seconds / args.rounds * 1000:8.1f} ms CPU a round")
    print(f"  slots/off {spent['slots'] / spent['off']:.3f}; records' tensors equal: {same}; "
          f"slots {systems['slots'][1].stats() if systems['slots'][1] else None}")


if __name__ == "__main__":
    main()
