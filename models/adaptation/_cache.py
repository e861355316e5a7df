"""Neural cache (Grave et al. 2017, sec. 3; Merity et al. 2018, sec. 7; docs/algorithms.md §4), batched over streams.

    p_cache(w) ∝ sum over the last `window` pairs (h_i, x_{i+1}) with x_{i+1} = w of exp(theta h_t . h_i)
    p(w) = (1 - lam) p_model(w) + lam p_cache(w)

Layout: log_dist (B, T, V) model log-probabilities, hidden (B, T, H) the final hidden states h' fed to the
output layer, targets / mask (B, T). Each row is its own stream with its own memory; masked positions
(padding) are never stored and never counted in the window. A position with an empty cache (the first
of a stream) gets p_model unchanged.

Sessions (the server): a session's memory is kept between its texts as a State (`to_state` / `from_state`: "keys"
(1, L, H), "values" (1, L), "valid" (1, L), L <= window). Observing its text runs `mix`, which learns; sampling
and the keyboard's search read it through `CacheMemory.read` (`read_memory`), which never changes it: a hypothetical
continuation is predicted from the pairs the session observed, not from its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from models.adaptation._config import CacheConfig
from models.base import LanguageModel, State
from models.memory import Learned, Memory, MemorySettings, NoSettings, check_values, register

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

__all__ = ["CacheMemory", "NeuralCache", "hidden_size", "read_memory"]


class NeuralCache:
    """Per-row memory of the last `window` (h_i, x_{i+1}) pairs."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.keys: torch.Tensor | None = None  # (B, L, H)
        self.values: torch.Tensor | None = None  # (B, L) int64
        self.valid: torch.Tensor | None = None  # (B, L) bool

    def select(self, rows: slice) -> None:
        """Keep only `rows` of the memory (streams that finished are dropped from a batch)."""
        if self.keys is not None and self.values is not None and self.valid is not None:
            self.keys, self.values, self.valid = self.keys[rows], self.values[rows], self.valid[rows]

    def mix(self, log_dist: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """-> log p (B, T, V) of the mixture at every position; then remembers this chunk's pairs.

        Position t sees the pairs of every earlier position (memory and this chunk), never its own. In float32 (or
        float64) under any autocast: the scores h_t . h_i are exponentiated."""
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            return self._mix(log_dist, hidden, targets, mask)

    def _mix(self, log_dist: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        B, T, H = hidden.shape
        hidden = hidden.detach().to(torch.promote_types(hidden.dtype, torch.float32))  # bf16 under autocast: fp32
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=hidden.device)
        if self.keys is None or self.values is None or self.valid is None:
            self.keys = hidden.new_zeros(B, 0, H)
            self.values = targets.new_zeros(B, 0)
            self.valid = mask.new_zeros(B, 0)
        L = self.keys.shape[1]
        keys = torch.cat([self.keys, hidden], 1)  # (B, L+T, H)
        values = torch.cat([self.values, targets], 1)  # (B, L+T)
        valid = torch.cat([self.valid, mask], 1)  # (B, L+T)
        before = valid.long().cumsum(1) - valid.long()  # (B, L+T) valid keys strictly before each slot
        q_before = before[:, L:]  # (B, T) valid keys before each query
        j = torch.arange(L + T, device=hidden.device)
        t = torch.arange(T, device=hidden.device) + L
        allowed = (valid.unsqueeze(1) & (j.view(1, 1, -1) < t.view(1, -1, 1))
                   & (before.unsqueeze(1) >= (q_before - cfg.window).unsqueeze(2)))  # (B, T, L+T)
        scores = cfg.theta * torch.bmm(hidden, keys.transpose(1, 2))  # (B, T, L+T)
        scores = scores.masked_fill(~allowed, -math.inf)
        has = (q_before > 0).unsqueeze(2)  # (B, T, 1) some earlier pair exists, so the window is not empty
        mixed = _mixture(log_dist, scores, values, has, cfg.lam)
        # keep the last `window` valid pairs of each row: a stable sort puts them last, in order
        if L + T > cfg.window and bool(valid.all()):
            keys, values, valid = keys[:, -cfg.window:], values[:, -cfg.window:], valid[:, -cfg.window:]
        elif L + T > cfg.window:
            order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, -cfg.window:]  # (B, W)
            keys = keys.gather(1, order.unsqueeze(2).expand(-1, -1, H))
            values, valid = values.gather(1, order), valid.gather(1, order)
        self.keys, self.values, self.valid = keys, values, valid
        return mixed

    def to_state(self) -> State | None:
        """The memory of a one-row cache, to keep between a session's texts (None: nothing stored yet)."""
        if self.keys is None or self.values is None or self.valid is None:
            return None
        return State({"keys": self.keys, "values": self.values, "valid": self.valid})

    @classmethod
    def from_state(cls, config: CacheConfig, state: State | None) -> NeuralCache:
        """A cache that goes on from a memory `to_state` gave (None: an empty one). The memory is not copied:
        `mix` makes new tensors, never writes into these."""
        cache = cls(config)
        if state is not None:
            cache.keys, cache.values, cache.valid = (state.tensors["keys"], state.tensors["values"],
                                                     state.tensors["valid"])
        return cache


