"""Neural cache (Grave et al. 2017, sec. 3; Merity et al. 2018, sec. 7; docs/algorithms.md §4), batched over streams.

    p_cache(w) ∝ sum over the last `window` pairs (h_i, x_{i+1}) with x_{i+1} = w of exp(theta h_t . h_i)
    p(w) = (1 - lam) p_model(w) + lam p_cache(w)

Layout: log_dist (B, T, V) model log-probabilities, hidden (B, T, H) the final hidden states h' fed to the
output layer, targets / mask (B, T). Each row is its own stream with its own memory; masked positions
(padding) are never stored and never counted in the window. A position with an empty cache (the first
of a stream) gets p_model unchanged.

Sessions (the server): a session's memory is kept between its texts as a State (`to_state` / `from_state`: "keys"
(1, L, H), "values" (1, L), "valid" (1, L), L <= window). Observing its text runs `mix`, which learns; sampling
and the keyboard's search read it through `CacheMixed` (`read_memory`), which never changes it: a hypothetical
continuation is predicted from the pairs the session observed, not from its own.
"""

from __future__ import annotations

import math

import torch

from models.adaptation._config import CacheConfig
from models.base import Adapter, LanguageModel, Output, Site, State

__all__ = ["CacheMixed", "NeuralCache", "read_memory"]


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


class CacheMixed(LanguageModel):
    """A model with its rows' sessions' neural caches mixed in, for sampling and the keyboard's word search: it reads
    the memories (`Adapter.cache`, one row per session; `Adapter.cache_index` the session of each row, -1 none) and
    never changes them. A row without a memory gets the inner model's output unchanged."""

    def __init__(self, base: LanguageModel, config: CacheConfig) -> None:
        super().__init__()
        self.base = base
        self.cache_config = config
        self.config = base.config
        self.frozen = base.frozen
        self.train(base.training)  # the network's mode: a toggle of the wrapper (`generate`) gives it back as it was

    def init_state(self, batch: int) -> State:
        return self.base.init_state(batch)

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        out: Output = self.base(tokens, state, adapter)
        if adapter is None or adapter.cache is None:
            return out
        if out.hidden is None:
            raise ValueError("the neural cache needs the model's hidden states (Output.hidden)")
        log_dist = self.base.log_probs(out).float()  # (B, T, V)
        B = tokens.shape[0]
        index = adapter.cache_index.tolist() if adapter.cache_index is not None else [0] * B
        mixed = log_dist
        for s in sorted(set(index) - {-1}):
            rows = [b for b in range(B) if index[b] == s]
            part = read_memory(log_dist[rows], out.hidden[rows], adapter.cache.select(s), self.cache_config)
            mixed = mixed.index_copy(0, torch.tensor(rows, device=log_dist.device), part) if len(rows) < B else part
        return Output(logits=mixed, state=out.state, aux=out.aux, hidden=out.hidden)

    def branch(self, state: State) -> State:
        return self.base.branch(state)  # the state is the inner model's

    def settle(self, state: State) -> State:
        return self.base.settle(state)

    def adaptation_sites(self) -> list[Site]:
        return self.base.adaptation_sites()

    def log_probs(self, output: Output) -> torch.Tensor:
        return torch.log_softmax(output.logits.float(), -1)  # log p of the mixture, or the model's logits
