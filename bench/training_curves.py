"""Validation bits per byte against training minutes, from the JSON-lines logs of `adaptlm train`.

    python -m bench.training_curves checkpoints/default/train.jsonl runs/h512/train.jsonl [--every 10]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(path: Path) -> list[tuple[float, int, float]]:
    """-> [(minutes, step, valid_bpb)] of every validation in the log."""
    points = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "valid_bpb" in rec and "step" in rec:
            points.append((rec["seconds"] / 60, rec["step"], rec["valid_bpb"]))
    return points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--every", type=float, default=10.0, help="report the latest validation at each N minutes")
    args = ap.parse_args()
    curves = {p: curve(p) for p in args.logs}
    horizon = max((c[-1][0] for c in curves.values() if c), default=0.0)
    marks = [args.every * k for k in range(1, int(horizon // args.every) + 2)]
    print("| minutes | " + " | ".join(str(p.parent.name) for p in args.logs) + " |")
    print("| ---: | " + " | ".join("---:" for _ in args.logs) + " |")
    for m in marks:
        cells = []
        for p in args.logs:
            seen = [pt for pt in curves[p] if pt[0] <= m]
            cells.append(f"{seen[-1][2]:.3f} (step {seen[-1][1]})" if seen else "")
        print(f"| {m:.0f} | " + " | ".join(cells) + " |")
    for p, c in curves.items():
        if c:
            best = min(c, key=lambda pt: pt[2])
            print(f"\n{p}: best {best[2]:.3f} bits per byte at step {best[1]} ({best[0]:.1f} min)")


if __name__ == "__main__":
    main()