def _mixture(log_dist: torch.Tensor, scores: torch.Tensor, values: torch.Tensor, has: torch.Tensor,
             lam: float) -> torch.Tensor:
    """(1 - lam) p_model + lam p_cache (Grave et al. 2017, eq. 3; docs/algorithms.md §4) in the log domain, where
    p_cache sums softmax(scores) (B, T, S) over the slots whose next token (`values` (B, S)) is w; rows of `has`
    (B, T, 1) False (an empty window) keep p_model."""
    B, T, S = scores.shape
    weights = torch.where(has, torch.softmax(scores, -1), 0.0).to(log_dist.dtype)  # (B, T, S)
    p_cache = log_dist.new_zeros(log_dist.shape).scatter_add_(
        2, values.unsqueeze(1).expand(B, T, S), weights)  # (B, T, V)
    lam_t = has.to(log_dist.dtype) * lam  # (B, T, 1)
    return torch.logaddexp(torch.log1p(-lam_t) + log_dist, torch.log(lam_t * p_cache))  # (B, T, V)


def read_memory(log_dist: torch.Tensor, hidden: torch.Tensor, memory: State, config: CacheConfig) -> torch.Tensor:
    """log p (R, T, V) of the model mixed with one memory (`NeuralCache.to_state`, batch 1), read and not changed:
    every position of the R rows sees every pair of the memory (and none of its own rows'). In float32 under any
    autocast, as `NeuralCache.mix`."""
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        return _read_memory(log_dist, hidden, memory, config)


def _read_memory(log_dist: torch.Tensor, hidden: torch.Tensor, memory: State, config: CacheConfig) -> torch.Tensor:
    keys, values, valid = memory.tensors["keys"][0], memory.tensors["values"][0], memory.tensors["valid"][0]
    R, T, _ = log_dist.shape
    if not bool(valid.any()):
        return log_dist
    scores = config.theta * (hidden.to(keys.dtype) @ keys.t())  # (R, T, L)
    scores = scores.masked_fill(~valid.view(1, 1, -1), -math.inf)
    has = torch.ones(R, T, 1, dtype=torch.bool, device=log_dist.device)
    return _mixture(log_dist, scores, values.unsqueeze(0).expand(R, -1), has, config.lam)


