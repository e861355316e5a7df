"""Evaluation modes as users name them, loss-against-position curves, CSV and plots (thesis fig. 5.2)."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from models.adaptation import EVAL_MODES, DynEvalConfig, DynEvalSettings, EvalResult, evaluate
from models.checkpoint import Checkpoint
from models.scoring import LN2

__all__ = ["EVAL_MODES", "config_for", "loss_curve", "plot_curves", "run_eval", "write_curves_csv"]
def config_for(mode: str, dyneval: Mapping[str, Any], **overrides: Any) -> DynEvalConfig:
    """The checkpoint's (tuned) settings for `mode`, with `overrides` (None values ignored) on top."""
    settings = dyneval if isinstance(dyneval, DynEvalSettings) else DynEvalSettings(dyneval)
    return settings.config(mode, **overrides)


def run_eval(ckpt: Checkpoint, data: bytes, mode: str, **overrides: Any) -> tuple[dict[str, Any], EvalResult]:
    """-> (the JSON record of `adaptlm eval`, the full result)."""
    cfg = config_for(mode, ckpt.dyneval, **overrides)
    result = evaluate(ckpt.model, data, cfg, stats=ckpt.stats, tokenizer=ckpt.tokenizer)
    record: dict[str, Any] = {
        "mode": mode, "bits_per_byte": result.bits_per_byte, "bytes": result.bytes, "bits": result.bits,
        "params_adapted": result.params_adapted, "state_bytes": result.state_bytes,
        "seconds": result.seconds, "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
        "skipped_updates": result.skipped_updates, "adapter_resets": result.adapter_resets,
    }
    if ckpt.tokenizer.reports_tokens:  # a word model: per word too (docs/algorithms.md §13)
        record.update(result.word_figures()._asdict())
    if cfg.mode != "static":
        record.update({"rule": cfg.rule, "lr": cfg.lr, "decay": cfg.decay, "eps": cfg.eps, "segment": cfg.segment})
    if cfg.mode == "sparse":
        record["adapter_units"] = cfg.adapter_units
    if cfg.mode == "full" and cfg.layers_from:
        record["layers_from"] = cfg.layers_from
    if cfg.cache is not None:
        record.update({"cache_window": cfg.cache.window, "cache_theta": cfg.cache.theta, "cache_lambda": cfg.cache.lam})
    return record, result


def loss_curve(logprobs: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean bits per byte in consecutive windows -> (window centres in bytes, bits per byte)."""
    bits = -np.asarray(logprobs, dtype=np.float64) / LN2
    n = len(bits) // window
    if n == 0:
        return np.array([len(bits) / 2]), np.array([bits.mean()])
    means = bits[: n * window].reshape(n, window).mean(axis=1)
    return (np.arange(n) + 0.5) * window, means


def write_curves_csv(path: Path, curves: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
    modes = list(curves)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position", *[f"{m}_bits_per_byte" for m in modes]])
        for i, pos in enumerate(curves[modes[0]][0]):
            w.writerow([int(pos), *[f"{curves[m][1][i]:.5f}" for m in modes]])


def plot_curves(path: Path, curves: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str,
                fmt: str | None = None) -> None:
    """Write the plot to `path` as `fmt` (None: from the suffix of `path`, matplotlib's rule)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, (x, y) in curves.items():
        ax.plot(x / 1000, y, label=mode)
    ax.set_xlabel("position in text (KB)")
    ax.set_ylabel("bits per byte (window mean)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=fmt)
    plt.close(fig)
