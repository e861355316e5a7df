"""A toy causal transformer over bytes: the second architecture that proves the model interface (models/base.py).

Deliberately unlike the mLSTM: attention instead of a recurrence, a key/value memory instead of a fixed
recurrent state, an adaptation site applied once per position (`per_step=False`) instead of at every step.

    x_t = E[byte_t]
    block l:  x += Attn(LN(x))  over the last `context` positions (itself included; ALiBi distance bias)
              x += MLP(LN(x))
    h'_t = x_t + M x_t            adaptation site "resid" on the first k units, after the last block
    logits = W LN(h')

State: per layer l, keys `k{l}` and values `v{l}` (B, L, D) of the last L = context - 1 positions, and a boolean
`mask` (B, L) of the valid slots (a fresh state: all False). Slots fill from the right; the oldest drop off the
left. The model accepts a memory of any length (`State.stack` left-pads rows of different lengths with masked
slots) and always returns L slots, so a sliding-window forward in pieces equals one forward over the whole text.

Importing this module registers the architecture "toy-transformer".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels.adapter import AdapterSteps
from models.base import Adapter, LanguageModel, ModelConfig, Output, Site, State
from models.registry import register

__all__ = ["ToyTransformer", "ToyTransformerConfig"]


@dataclass(frozen=True)
class ToyTransformerConfig(ModelConfig):
    arch = "toy-transformer"
    vocab_size: int = 256
    d_model: int = 32
    n_layer: int = 2
    n_head: int = 2
    context: int = 16  # attention window, the query included
    adapter_units: int = 0  # default k of the site (0: all of d_model)


class _Block(nn.Module):
    def __init__(self, cfg: ToyTransformerConfig) -> None:
        super().__init__()
        D = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        # ALiBi slopes (Press et al. 2022): head h penalises distance d by slope_h * d (plain floats; the loader
        # also handles non-persistent buffers, see test_a_model_with_a_non_persistent_buffer_loads)
        self.slopes = [2.0 ** (-8.0 * (h + 1) / cfg.n_head) for h in range(cfg.n_head)]

    def forward(self, x: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor, allowed: torch.Tensor,
                dist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, D); mem_k, mem_v: (B, L, D); allowed: (B, T, L+T) bool; dist: (T, L+T).
        -> x (B, T, D), this chunk's keys and values (B, T, D)."""
        B, T, D = x.shape
        H = self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)  # (B, T, D) each
        keys = torch.cat([mem_k, k], 1)  # (B, L+T, D)
        vals = torch.cat([mem_v, v], 1)  # (B, L+T, D)
        qh = q.view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, Dh)
        kh = keys.view(B, -1, H, D // H).transpose(1, 2)  # (B, H, L+T, Dh)
        vh = vals.view(B, -1, H, D // H).transpose(1, 2)  # (B, H, L+T, Dh)
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(D // H)  # (B, H, T, L+T)
        slopes = torch.tensor(self.slopes, dtype=scores.dtype, device=scores.device).view(1, H, 1, 1)
        scores = scores - slopes * dist.to(scores.dtype)
        scores = scores.masked_fill(~allowed.unsqueeze(1), -math.inf)
        att = torch.softmax(scores, dim=-1) @ vh  # (B, H, T, Dh)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))  # (B, T, D)
        x = x + self.mlp(self.ln2(x))
        return x, k, v


class ToyTransformer(LanguageModel):
    config: ToyTransformerConfig

    def __init__(self, config: ToyTransformerConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError("d_model must be a multiple of n_head")
        if config.context < 2:
            raise ValueError("context must be >= 2")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=0.1)

    @property
    def memory(self) -> int:
        return self.config.context - 1

    def init_state(self, batch: int) -> State:
        p = self.embed.weight
        L, D = self.memory, self.config.d_model
        tensors = {"mask": torch.zeros(batch, L, dtype=torch.bool, device=p.device)}
        for i in range(self.config.n_layer):
            tensors[f"k{i}"] = torch.zeros(batch, L, D, dtype=p.dtype, device=p.device)
            tensors[f"v{i}"] = torch.zeros(batch, L, D, dtype=p.dtype, device=p.device)
        return State(tensors)

    def adaptation_sites(self) -> list[Site]:
        return [Site("resid", self.config.d_model, layer=-1, per_step=False, units=self.config.adapter_units)]

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        """tokens: (B, T) int64; state: k{l}, v{l} (B, L', D), mask (B, L'); adapter: mats["resid"] (B, k, k)."""
        B, T = tokens.shape
        mem_mask = state.tensors["mask"]  # (B, L')
        Lp = mem_mask.shape[1]
        dev = tokens.device
        # distance from query t to memory slot j (newest at j = L'-1) and to chunk position s
        q = torch.arange(T, device=dev).view(T, 1)
        pos = torch.cat([torch.arange(-Lp, 0, device=dev), torch.arange(T, device=dev)]).view(1, Lp + T)
        dist = q - pos  # (T, L'+T)
        in_window = (dist >= 0) & (dist < self.config.context)  # (T, L'+T) causal, sliding window
        valid = torch.cat([mem_mask, mem_mask.new_ones(B, T)], 1)  # (B, L'+T)
        allowed = in_window.unsqueeze(0) & valid.unsqueeze(1)  # (B, T, L'+T)
        x = self.embed(tokens)  # (B, T, D)
        new: dict[str, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            mk, mv = state.tensors[f"k{i}"], state.tensors[f"v{i}"]
            x, k, v = block(x, mk, mv, allowed, dist)
            new[f"k{i}"] = self._keep(torch.cat([mk, k], 1))
            new[f"v{i}"] = self._keep(torch.cat([mv, v], 1))
        new["mask"] = self._keep(valid)
        if adapter is not None:
            op = AdapterSteps(adapter.mats["resid"])  # the mLSTM's batched op, once per position
            x = torch.stack([op(x_t) for x_t in x.unbind(1)], dim=1)  # (B, T, D) h' = h + M h
        hidden = self.ln_f(x)  # (B, T, D)
        logits = self.head(hidden)  # (B, T, V)
        return Output(logits=logits, state=State(new), hidden=hidden)

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        """The last L slots of (B, n, ...), left-padded (zeros / False) when n < L."""
        L = self.memory
        if t.shape[1] >= L:
            return t[:, t.shape[1] - L:]
        pad = t.new_zeros(t.shape[0], L - t.shape[1], *t.shape[2:])
        return torch.cat([pad, t], 1)


register(ToyTransformerConfig, ToyTransformer)