@register
class CacheMemory(Memory):
    """The neural cache as a session memory: a session's memory of (hidden state, next token) pairs, mixed into every
    prediction of the session; it takes the copy model's place (a session remembers its own text by one of them).
    Its state is `NeuralCache.to_state`'s ("keys" (1, L, H) float32, "values" (1, L) int64, "valid" (1, L) bool),
    or None before the session observed a token; its window, theta and lam are the checkpoint's (dyneval.json
    "cache"). Off unless the checkpoint's "session" section or the session asks for it."""

    name = "cache"
    kind = "distribution"
    replaces = ("copy",)
    needs_hidden = True

    def __init__(self, config: CacheConfig, hidden: int = 0, vocab_size: int = 0, on: bool = False) -> None:
        self.config, self.hidden, self.vocab_size, self.on = config, hidden, vocab_size, on

    @classmethod
    def build(cls, ckpt: Checkpoint) -> CacheMemory | None:
        hidden = hidden_size(ckpt.model, ckpt.tokenizer.bos)
        if hidden is None:
            return None
        return cls(ckpt.dyneval.cache, hidden, ckpt.tokenizer.vocab_size, ckpt.dyneval.neural_cache)

    def defaults(self) -> MemorySettings | None:
        return NoSettings() if self.on else None

    def init(self, settings: MemorySettings, device: torch.device) -> None:
        return None  # no pairs yet

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> State | None:
        if not tensors:
            return None
        keys, values, valid = tensors.get("keys"), tensors.get("values"), tensors.get("valid")
        if keys is None or values is None or valid is None or len(tensors) != 3:
            raise ValueError("the neural cache needs exactly cache.keys, cache.values and cache.valid")
        H = self.hidden
        L = keys.shape[1] if keys.dim() == 3 else -1
        if (keys.dtype != torch.float32 or keys.dim() != 3 or keys.shape[0] != 1 or keys.shape[2] != H
                or values.dtype != torch.int64 or tuple(values.shape) != (1, L)
                or valid.dtype != torch.bool or tuple(valid.shape) != (1, L)):
            raise ValueError(f"the neural cache is not of shapes (1, L, {H}) float32, (1, L) int64 and (1, L) bool "
                             "(another model?)")
        if L > self.config.window:
            raise ValueError(f"the neural cache holds {L} pairs, more than its window ({self.config.window})")
        check_values("cache.keys", keys)
        if L and not (0 <= int(values.min()) and int(values.max()) < self.vocab_size):
            raise ValueError(f"cache.values are not token ids of this model (0 to {self.vocab_size - 1})")
        return State({"keys": keys.to(device), "values": values.to(device), "valid": valid.to(device)})

    def learn(self, log_dist: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
              hidden: torch.Tensor | None, states: Sequence[Any]) -> Learned:
        assert hidden is not None, "the neural cache needs Output.hidden"
        # float32, or float64 for a float64 network (whose scores are not rounded to float32)
        out = log_dist.to(torch.promote_types(log_dist.dtype, torch.float32), copy=True)
        lengths = mask.sum(1).tolist()
        after = []
        for j, state in enumerate(states):  # each row its own memory, of its own length
            t = int(lengths[j])
            cache = NeuralCache.from_state(self.config, state)
            out[j : j + 1, :t] = cache.mix(log_dist[j : j + 1, :t], hidden[j : j + 1, :t], targets[j : j + 1, :t])
            after.append(cache.to_state())
        return Learned(out, after)

    def read(self, log_dist: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor | None,
             branch: State | None, views: Sequence[Any], index: torch.Tensor) -> tuple[torch.Tensor, State | None]:
        assert hidden is not None
        B = tokens.shape[0]
        rows_of = index.tolist()
        mixed = log_dist
        for s in sorted(set(rows_of) - {-1}):
            if views[s] is None:  # an empty memory: the distribution unchanged
                continue
            rows = [b for b in range(B) if rows_of[b] == s]
            part = read_memory(log_dist[rows], hidden[rows], views[s], self.config)
            mixed = mixed.index_copy(0, torch.tensor(rows).to(log_dist.device, non_blocking=True), part) \
                if len(rows) < B else part
        return mixed, None


@torch.no_grad()
def hidden_size(model: LanguageModel, bos: int) -> int | None:
    """H of the hidden states the model hands its output layer (`Output.hidden`), or None if it gives none."""
    ref = next(model.parameters())
    out = model(torch.tensor([[bos]], device=ref.device), model.init_state(1))
    return int(out.hidden.shape[-1]) if out.hidden is not None else None
