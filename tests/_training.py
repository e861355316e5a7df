"""Training inside the test run: one torch thread, on the small texts of tests/data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def train_on_test_data(cfg: Any, out: Path) -> Any:
    """`trainer.train.train(cfg)` on tests/data/train.txt (validated on valid.txt) with one thread: with a model
    this small, several threads contend with each other (and with anything else running on the machine) and
    training takes 10-100x longer. The thread count is global, so it is put back for the tests that follow."""
    import torch

    from trainer.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(cfg, [DATA / "train.txt"], out=out, valid_path=DATA / "valid.txt", progress=False)
    finally:
        torch.set_num_threads(threads)


def repetitive(n: int = 120, alphabet: int = 6, seed: int = 0) -> bytes:
    """n random letters from a small alphabet: a text a model has never seen, that repeats when tiled."""
    import torch

    g = torch.Generator().manual_seed(seed)
    symbols = torch.randperm(26, generator=g)[:alphabet] + ord("a")
    return bytes(symbols[torch.randint(0, alphabet, (n,), generator=g)].tolist())


def sparse_bits_on_repeats(model: Any, lr: float = 0.5, segment: int = 10) -> tuple[float, float, Any, Any]:
    """A repetitive text tiled three times, scored static and with sparse dynamic evaluation (plain SGD): -> the bits
    of its repeats (after the first copy) under each, and both results. Adaptation must learn the repeats."""
    import math

    from models.adaptation import DynEvalConfig, evaluate

    s = repetitive()
    text = s * 3
    static = evaluate(model, text, DynEvalConfig(mode="static"))
    sparse = evaluate(model, text, DynEvalConfig(mode="sparse", rule="sgd", lr=lr, segment=segment))
    later = slice(len(s), None)
    return (-static.logprobs[later].sum() / math.log(2), -sparse.logprobs[later].sum() / math.log(2), static, sparse)
