"""Adaptive input embeddings and the adaptive softmax (Baevski & Auli 2019, sec. 3; Grave et al. 2017;
docs/algorithms.md §8), for word-level models whose vocabulary is sorted by frequency (models/word_tokenizer.py).

Bands. `cutoffs` c_1 < ... < c_{n-1} cut the ids into bands V_1 = [0, c_1) (the head, the most frequent words),
V_2 = [c_1, c_2), ..., V_n = [c_{n-1}, V) (the tail). Band i (counted from 0 here) has dimension d_i = d // k**i,
k = `div_value` (4 in the paper), as in `torch.nn.AdaptiveLogSoftmaxWithLoss` (int(d // k**i)).

    AdaptiveInput      ids (...) -> (..., d):  x = E_i[id - start_i] @ W_i^T,  E_i (|V_i|, d_i), W_i (d, d_i)
    AdaptiveSoftmax    hidden h (..., d):
        head           log p(c | h) = log_softmax([h @ H^T ; h @ C^T] + b),   H (|V_1|, d) words, C (n-1, d) clusters
        tail band i    log p(w | h) = log p(cluster i | h) + log_softmax(drop(h @ P_i) @ O_i^T)[w - start_i],
                       P_i (d, d_i), O_i (|V_i|, d_i)

No scale on the adaptive input's output: the paper (sec. 3) adds none; a transformer that multiplies its embeddings
by sqrt(d) (Vaswani et al.; fairseq's embed_scale) does so itself. The head has no projection (sec. 3: it made
results worse); `dropout` acts on the tail projections' outputs only, in training (sec. 5.4, "tail dropout").

Tying (sec. 3, "Weight sharing"; docs/algorithms.md §8): `AdaptiveSoftmax.tie(adaptive_input)` makes the softmax use the
input's Parameters themselves: H = E_1 (the head words; the n-1 cluster rows C stay the softmax's own), O_i = E_i,
and, with `projections=True` (the paper's WikiText-103 setting; False: its billion word one), P_i = W_i, the same
(d, d_i) tensor read as h @ W_i on the way out and e @ W_i^T on the way in. The input's head projection W_1 is never
tied (the softmax has none). A tied model's state dict holds the shared tensors under both names; safetensors'
`save_file` refuses shared storage, so a checkpoint writer must save one name (or clone) and tie again at load.

Parameterisation matches `torch.nn.AdaptiveLogSoftmaxWithLoss` (head weight = [H ; C], head bias = b, tail[i] =
(P_i^T, O_i)), so weights copy across in either direction (tests/models/test_adaptive.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AdaptiveInput", "AdaptiveSoftmax", "band_bounds", "band_dims"]


def band_bounds(vocab_size: int, cutoffs: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, stop)] of each band; ValueError unless 0 < c_1 < ... < c_{n-1} < vocab_size."""
    cuts = list(cutoffs)
    if any(not isinstance(c, int) or isinstance(c, bool) for c in cuts):
        raise ValueError(f"cutoffs must be integers, not {cuts!r}")
    if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
        raise ValueError(f"cutoffs must be strictly increasing, not {cuts!r}")
    if cuts and cuts[0] <= 0:
        raise ValueError(f"cutoffs must be positive (the head band is [0, c_1)), not {cuts!r}")
    if cuts and cuts[-1] >= vocab_size:
        raise ValueError(f"cutoffs {cuts!r} reach beyond the vocabulary of {vocab_size}: each band needs a word")
    edges = [0, *cuts, vocab_size]
    return list(zip(edges[:-1], edges[1:], strict=True))


