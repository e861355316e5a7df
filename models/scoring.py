"""Scoring: log-probabilities and bits per byte of a byte string under a model (and bits per word, for a model
whose tokenizer reads words).

`ScoredText` is a scored text wherever one is reported (`score_bytes` here, offline evaluation's `EvalResult`, the
server's `TextScore`): its bits, bytes and tokens, the rates, and a word model's per-word figures (`WordFigures`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from models.base import Adapter, LanguageModel, State
from models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["BOS", "LN2", "ScoreResult", "ScoredText", "WordFigures", "score_bytes", "word_figures"]

LN2 = math.log(2.0)  # nats per bit
# Every text is scored after the tokenizer's start token (for bytes a newline), so its first byte is predicted too.
BOS = ByteTokenizer.bos


class WordFigures(NamedTuple):
    """A word model's figures of a scored text besides bits per byte (docs/algorithms.md §13); None where nothing was
    scored."""

    tokens: int  # words, every punctuation mark and end of line counted
    bits_per_word: float | None
    perplexity: float | None  # 2 ** bits_per_word


def word_figures(bits_per_word: float | None, tokens: int) -> WordFigures:
    """The figures of `tokens` words scored at `bits_per_word` (None, or no tokens: nothing scored)."""
    if bits_per_word is None or not tokens:
        return WordFigures(tokens, None, None)
    return WordFigures(tokens, bits_per_word, 2.0 ** bits_per_word)


@dataclass(kw_only=True)
class ScoredText:
    """A text's bits under a model; bits per byte of the raw text compare models of any tokenizer, bits per token (a
    word model's bits per word) models of the same one."""

    bits: float
    bytes: int  # UTF-8 bytes of the text
    tokens: int = 0  # tokens scored (the model's: bytes, or a word model's words)
    # natural log, per token (a byte, or a word model's word), if asked for
    logprobs: list[float] | np.ndarray | None = field(default=None, repr=False)
    # a word model's tokens as written in the text scored, one per log-probability, if those were asked for (a byte
    # model's are the text's bytes)
    token_texts: list[str] | None = field(default=None, repr=False)

    @property
    def bits_per_byte(self) -> float:
        return self.bits / self.bytes if self.bytes else float("nan")

    @property
    def bits_per_token(self) -> float:
        """Bits per word for a word model (docs/algorithms.md §13; perplexity = 2 ** this)."""
        return self.bits / self.tokens if self.tokens else float("nan")

    def word_figures(self) -> WordFigures:
        """Its per-word figures, for a model whose tokenizer `reports_tokens`."""
        return word_figures(self.bits_per_token if self.tokens else None, self.tokens)


@dataclass(kw_only=True)
class ScoreResult(ScoredText):
    logprobs: list[float] | None = field(default=None, repr=False)
    state: State | None = field(default=None, repr=False)  # after the text


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
    bits, lps, state = _score(model, inputs, ids, state or model.init_state(1), adapter, logprobs, chunk)
    return ScoreResult(bits=bits, bytes=len(data), tokens=int(ids.numel()), logprobs=lps, state=state)


def _score(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor, state: State, adapter: Adapter | None,
           logprobs: bool, chunk: int) -> tuple[float, list[float] | None, State]:
    """-> (bits, the log-probabilities if asked for, the state after)."""
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
    return total / LN2, torch.cat(lps).tolist() if logprobs else None, state
