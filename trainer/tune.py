"""Tuning dynamic evaluation on validation text (thesis sec. 4.5): the learning rate first, then the decay; and the
neural cache's theta and lambda at a window (Merity et al. 2018, sec. 7, tune them on validation data;
docs/algorithms.md §4).

The thesis raises eta from a low value by x1.2 until validation stops improving. To spend fewer
trials we first bracket the best eta with x2 steps from `lr_start`, then walk x1.2 up from half the
bracketed best until validation stops improving; then lambda is chosen from a grid at that eta.
The cache is a grid (`tune_cache`): every (theta, lambda) of THETA_GRID x LAMBDA_GRID on the static model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from models.adaptation import CacheConfig, DynEvalConfig, evaluate
from models.base import LanguageModel
from models.tokenizer import Tokenizer

__all__ = ["DECAY_GRID", "LAMBDA_GRID", "THETA_GRID", "tune_cache", "tune_mode"]

DECAY_GRID = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
THETA_GRID = (0.1, 0.3, 1.0, 3.0)
LAMBDA_GRID = (0.02, 0.05, 0.1, 0.2, 0.3)


def tune_mode(model: LanguageModel, stats: dict[str, torch.Tensor], data: bytes, base: DynEvalConfig, *,
              lr_start: float = 1e-5, max_trials: int = 40, tokenizer: Tokenizer | None = None,
              on_trial: Callable[[dict[str, Any]], None] | None = None) -> tuple[DynEvalConfig, list[dict[str, Any]]]:
    """-> (best config, every trial as {"lr", "decay", "bits_per_byte", "seconds"})."""
    trials: list[dict[str, Any]] = []
    scored: dict[tuple[float, float], tuple[DynEvalConfig, float]] = {}

    def score(cfg: DynEvalConfig) -> float:
        key = (round(cfg.lr, 12), round(cfg.decay, 12))
        if key not in scored:
            t0 = time.perf_counter()
            bpb = evaluate(model, data, cfg, stats=stats, tokenizer=tokenizer).bits_per_byte
            scored[key] = (cfg, bpb)
            trial = {"lr": cfg.lr, "decay": cfg.decay, "bits_per_byte": bpb, "seconds": time.perf_counter() - t0}
            trials.append(trial)
            if on_trial:
                on_trial(trial)
        return scored[key][1]

    def best() -> DynEvalConfig:
        return min(scored.values(), key=lambda cb: cb[1])[0]

    def climb(cfg: DynEvalConfig, factor: float) -> None:
        current = score(cfg)
        while len(trials) < max_trials:
            cfg = replace(cfg, lr=cfg.lr * factor)
            bpb = score(cfg)
            if bpb >= current:
                return
            current = bpb

    climb(replace(base, lr=lr_start), 2.0)  # bracket
    climb(replace(best(), lr=best().lr / 2), 1.2)  # thesis: x1.2 until validation stops improving
    at_lr = best()
    for decay in DECAY_GRID:
        if len(trials) >= max_trials:
            break
        score(replace(at_lr, decay=decay))
    return best(), trials


def tune_cache(model: LanguageModel, data: bytes, window: int, *, tokenizer: Tokenizer | None = None,
               thetas: tuple[float, ...] = THETA_GRID, lambdas: tuple[float, ...] = LAMBDA_GRID,
               on_trial: Callable[[dict[str, Any]], None] | None = None) -> tuple[CacheConfig, list[dict[str, Any]]]:
    """The neural cache's (theta, lambda) at `window` by a grid on the static model -> (best, every trial as
    {"window", "theta", "lam", "bits_per_byte", "seconds"}); lambda 0 (the model alone) is the first trial, so the
    best is never worse than no cache."""
    trials: list[dict[str, Any]] = []
    best: tuple[float, CacheConfig] | None = None
    grid = [(thetas[0], 0.0)] + [(t, lam) for t in thetas for lam in lambdas]
    for theta, lam in grid:
        cache = CacheConfig(window=window, theta=theta, lam=lam)
        t0 = time.perf_counter()
        bpb = evaluate(model, data, DynEvalConfig(mode="static", cache=cache), tokenizer=tokenizer).bits_per_byte
        trial = {"window": window, "theta": theta, "lam": lam, "bits_per_byte": bpb,
                 "seconds": time.perf_counter() - t0}
        trials.append(trial)
        if on_trial:
            on_trial(trial)
        if best is None or bpb < best[0]:
            best = (bpb, cache)
    assert best is not None
    return best[1], trials
