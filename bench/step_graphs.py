"""The default mLSTM's no-gradient step with the bucketed static-shape runner (models/step_graphs.py) against the
model's own path, side by side in one process: milliseconds a call and their ratio, for scoring segments, a peek's
per-row adapters and the keyboard search's one-byte steps with per-session adapters. On a CUDA device the runner
replays CUDA graphs (wall time after a synchronisation); on a CPU it runs the padded path eagerly (CPU time).

    OMP_NUM_THREADS=1 python -m bench.step_graphs [--device cuda] [--rows 3,8,20] [--search-rows 24,48] [--repeat 5]

bench/gpu_serve.sh runs it on the GPU (rows up to 2,048).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench._common import DEFAULT_CHECKPOINT, machine_line
from models.base import Adapter, State
from models.checkpoint import load_checkpoint
from models.mlstm import MLSTM
from models.step_graphs import StepRunner


def _case(model: MLSTM, B: int, T: int, form: str, sessions: int = 1) -> tuple[torch.Tensor, State, Adapter | None]:
    device = next(model.parameters()).device
    H = model.config.hidden
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, 256, (B, T), generator=g, device=device)
    state = State({"h": torch.randn(B, H, generator=g, device=device) * 0.1,
                   "c": torch.randn(B, H, generator=g, device=device) * 0.1})
    if form == "rows":
        return tokens, state, Adapter({"h": torch.randn(B, H, H, generator=g, device=device) * 0.01})
    if form == "groups":
        counts = [B // sessions] * sessions
        counts[-1] += B - sum(counts)
        return tokens, state, Adapter({"h": torch.randn(sessions, H, H, generator=g, device=device) * 0.01},
                                      counts=tuple(counts))
    return tokens, state, None


def _timed(model: MLSTM, runner: StepRunner | None, args: tuple[torch.Tensor, State, Adapter | None],
           repeat: int) -> float:
    """Seconds a call: CPU time on a CPU, wall time with the device synchronised on CUDA."""
    cuda = args[0].is_cuda
    clock: Callable[[], float] = time.perf_counter if cuda else time.process_time
    model.step_runner = runner
    try:
        with torch.no_grad():
            model(*args)  # warm-up (and the graphs' capture)
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            for _ in range(repeat):
                model(*args)
            if cuda:
                torch.cuda.synchronize()
            return (clock() - start) / repeat
    finally:
        model.step_runner = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[3, 8, 20])
    ap.add_argument("--search-rows", type=lambda s: [int(x) for x in s.split(",")], default=[24, 48])
    ap.add_argument("--static-steps", type=int, default=1024, help="a static score's segment")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    model = load_checkpoint(args.checkpoint, device=args.device).model
    assert isinstance(model, MLSTM)
    cuda = model.w_mh.v.is_cuda
    runner = StepRunner(model, graphs=cuda, max_rows=max([*args.rows, *args.search_rows, 1]) * 2)
    cases: list[tuple[str, tuple[torch.Tensor, State, Adapter | None], int]] = []
    for B in args.rows:
        cases.append((f"score {B} rows x 20 steps", _case(model, B, 20, "none"), args.repeat))
        if B <= 256:  # the model's own path holds (B, T, 4H) input projections: 3 GB at 256 rows of 1,024 steps
            cases.append((f"static score {B} rows x {args.static_steps} steps",
                          _case(model, B, args.static_steps, "none"), max(1, args.repeat // 5)))
        if B <= 64:  # (B, H, H) per-row adapters
            cases.append((f"peek {B} rows x 20 steps, per-row adapters", _case(model, B, 20, "rows"), args.repeat))
    for B in args.search_rows:
        cases.append((f"search step {B} rows of {max(1, B // 12)} sessions", _case(model, B, 1, "groups",
                                                                                  max(1, B // 12)), 4 * args.repeat))
    print(f"# {machine_line()}; {args.checkpoint} on {args.device}; "
          f"{'CUDA graphs' if cuda else 'the padded path eagerly'} against the model's own path, interleaved")
    print("| step | own ms | bucketed ms | bucketed / own |\n| --- | ---: | ---: | ---: |")
    for name, inputs, repeat in cases:
        own = (_timed(model, None, inputs, repeat) + _timed(model, None, inputs, repeat)) / 2
        bucketed = (_timed(model, runner, inputs, repeat) + _timed(model, runner, inputs, repeat)) / 2
        print(f"| {name} | {own * 1e3:.2f} | {bucketed * 1e3:.2f} | {bucketed / own:.2f}x |", flush=True)
    print(f"\n{runner.captured} graphs captured, {runner.declined} calls left to the model's own path")


if __name__ == "__main__":
    main()
