"""Neural cache (Grave et al. 2017; AWD-LSTM sec. 7; ALGORITHMS.md §4), batched over streams.

    p_cache(w) ∝ sum over the last `window` pairs (h_i, x_{i+1}) with x_{i+1} = w of exp(theta h_t . h_i)
    p(w) = (1 - lam) p_model(w) + lam p_cache(w)

Layout: log_dist (B, T, V) model log-probabilities, hidden (B, T, H) the final hidden states h' fed to the
output layer, targets / mask (B, T). Each row is its own stream with its own memory; masked positions
(padding) are never stored and never counted in the window. A position with an empty cache (the first
of a stream) gets p_model unchanged.
"""

from __future__ import annotations

import math

import torch

from models.adaptation._config import CacheConfig

__all__ = ["NeuralCache"]


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

    @torch.no_grad()
    def mix(self, log_dist: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """-> log p (B, T, V) of the mixture at every position; then remembers this chunk's pairs.

        Position t sees the pairs of every earlier position (memory and this chunk), never its own."""
        cfg = self.config
        B, T, H = hidden.shape
        hidden = hidden.detach()
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
        weights = torch.where(has, torch.softmax(scores, -1), 0.0).to(log_dist.dtype)  # (B, T, L+T)
        p_cache = log_dist.new_zeros(log_dist.shape).scatter_add_(
            2, values.unsqueeze(1).expand(B, T, L + T), weights)  # (B, T, V)
        lam = has.to(log_dist.dtype) * cfg.lam  # (B, T, 1)
        mixed = torch.logaddexp(torch.log1p(-lam) + log_dist, torch.log(lam * p_cache))  # (B, T, V)
        # keep the last `window` valid pairs of each row: a stable sort puts them last, in order
        if L + T > cfg.window and bool(valid.all()):
            keys, values, valid = keys[:, -cfg.window:], values[:, -cfg.window:], valid[:, -cfg.window:]
        elif L + T > cfg.window:
            order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, -cfg.window:]  # (B, W)
            keys = keys.gather(1, order.unsqueeze(2).expand(-1, -1, H))
            values, valid = values.gather(1, order), valid.gather(1, order)
        self.keys, self.values, self.valid = keys, values, valid
        return mixed