def band_dims(dim: int, bands: int, div_value: float = 4.0) -> list[int]:
    """d_i = d // k**i for each band (sec. 3: capacity reduced by a factor k per band); ValueError if one is 0."""
    if div_value < 1:
        raise ValueError(f"div_value must be at least 1, not {div_value}")
    dims = [int(dim // div_value**i) for i in range(bands)]
    if dims[-1] < 1:
        raise ValueError(f"band {bands - 1} would have dimension {dim} // {div_value}**{bands - 1} = 0: "
                         f"fewer bands, a larger dim or a smaller div_value")
    return dims


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"token ids must be int64 or int32, not {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(ids.min())}, {int(ids.max())}]")


class AdaptiveInput(nn.Module):
    """Adaptive input representations (sec. 3, Figure 1): ids (...) -> (..., dim).

    `embeddings[i]` (|V_i|, d_i) and `projections[i]` (dim, d_i) (nn.Linear(d_i, dim)'s weight layout, no bias:
    sec. 4.1 "a simple linear projection with no bias"); band 0 is projected too (sec. 3)."""

    def __init__(self, vocab_size: int, dim: int, cutoffs: Sequence[int], div_value: float = 4.0) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.div_value = vocab_size, dim, div_value
        self.cutoffs = list(cutoffs)
        self.bounds = band_bounds(vocab_size, self.cutoffs)
        self.dims = band_dims(dim, len(self.bounds), div_value)
        sizes = [stop - start for start, stop in self.bounds]
        embeddings = [nn.Parameter(torch.empty(n, d)) for n, d in zip(sizes, self.dims, strict=True)]
        self.embeddings = nn.ParameterList(embeddings)
        self.projections = nn.ParameterList([nn.Parameter(torch.empty(dim, d)) for d in self.dims])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # fairseq's AdaptiveInput: N(0, d_i^-1/2) embeddings, Xavier-uniform projections
        for e, p in zip(self.embeddings, self.projections, strict=True):
            nn.init.normal_(e, std=e.shape[1] ** -0.5)
            nn.init.xavier_uniform_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int -> (..., dim): each id looked up in its band and projected to dim (sec. 3)."""
        _check_ids(ids, self.vocab_size)
        flat = ids.reshape(-1)  # (N,)
        out: torch.Tensor = self.projections[0].new_zeros(flat.shape[0], self.dim)  # (N, dim)
        for (start, stop), emb, proj in zip(self.bounds, self.embeddings, self.projections, strict=True):
            rows = ((flat >= start) & (flat < stop)).nonzero().squeeze(1)  # (N_i,)
            if rows.numel():
                out = out.index_copy(0, rows, F.linear(F.embedding(flat[rows] - start, emb), proj))  # (N_i, dim)
        return out.view(*ids.shape, self.dim)


class AdaptiveSoftmax(nn.Module):
    """The two-level adaptive softmax (Grave et al. 2017; Baevski & Auli sec. 3 and 5.4) over `vocab_size` words.

    Parameters: `head_weight` H (|V_1|, dim), `cluster_weight` C (n-1, dim), `head_bias` b (|V_1| + n-1,) or None,
    `tail_projections[i]` P (dim, d_{i+1}), `tail_weights[i]` O (|V_{i+1}|, d_{i+1}) (module docstring)."""

    def __init__(self, vocab_size: int, dim: int, cutoffs: Sequence[int], div_value: float = 4.0,
                 head_bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.div_value = vocab_size, dim, div_value
        self.cutoffs = list(cutoffs)
        self.bounds = band_bounds(vocab_size, self.cutoffs)
        self.dims = band_dims(dim, len(self.bounds), div_value)
        self.shortlist = self.bounds[0][1]
        tails = list(zip(self.bounds[1:], self.dims[1:], strict=True))
        self.head_weight = nn.Parameter(torch.empty(self.shortlist, dim))
        self.cluster_weight = nn.Parameter(torch.empty(len(tails), dim))
        self.head_bias = nn.Parameter(torch.zeros(self.shortlist + len(tails))) if head_bias else None
        self.tail_projections = nn.ParameterList([nn.Parameter(torch.empty(dim, d)) for _, d in tails])
        self.tail_weights = nn.ParameterList([nn.Parameter(torch.empty(stop - start, d)) for (start, stop), d in tails])
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.head_weight, std=self.dim**-0.5)
        nn.init.normal_(self.cluster_weight, std=self.dim**-0.5)
        for p, w in zip(self.tail_projections, self.tail_weights, strict=True):
            nn.init.xavier_uniform_(p)
            nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def tie(self, adaptive_input: AdaptiveInput, projections: bool = True) -> AdaptiveSoftmax:
        """Share the input's Parameters (sec. 3 "Weight sharing"): head words H = E_1, tail words O_i = E_i and,
        if `projections`, P_i = W_i (i >= 2). Never the input's head projection W_1, nor the cluster rows C.
        -> self."""
        inp = adaptive_input
        if (inp.vocab_size, inp.dim, inp.cutoffs, inp.dims) != (self.vocab_size, self.dim, self.cutoffs, self.dims):
            raise ValueError(f"cannot tie: the adaptive input has vocab {inp.vocab_size}, dim {inp.dim}, cutoffs "
                             f"{inp.cutoffs}, band dims {inp.dims}; the softmax {self.vocab_size}, {self.dim}, "
                             f"{self.cutoffs}, {self.dims}")
        self.head_weight = inp.embeddings[0]
        for i in range(len(self.tail_weights)):
            self.tail_weights[i] = inp.embeddings[i + 1]
            if projections:
                self.tail_projections[i] = inp.projections[i + 1]
        return self

    def _head_log_prob(self, h: torch.Tensor) -> torch.Tensor:
        """h (N, dim) -> log p over [head words ; clusters] (N, |V_1| + n-1)."""
        logits = torch.cat([F.linear(h, self.head_weight), F.linear(h, self.cluster_weight)], dim=-1)  # (N, S+n-1)
        if self.head_bias is not None:
            logits = logits + self.head_bias
        return torch.log_softmax(logits, dim=-1)

    def _tail_log_prob(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """h (N, dim) -> log p(w | cluster i) over tail band i's words (N, |V_{i+1}|)."""
        z = self.dropout(h @ self.tail_projections[i])  # (N, d_{i+1}); sec. 5.4: dropout after the tail projection
        return torch.log_softmax(F.linear(z, self.tail_weights[i]), dim=-1)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., dim) -> log p over the whole vocabulary (..., V); every row sums to 1 in probability."""
        h = hidden.reshape(-1, self.dim)  # (N, dim)
        head = self._head_log_prob(h)  # (N, S + n-1)
        parts = [head[:, : self.shortlist]]
        for i in range(len(self.tail_weights)):
            # log p(w) = log p(cluster i) + log p(w | cluster i) (Grave et al. eq. for the two-level softmax)
            parts.append(head[:, self.shortlist + i, None] + self._tail_log_prob(h, i))  # (N, |V_{i+1}|)
        return torch.cat(parts, dim=-1).view(*hidden.shape[:-1], self.vocab_size)

    def target_log_prob(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden (..., dim), targets (...) -> log p(target) (...), without the full distribution: the head for
        every row, tail band i only for the rows whose target lies in it."""
        _check_ids(targets, self.vocab_size)
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match")
        h = hidden.reshape(-1, self.dim)  # (N, dim)
        t = targets.reshape(-1)  # (N,)
        head = self._head_log_prob(h)  # (N, S + n-1)
        in_head = t < self.shortlist
        out = head.gather(1, torch.where(in_head, t, 0).unsqueeze(1)).squeeze(1)  # (N,); tail rows set below
        for i, (start, stop) in enumerate(self.bounds[1:]):
            rows = ((t >= start) & (t < stop)).nonzero().squeeze(1)  # (N_i,)
            if not rows.numel():
                continue
            word = self._tail_log_prob(h[rows], i).gather(1, (t[rows] - start).unsqueeze(1)).squeeze(1)  # (N_i,)
            out = out.index_copy(0, rows, head[rows, self.shortlist + i] + word)
        return out.view(targets.shape)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training path: `target_log_prob` (the loss is its negative mean)."""
        return self.target_log_prob(hidden, targets)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, dim={self.dim}, cutoffs={self.cutoffs}, dims={self.dims}, "
                f"head_bias={self.head_bias is not None}")

