"""The copy model's cost in a keyboard search (models/copymodel.py `mix_frozen`, kernels/copy_scan.py): one step
of B branches that all read one session's copy model, after the session has read 30 KB of e-mails, in microseconds
per step and per branch-step; and the one-off cost of what a search builds first (`frozen_stats`: the pair index).
The network's log-probabilities do not change the work, so they are uniform here.

    python -m bench.copy_search [--bytes 30000] [--rows 8,80] [--steps 200]

The branches continue from contexts cut out of the session's own text (so that their matches are long, as a
returning user's are) and feed the bytes that followed each: the work of a search that keeps finding the history.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench._common import data_file, machine_line
from models.base import State
from models.copymodel import CopyConfig, CopyModel, branch_view

TEXT = "messages/enron-farmer-d.first2672.txt"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=30_000, help="what the session has read")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 80])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# copy model in a search: {machine_line()}, a session that has read {args.bytes:,} bytes "
          f"of {TEXT}")
    data = data_file(TEXT).read_bytes()[: args.bytes + 4096]
    model = CopyModel(CopyConfig(window=32768))
    n = args.bytes
    uniform = torch.full((1, n, 256), -math.log(256))
    _, state = model.mix(uniform, torch.tensor([[10, *data[: n - 1]]]), model.init_state(1))
    try:  # the pair index (since it exists); before it the frozen path read STATS alone
        from models.copymodel import frozen_stats  # noqa: PLC0415
    except ImportError:
        from models.copymodel import STATS  # noqa: PLC0415

        def frozen_stats(s: State) -> State:
            return State({k: s.tensors[k] for k in STATS})
    frozen_stats(state)
    t0 = time.perf_counter()
    for _ in range(20):
        stats = frozen_stats(state)
    print(f"what a search builds first (frozen_stats): {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms")
    print("| branches | us per step | us per branch-step |")
    print("| ---: | ---: | ---: |")
    view = branch_view(state)
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        # each branch: the last 254 bytes before a random point of the text it read, then the bytes after it
        cuts = torch.randint(300, n - 8, (rows,), generator=g).tolist()
        ctx = torch.stack([torch.tensor(list(data[c - 254 : c]), dtype=torch.uint8) for c in cuts])  # (B, 254)
        ctxlen = torch.full((rows,), 254, dtype=view.tensors["ctxlen"].dtype)
        index = torch.zeros(rows, dtype=torch.long)
        lp = torch.full((rows, 1, 256), -math.log(256))
        total, steps = 0.0, 0
        for k in range(8):  # 8 bytes along each branch, args.steps times over
            x = torch.tensor([[data[c + k]] for c in cuts])  # (B, 1)
            model.mix_frozen(lp, x, ctx, ctxlen, stats, index)  # compiled, caches warm
            t0 = time.perf_counter()
            for _ in range(args.steps // 8):
                model.mix_frozen(lp, x, ctx, ctxlen, stats, index)
            total += time.perf_counter() - t0
            steps += args.steps // 8
            _, ctx, ctxlen = model.mix_frozen(lp, x, ctx, ctxlen, stats, index)
        us = total / steps * 1e6
        print(f"| {rows} | {us:,.0f} | {us / rows:.1f} |", flush=True)


if __name__ == "__main__":
    main()
