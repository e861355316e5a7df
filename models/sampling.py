"""Sampling: temperature, top-k and nucleus (top-p) sampling of bytes, decoded incrementally to text."""

from __future__ import annotations

import codecs
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from models.base import Adapter, LanguageModel, State
from models.scoring import BOS

__all__ = ["SamplingParams", "filter_logits", "generate", "sample_next"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 200
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (V,) -> log-weights (V,) with filtered entries at -inf; temperature > 0."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: (V,) -> one token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    weights = torch.softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)
    return int(torch.multinomial(weights, 1, generator=generator))


@torch.no_grad()
def generate(model: LanguageModel, prompt: bytes, params: SamplingParams, *, state: State | None = None,
             last_byte: int = BOS, adapter: Adapter | None = None) -> Iterator[str]:
    """Yield decoded text pieces of the continuation of `prompt` (invalid UTF-8 becomes U+FFFD).

    Stops after max_tokens bytes or when a stop string appears (the stop string is not yielded).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    state = state or model.init_state(1)
    context = bytes([last_byte]) + prompt
    inputs = torch.tensor(list(context), dtype=torch.long, device=device).unsqueeze(0)  # (1, T)
    out = model(inputs, state, adapter)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, emitted = "", 0
    hold = max((len(s) for s in params.stop), default=0)
    try:
        for i in range(params.max_tokens):
            token = sample_next(out.logits[0, -1], params, gen)
            text += decoder.decode(bytes([token]), final=i == params.max_tokens - 1)
            if hold:
                cut = min((idx for s in params.stop if (idx := text.find(s, max(0, emitted - hold))) >= 0),
                          default=-1)
                if cut >= 0:
                    if cut > emitted:
                        yield text[emitted:cut]
                    return
            safe = len(text) - hold if hold else len(text)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if i + 1 < params.max_tokens:
                out = model(torch.tensor([[token]], device=device), out.state, adapter)
        if len(text) > emitted:
            yield text[emitted:]
    finally:
        model.train(was_training)
