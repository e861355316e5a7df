"""Scoring: log-probabilities and bits per byte of a byte string under a model (and bits per word, for a model
whose tokenizer reads words)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from models.base import Adapter, LanguageModel, State
from models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["BOS", "ScoreResult", "score_bytes"]

LN2 = math.log(2.0)
# Every text is scored after the tokenizer's start token (for bytes a newline), so its first byte is predicted too.
BOS = ByteTokenizer.bos


@dataclass
class ScoreResult:
    bits: float
    bytes: int  # UTF-8 bytes of the text
    logprobs: list[float] | None = field(default=None)  # natural-log probability of each token (byte, or word)
    state: State | None = field(default=None, repr=False)
    tokens: int = 0  # tokens scored (0: as many as bytes)

    @property
    def bits_per_byte(self) -> float:
        return self.bits / self.bytes if self.bytes else float("nan")

    @property
    def bits_per_token(self) -> float:
        """Bits per word for a word model (docs/algorithms.md §13; perplexity = 2 ** this)."""
        n = self.tokens or self.bytes
        return self.bits / n if n else float("nan")


@torch.no_grad()
def score_bytes(model: LanguageModel, data: bytes, *, logprobs: bool = False, state: State | None = None,
                last_token: int | None = None, adapter: Adapter | None = None, chunk: int = 1024,
                tokenizer: Tokenizer | None = None) -> ScoreResult:
    """Score `data` as one stream (batch 1), continuing from `state` (None: the model's initial state) after the token
    `last_token` (None: the tokenizer's start token, a byte model's BOS byte)."""
    if not data:
        raise ValueError("empty text: nothing to score")
    tokenizer = tokenizer or ByteTokenizer()
    inputs, ids = tokenizer.stream(data, last_token, next(model.parameters()).device)  # (T,) predicts ids
    result = _score(model, inputs, ids, state or model.init_state(1), adapter, logprobs, chunk)
    result.bytes, result.tokens = len(data), int(ids.numel())
    return result


def _score(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor, state: State,
           adapter: Adapter | None, logprobs: bool, chunk: int) -> ScoreResult:
    was_training = model.training
    model.eval()
    total = 0.0
    lps: list[torch.Tensor] = []
    for start in range(0, inputs.numel(), chunk):
        out = model(inputs[start : start + chunk].unsqueeze(0), state, adapter)
        state = out.state
        lp = model.target_logprobs(out, targets[start : start + chunk].unsqueeze(0))[0]  # (t,) through the model
        total -= float(lp.double().sum())
        if logprobs:
            lps.append(lp)
    model.train(was_training)
    return ScoreResult(bits=total / LN2, bytes=int(targets.numel()),
                       logprobs=torch.cat(lps).tolist() if logprobs else None, state=state)
