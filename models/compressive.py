"""Compressive Transformer (Rae et al. 2020, sec. 3; docs/algorithms.md §7) over bytes, with Transformer-XL
relative attention (Dai et al. 2019, sec. 3.3).

    x = E[byte]
    block l:  keys  = [cmem_l ; mem_l ; current]            layer INPUTS x, projected afresh each call
              x += Attn(LN(x) -> LN(keys))                   relative positions, causal aligned bottom-right
              x += MLP(LN(x))
    h' = h + M h                                             adaptation site "resid" after block `adapt_layer`
    logits = W LN(x_N)

Layer norm: pre-LN (each sub-layer normalises its input; a final LN before the classifier), as the character
transformer: it keeps the memory holding the raw residual stream (what the paper compresses: "past activations")
while K/V see it normalised. Attention runs through `kernels.memory_attention` with rel = (r, u, v): score(i, j) =
((q_i + u) . k_j + (q_i + v) . r[d]) / sqrt(Dh), r = W_r R[d] the projected sinusoid of the distance d between
query and key counted in slots of the concatenated [cmem ; mem ; current] (a compressed slot is one position).

Segments, memory and the update rule (the paper's, on a fixed grid of the stream). The stream is cut into segments
of `segment` S bytes from its start, whatever the calls. A byte in segment k attends to: the compressed memory as
it was when segment k began, the fine memory then (the last min(kS, n_m) layer inputs), and segment k's own bytes
up to itself. When segment k completes (possibly in the middle of a call, which is then processed in pieces), its
S inputs join the fine memory, the oldest are evicted down to n_m, and the evicted ones (S of them, fewer while the
memory fills: always a multiple of c) are compressed by f with rate c into compressed slots appended to cmem (the
oldest dropping past n_cm). Memories are stop-gradient (Transformer-XL's SG): the gradient of a call stops at them.
So outputs and state depend only on the stream, not on how it is cut into calls: T = 1 per byte (generation), 20
(dynamic evaluation) or bptt (training) give the same numbers up to float summation order (tested). A call whose
bytes do not close a segment only appends them to the fine memory ("pending").

State (fixed shapes; sessions at different fills batch with a plain `cat`): `seen` (B,) int64, bytes consumed; per
layer `mem{l}` (B, n_m + S - 1, D) the fine memory incl. the pending bytes of the current segment, and `cmem{l}`
(B, n_cm, D), each right-aligned (newest last) with zeros in front. The fills follow from `seen` alone: pending
p = seen mod S, fine min(seen, n_m + p), compressed min(n_cm, max(0, seen - p - n_m) / c). Keys are assembled
right-aligned and contiguous ([valid cmem ; valid mem ; current], padding first) for `key_lengths`.

Key/value cache (serving cost). A memory slot's keys and values depend only on the stored input and the layer's LN and
K/V weights, so with frozen weights each slot is projected once, when it enters the memory (a compressed slot when it
is compressed), and kept in the state beside the memory: `memo.kv_mem{l}` (B, n_m + S - 1, 2D) and
`memo.kv_cmem{l}` (B, n_cm, 2D) in the memories' layout, with `memo.sig{l}` (B,) a fingerprint of the weights that
made them (a fixed random projection of LN, K/V and W_{k,R}; NaN in a fresh state). A call then projects only its
own bytes: one position of K/V a byte instead of n_cm + n_m + S. A layer projects its whole memory afresh, as without
the cache, where a row's fingerprint differs from the current weights' (a fresh or imported state, weights changed by
full dynamic evaluation, another model's state) and where the weights need a gradient (training; full dynamic
evaluation's adapted layers: the memory's keys take part in their gradient); in training mode the cache is not kept.
The `memo.` tensors are derived (`State.persistent`): exports and stores leave them out, an import starts them
stale. They triple a session's state in memory.

With `cmem_len` 0 there is no compressed memory and no f: evicted inputs are dropped, which is Transformer-XL's memory
(the ablation "compressed memory against none at equal attention length" gives it mem_len = n_m + n_cm).

Compression f (config `compression`, sec. 3.1): "max" / "mean" pooling and "conv" (kernel = stride = c, initialised
as mean pooling) through `kernels.compress_memory`; "dilated": residual dilated 1-D convs (kernel 3, dilations
1, 2, "same" zero padding inside the evicted window, GELU) then the strided conv; "most_used": keep the n/c evicted
slots with the highest average attention received, in their original order. The attention they received is taken
from one cheap content-only pass (no positions, no gradient) at eviction: the completing segment's queries over
the fine memory it saw plus itself (causal), averaged over heads and queries.

Attention-reconstruction loss (sec. 3.2, "Attention"), training mode only, for the modes with parameters (conv,
dilated): at each eviction, || attn(q, E) - attn(q, f(E)) ||^2 per layer, with E the evicted inputs (detached), q
the completing segment's inputs, and the layer's LN / Q / K / V weights as detached copies through F.linear
(content-only multi-head attention, before the output projection). Mean squared error over the rows that evicted,
summed over layers, averaged over the evictions of the call, times `recon_weight`, in `Output.aux["recon"]` (the
trainer adds it to the loss). The stored compressed memory is detached: the LM loss gives f no gradient, the
reconstruction loss gives the attention weights none. In a call with no eviction the term is 0 x f's parameters
(so DistributedDataParallel sees them used).

Nothing is training-only: f compresses memories at inference too. Registered in models/registry.py as "compressive".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels._dispatch import resolve_impl
from kernels.adapter import apply_adapter_positions
from kernels.attention import memory_attention
from kernels.compress import compress_memory, fixed_memory_update
from models._branches import (
    Group,
    Parts,
    RootStack,
    append_tail,
    branch_forward,
    dense,
    groups,
    grow,
    no_keys,
    own_keys,
    root_memo,
    root_rows,
    shared,
    step_attention,
    tail_padding,
)
from models.base import DERIVED, ROOT, Adapter, FeedForward, LanguageModel, ModelConfig, Output, Site, State, left_pad

__all__ = ["COMPRESSIONS", "CompressiveConfig", "CompressiveTransformer"]

COMPRESSIONS = ("conv", "mean", "max", "dilated", "most_used")
_DILATIONS = (1, 2)
_PROBES: dict[torch.device, torch.Tensor] = {}
TAIL_N = DERIVED + "tail_n"  # the branch form's: each row's bytes in its tail (`branch`)
FILLS = DERIVED + "fills"  # the branch form's roots': their valid compressed and fine slots (`branch`)


def _fingerprint(weights: list[torch.Tensor]) -> torch.Tensor:
    """A float32 scalar that changes when any of `weights` changes: their dot product with a fixed uniform random
    vector (this process's; fingerprints are never exported)."""
    flat = torch.cat([w.detach().reshape(-1).float() for w in weights])
    probe = _PROBES.get(flat.device)
    if probe is None or probe.numel() < flat.numel():
        probe = torch.rand(flat.numel(), generator=torch.Generator().manual_seed(0x5EED)).to(flat.device)
        _PROBES[flat.device] = probe
    return torch.dot(flat, probe[: flat.numel()])


def _like(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values in `dtype` (autocast computes in bf16 what the cache keeps in float32: a copy)."""
    return parts if all(k.dtype == dtype for k, _ in parts) else [(k.to(dtype), v.to(dtype)) for k, v in parts]


@dataclass(frozen=True)
class CompressiveConfig(ModelConfig):
    arch = "compressive"
    vocab_size: int = 256
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_ff: int = 512
    segment: int = 48  # S, the grid on which memories are updated (paper enwik8: 768)
    mem_len: int = 48  # n_m (paper: 768)
    cmem_len: int = 72  # n_cm (paper: 1152); 0: no compressed memory, evicted inputs dropped (Transformer-XL)
    rate: int = 3  # c (paper: 3)
    compression: str = "conv"  # one of COMPRESSIONS (paper: conv + attention reconstruction, the best)
    recon_weight: float = 1.0  # weight of the attention-reconstruction loss (reaches only f)
    dropout: float = 0.0
    adapt_layer: int = -1  # the site sits after this block (-1: the last)
    adapter_units: int = 0  # default k of the site (0: all of d_model)


def _sinusoid(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """R[d] for d = 0..length-1 (Transformer-XL sec. 3.3: sinusoids of the relative distance) -> (length, dim)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))  # (dim/2,)
    ang = torch.arange(length, device=device, dtype=torch.float32).view(-1, 1) * inv  # (length, dim/2)
    return torch.cat([ang.sin(), ang.cos()], 1).to(dtype)  # (length, dim)


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """(B, L, D) -> (B, H, L, D/H)."""
    B, L, D = t.shape
    return t.view(B, L, H, D // H).transpose(1, 2)


def _content_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Content-only attention weights: q (B, H, Lq, Dh), k (B, H, Lk, Dh), allowed (B, Lq, Lk) -> (B, H, Lq, Lk).
    A query with no allowed key gets all zeros."""
    some = allowed.any(-1, keepdim=True)  # (B, Lq, 1) rows with no key: every key, then zeroed (no NaN gradient)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, Lq, Lk)
    scores = scores.masked_fill(~(allowed | ~some).unsqueeze(1), -math.inf)
    return torch.softmax(scores.float(), -1).to(q.dtype) * some.unsqueeze(1)


class _Compressor(nn.Module):
    """f: the evicted window (B, S, D) -> (B, S/c, D) (sec. 3.1). "most_used" needs the slots' usage."""

    def __init__(self, cfg: CompressiveConfig) -> None:
        super().__init__()
        D, c = cfg.d_model, cfg.rate
        self.mode, self.rate = cfg.compression, c
        if self.mode in ("conv", "dilated"):
            # initialised as mean pooling: the memory is meaningful before the reconstruction loss has trained f
            weight = torch.empty(D, D, c)  # (D, D, c) Conv1d layout
            if not weight.is_meta:  # a skeleton (models/_skeleton.py) has no values; eye on meta imports torch._dynamo
                weight = torch.eye(D).unsqueeze(-1).repeat(1, 1, c) / c
            self.weight = nn.Parameter(weight)
            self.bias = nn.Parameter(torch.zeros(D))
        if self.mode == "dilated":
            convs = [nn.Conv1d(D, D, 3, dilation=d, padding=d) for d in _DILATIONS]
            with torch.no_grad():
                for conv in convs:
                    nn.init.normal_(conv.weight, std=0.02)
                    nn.init.zeros_(cast(torch.Tensor, conv.bias))
            self.dilated = nn.ModuleList(convs)

    @property
    def trained(self) -> bool:
        return self.mode in ("conv", "dilated")

    def forward(self, win: torch.Tensor, usage: torch.Tensor | None = None) -> torch.Tensor:
        """win (B, S, D); usage (B, S) for "most_used" (-inf on the slots not evicted) -> (B, S/c, D). For
        "most_used" a row with e evicted slots keeps its e/c most used, oldest first, in the last e/c slots."""
        if self.mode == "most_used":
            assert usage is not None
            B, S, D = win.shape
            n = S // self.rate
            quota = usage.isfinite().sum(1, keepdim=True) // self.rate  # (B, 1) e/c
            order = usage.argsort(dim=1, descending=True, stable=True)  # (B, S) most used first
            rank = order.argsort(dim=1, stable=True)  # (B, S) each slot's rank
            keep = rank < quota  # (B, S)
            idx = torch.arange(S, device=win.device).expand(B, S)
            order = torch.where(keep, idx, idx - S).sort(1).values[:, S - n :] % S  # (B, n) kept, oldest first
            return win.gather(1, order.unsqueeze(-1).expand(B, n, D))  # (B, n, D)
        if self.mode == "dilated":
            h = win.transpose(1, 2)  # (B, D, S)
            for conv in self.dilated:
                h = h + F.gelu(conv(h))  # (B, D, S) sec. 3.1 "Dilated Convolution", then the strided conv
            win = h.transpose(1, 2)  # (B, S, D)
        if self.trained:
            return compress_memory(win, rate=self.rate, mode="conv", weight=self.weight, bias=self.bias)
        return compress_memory(win, rate=self.rate, mode=self.mode)  # (B, S/c, D) max / mean pooling


class _Block(nn.Module):
    def __init__(self, cfg: CompressiveConfig) -> None:
        super().__init__()
        D, H = cfg.d_model, cfg.n_head
        self.n_head = H
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(D)
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)
        self.r_net = nn.Linear(D, D, bias=False)  # W_{k,R}: projects the sinusoids R
        self.u = nn.Parameter(torch.zeros(H, D // H))  # Transformer-XL's global content bias u
        self.v = nn.Parameter(torch.zeros(H, D // H))  # and positional bias v
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = FeedForward(D, cfg.d_ff, cfg.dropout)
        # f, absent without a compressed memory (cmem_len 0: no parameters that nothing reads)
        self.compressor = _Compressor(cfg) if cfg.cmem_len else None
        # the projected sinusoids by (device, dtype, autocast): W_{k,R}'s fingerprint and r (`positions`)
        self._positions: dict[tuple[torch.device, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self.longest = cfg.cmem_len + cfg.mem_len + 2 * cfg.segment  # > any piece's keys (n_cm + n_m + S - 1 + S)
        self._signature: tuple[tuple[tuple[int, int, int], ...], torch.Tensor] | None = None  # `signature`'s

    @property
    def compressor_(self) -> _Compressor:
        assert self.compressor is not None, "a model with cmem_len 0 compresses nothing"
        return self.compressor

    def project(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys and values of layer inputs (B, L, D) -> (B, L, 2D), [k ; v] on the last dim."""
        out: torch.Tensor = self.kv(self.ln1(keys))
        return out

    def signature(self) -> torch.Tensor:
        """The fingerprint of the weights the cached projections depend on (`project`'s and W_{k,R}, `positions`'):
        a cached projection is stale when it changes. Weights that take no gradient (a frozen model's: constants)
        keep theirs while the same tensors, unmodified (their version counters), hold them; others get one per
        call."""
        weights = [self.ln1.weight, self.ln1.bias, self.kv.weight, self.kv.bias, self.r_net.weight]
        if any(w.requires_grad for w in weights):
            return _fingerprint(weights)
        key = tuple((id(w), w.data_ptr(), w._version) for w in weights)
        if self._signature is None or self._signature[0] != key:
            self._signature = (key, _fingerprint(weights))
        return self._signature[1]

    def positions(self, n: int, like: torch.Tensor, sig: torch.Tensor | None) -> torch.Tensor:
        """r = W_{k,R} R[d] for d = 0..n-1 -> (n, H, Dh) (TXL sec. 3.3), like `like`'s device and dtype. Given the
        layer's `signature` (outside training) and where W_{k,R} needs no gradient, projected once for the longest
        distance a piece can have and sliced (R[d] does not depend on n), afresh when the signature or the autocast
        setting changes."""
        H, D = self.n_head, like.shape[-1]
        if sig is None or self.training or (torch.is_grad_enabled() and self.r_net.weight.requires_grad):
            fresh: torch.Tensor = self.r_net(_sinusoid(n, D, like.device, like.dtype))
            return fresh.view(n, H, D // H)
        key = (like.device, like.dtype, torch.is_autocast_enabled(like.device.type))
        hit = self._positions.get(key)
        if hit is None or not (hit[0] is sig or bool(hit[0] == sig)) or hit[1].shape[0] < n:
            longest = max(n, self.longest)
            r = self.r_net(_sinusoid(longest, D, like.device, like.dtype)).view(longest, H, D // H).detach()
            hit = self._positions[key] = (sig, r)
        return hit[1][:n]

    def projects_with_grad(self) -> bool:
        """The projection's weights need a gradient in this call (training, full dynamic evaluation)."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (*self.ln1.parameters(),
                                                                         *self.kv.parameters()))

    def forward(self, x: torch.Tensor, ctx_kv: torch.Tensor, key_lengths: torch.Tensor | None,
                sig: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, m, D) the piece's inputs; ctx_kv (B, Lc, 2D) the keys and values of the memories' slots before
        them; key_lengths (B,) valid keys of [ctx ; x], the last ones (None: all); sig the layer's `signature` (None:
        nothing cached) -> (B, m, D), the piece's own keys and values (B, m, 2D)."""
        B, m, D = x.shape
        H = self.n_head
        q, kv_x = self.inputs(x)  # (B, m, D), (B, m, 2D)
        k, v = torch.cat([ctx_kv.to(kv_x.dtype), kv_x], 1).chunk(2, -1)  # (B, Lc+m, D) each
        r = self.positions(k.shape[1], x, sig)  # (Lc+m, H, Dh) W_{k,R} R_{i-j}, indexed by distance
        att = memory_attention(_heads(q, H), _heads(k, H), _heads(v, H), rel=(r, self.u, self.v),
                               key_lengths=key_lengths)  # (B, H, m, Dh) TXL eq. terms (a)-(d), causal bottom-right
        return self.outputs(x, att.transpose(1, 2).reshape(B, m, D)), kv_x

    def step_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`inputs` at one position a row outside autograd (a decode step): x (B, D) -> (B, D), (B, 2D), through
        `dense`."""
        qkv = dense((self.q, self.kv), self.ln1(x))  # (B, 3D) one product for both
        return qkv[:, : x.shape[-1]], qkv[:, x.shape[-1] :]

    def step_outputs(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """`outputs` at one position a row outside autograd (a decode step): x, att (B, D) -> (B, D), through
        `dense`; the residual sums out of place, in x's dtype as `outputs`' (float32 under a bf16 autocast, where a
        sum into the product would round the residual stream to bf16)."""
        up, down = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])
        x = x + dense(self.proj, att)  # (B, D)
        return x + dense(down, dense(up, self.ln2(x)).relu_())

    def inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's inputs of x (B, m, D): its queries (B, m, D) and its keys and values (B, m, 2D)."""
        h = self.ln1(x)  # (B, m, D)
        return self.q(h), self.kv(h)

    def outputs(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The block's output from its input x and the attention's att (B, m, D), heads concatenated: the
        projection and the MLP, each added to the residual -> (B, m, D)."""
        if self.training and self.dropout:
            x = x + F.dropout(self.proj(att), self.dropout)  # (B, m, D)
            return x + F.dropout(self.mlp(self.ln2(x)), self.dropout)
        x = x + self.proj(att)  # (B, m, D)
        h: torch.Tensor = self.mlp(self.ln2(x))  # (B, m, D)
        return x + h

    def _frozen_qkv(self, seg: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries of seg (B, Lq, D) and keys/values of keys (B, Lk, D) with detached copies of this layer's weights
        (stop-gradient for the reconstruction loss without touching the module's parameters) -> heads."""
        D = seg.shape[-1]
        ln = (self.ln1.normalized_shape, self.ln1.weight.detach(), self.ln1.bias.detach(), self.ln1.eps)
        q = F.linear(F.layer_norm(seg, *ln[:3], eps=ln[3]), self.q.weight.detach(), self.q.bias.detach())
        kw, kb = self.kv.weight.detach(), self.kv.bias.detach()
        k = F.linear(F.layer_norm(keys, *ln[:3], eps=ln[3]), kw[:D], kb[:D])
        v = F.linear(F.layer_norm(keys, *ln[:3], eps=ln[3]), kw[D:], kb[D:])
        return _heads(q, self.n_head), _heads(k, self.n_head), _heads(v, self.n_head)

    def usage(self, seg: torch.Tensor, window: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        """Average content-only attention each slot of window (B, Lw, D) receives from the segment's queries seg
        (B, S, D), which are window's last S slots (causal; the last n_valid (B,) slots are valid) -> (B, Lw)."""
        B, S, _ = seg.shape
        Lw = window.shape[1]
        q, k, _ = self._frozen_qkv(seg, window)
        i = torch.arange(S, device=seg.device).view(S, 1)
        j = torch.arange(Lw, device=seg.device).view(1, Lw)
        allowed = (j <= Lw - S + i).unsqueeze(0) & (j >= Lw - n_valid.view(B, 1)).unsqueeze(1)  # (B, S, Lw)
        return _content_probs(q, k, allowed).mean((1, 2))  # (B, Lw)

    def recon_loss(self, seg: torch.Tensor, evicted: torch.Tensor, comp: torch.Tensor, n_ev: torch.Tensor,
                   rate: int) -> torch.Tensor:
        """||attn(q, E) - attn(q, f(E))||^2 (sec. 3.2 "Attention"): seg (B, S, D) the queries' inputs, evicted
        (B, S, D) with its last n_ev (B,) slots valid, comp = f(evicted) (B, S/c, D), last n_ev/c valid. Mean over
        the rows with n_ev > 0 of each row's mean squared error. Only f gets a gradient."""
        B, S, _ = seg.shape
        rows = n_ev > 0  # (B,)
        q, k, v = self._frozen_qkv(seg, evicted)
        _, kc, vc = self._frozen_qkv(seg, comp)
        n = comp.shape[1]
        ok_e = torch.arange(S, device=seg.device) >= S - n_ev.view(B, 1)  # (B, S)
        ok_c = torch.arange(n, device=seg.device) >= n - (n_ev // rate).view(B, 1)  # (B, S/c)
        old = _content_probs(q, k, ok_e.unsqueeze(1).expand(B, S, S)) @ v  # (B, H, S, Dh) no positions
        new = _content_probs(q, kc, ok_c.unsqueeze(1).expand(B, S, n)) @ vc  # (B, H, S, Dh)
        err = (old - new).pow(2).mean((1, 2, 3))  # (B,)
        return (err * rows).sum() / rows.sum().clamp(min=1)


class CompressiveTransformer(LanguageModel):
    config: CompressiveConfig

    def __init__(self, config: CompressiveConfig) -> None:
        super().__init__()
        c = config.rate
        if config.d_model % config.n_head or config.d_model % 2:
            raise ValueError("d_model must be even and a multiple of n_head")
        if config.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}")
        if c < 1 or config.segment % c or config.mem_len % c or config.mem_len < 1 or config.cmem_len < 0:
            raise ValueError("segment and mem_len must be positive multiples of rate; cmem_len >= 0")
        if not -config.n_layer <= config.adapt_layer < config.n_layer:
            raise ValueError("adapt_layer must name a block")
        self.config = config
        D = config.d_model
        self.embed = nn.Embedding(config.vocab_size, D)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, config.vocab_size)
        self._stack = RootStack()  # the roots of generations fed together, stacked (`_branch_step`)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=0.1)

    # -- interface ---------------------------------------------------------------------------------------------

    @property
    def layers(self) -> list[_Block]:
        return [cast(_Block, b) for b in self.blocks]

    @property
    def trains_compressor(self) -> bool:
        """f has parameters (conv, dilated): the reconstruction loss trains them."""
        return self.config.cmem_len > 0 and self.config.compression in ("conv", "dilated")

    @property
    def site_layer(self) -> int:
        return self.config.adapt_layer % self.config.n_layer

    @property
    def fine_slots(self) -> int:
        """Slots of `mem{l}`: n_m completed inputs plus up to S - 1 pending ones of the current segment."""
        return self.config.mem_len + self.config.segment - 1

    def init_state(self, batch: int) -> State:
        p = self.embed.weight
        D = self.config.d_model
        tensors = {"seen": torch.zeros(batch, dtype=torch.long, device=p.device)}
        for i in range(self.config.n_layer):
            tensors[f"mem{i}"] = torch.zeros(batch, self.fine_slots, D, dtype=p.dtype, device=p.device)
            tensors[f"cmem{i}"] = torch.zeros(batch, self.config.cmem_len, D, dtype=p.dtype, device=p.device)
            tensors[f"memo.kv_mem{i}"] = torch.zeros(batch, self.fine_slots, 2 * D, dtype=p.dtype, device=p.device)
            tensors[f"memo.kv_cmem{i}"] = torch.zeros(batch, self.config.cmem_len, 2 * D, dtype=p.dtype,
                                                      device=p.device)
            tensors[f"memo.sig{i}"] = torch.full((batch,), math.nan, dtype=torch.float32, device=p.device)
        return State(tensors)

    def adaptation_sites(self) -> list[Site]:
        return [Site("resid", self.config.d_model, layer=self.config.adapt_layer, per_step=False,
                     units=self.config.adapter_units)]

    def fills(self, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid slots of the fine and the compressed memory after `seen` (B,) bytes -> (n_fine, n_cmem), (B,)."""
        cfg = self.config
        p = seen % cfg.segment
        n_f = torch.minimum(seen, cfg.mem_len + p)
        n_c = ((seen - p - cfg.mem_len).clamp(min=0) // cfg.rate).clamp(max=cfg.cmem_len)
        return n_f, n_c

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        """tokens: (B, T) int64; state: seen (B,), mem{l} (B, n_m+S-1, D), cmem{l} (B, n_cm, D);
        adapter: mats["resid"] (B, k, k). Cut into pieces at the segment grid (module docstring)."""
        if ROOT in state.tensors:  # the branch form (`branch`)
            return self._branch_forward(tokens, state, adapter)
        B, T = tokens.shape
        S = self.config.segment
        st = dict(state.tensors)
        st["seen"] = st["seen"].clamp(min=0)  # an imported state is validated for shape and dtype only
        if "memo.sig0" not in st:  # a persistent state (`State.persistent`): the cache starts stale
            st.update({k: v for k, v in self.init_state(B).tensors.items() if k.startswith(DERIVED)})
        mats = adapter.mats["resid"] if adapter is not None else None
        p = self.config.dropout if self.training else 0.0
        x_all = F.dropout(self.embed(tokens), p)  # (B, T, D)
        finals, recon = [], []
        i = 0
        while i < T:
            m = min(T - i, int((S - st["seen"] % S).min()))  # up to the first row's segment end
            x, st, rec = self._piece(x_all[:, i : i + m], st, mats)
            finals.append(x)
            if rec is not None:
                recon.append(rec)
            i += m
        x = torch.cat(finals, 1) if finals else x_all  # (B, T, D)
        hidden = self.ln_f(x)  # (B, T, D)
        logits = self.head(hidden)  # (B, T, V)
        aux = {}
        if self.training and self.trains_compressor:
            if recon:
                aux["recon"] = self.config.recon_weight * torch.stack(recon).mean()
            else:  # no eviction in this call: f still takes part in the graph (DDP expects every parameter used)
                weights = [w.sum() for b in self.layers for w in b.compressor_.parameters()]
                aux["recon"] = 0.0 * torch.stack(weights).sum()
        return Output(logits=logits, state=State(st), aux=aux, hidden=hidden)

    def branch(self, state: State) -> State:
        """The branch form (models/_branches.py): each row's state as its root (one root when the rows are all one),
        with empty tails. `seen` stays each row's own count; `memo.tail_x{l}` (B, t, D) and `memo.tail_kv{l}` (B, t,
        2D) hold the layer inputs and keys/values of the row's last `memo.tail_n` bytes, the newest slots of its fine
        memory, and its root the rest of its memories: their valid slots counted by the root's `memo.fills` (1, 2)
        (compressed, fine). A root made here is the row's state as of `seen - memo.tail_n` (its fills follow from its
        `seen`); one made by a segment's close in the form (`_close`) holds the memories after the close less the
        tail's inputs, which stay in the rows' tails. Every root holds zeros outside its valid slots, as the usual
        form does. With the Triton kernels (a GPU), the state itself: the kernels take the usual steps."""
        if ROOT in state.tensors or resolve_impl(None, state.tensors["seen"]) == "triton":
            return state
        B, D = state.batch, self.config.d_model
        ref = state.tensors["mem0"]
        st = dict(state.tensors)
        if "memo.sig0" not in st:
            st.update({k: v for k, v in self.init_state(B).tensors.items() if k.startswith(DERIVED)})
        one = all(shared(v) for v in st.values())
        st[FILLS] = torch.stack(self.fills(st["seen"])[::-1], 1)  # (B, 2) compressed, fine
        rows = {"seen": st["seen"], ROOT: torch.zeros(B, dtype=torch.long, device=ref.device) if one else
                torch.arange(B, device=ref.device), TAIL_N: torch.zeros(B, dtype=torch.long, device=ref.device)}
        for i in range(self.config.n_layer):
            rows[f"{DERIVED}tail_x{i}"] = ref.new_zeros(B, 0, D)
            rows[f"{DERIVED}tail_kv{i}"] = ref.new_zeros(B, 0, 2 * D)
        return State(rows, tuple(State(st).select(i) for i in range(1 if one else B)))

    def settle(self, state: State) -> State:
        """The usual form: each row's root with its tail written into its fine memories; a copy per row."""
        if ROOT not in state.tensors:
            return state
        st, n = state.tensors, state.tensors[TAIL_N]
        out = {k: st["seen"] if k == "seen" else root_rows(state, k) for k in state.roots[0].tensors if k != FILLS}
        for i in range(self.config.n_layer):
            out[f"mem{i}"] = append_tail(out[f"mem{i}"], st[f"{DERIVED}tail_x{i}"], n)  # (B, n_m+S-1, D)
            out[f"{DERIVED}kv_mem{i}"] = append_tail(out[f"{DERIVED}kv_mem{i}"], st[f"{DERIVED}tail_kv{i}"], n)
        return State({k: v.contiguous() if shared(v) and len(n) > 1 else v for k, v in out.items()})

    # -- internals -------------------------------------------------------------------------------------------

    def _branch_forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None) -> Output:
        """forward in the branch form (models/_branches.py, `branch_forward`): `_branch_step` for the rows whose
        root's key/value cache is current and whose byte closes no segment or one the form closes (`_ready`), the
        usual forward for the others."""
        return branch_forward(self, tokens, state, adapter, self._ready, self._branch_step)

    def _root_views(self, root: State) -> tuple[int, int, Parts]:
        """A root's fills (compressed, fine) and each block's cached keys and values of its valid slots by head, in
        key order ([cmem ; mem]: two parts of (k, v), (H, L, Dh) each), views of its cache (made once per root:
        `root_memo`)."""
        H = self.config.n_head
        Dh = self.config.d_model // H
        nc, nf = root.tensors[FILLS][0].tolist()
        views: Parts = []
        for i in range(self.config.n_layer):
            parts = []
            for mem, L in ((root.tensors[f"memo.kv_cmem{i}"], nc), (root.tensors[f"memo.kv_mem{i}"], nf)):
                k, v = mem[0, mem.shape[1] - L :].view(L, 2, H, Dh).permute(1, 2, 0, 3)  # (H, L, Dh) each, in place
                parts.append((k, v))
            views.append(parts)
        return nc, nf, views

    def _views(self, root: State) -> Parts:
        views: Parts = root_memo(root, self._root_views)[2]
        return views

    @staticmethod
    def _current(root: State, sigs: list[torch.Tensor]) -> bool:
        """The root's key/value cache was made by the weights whose fingerprints are `sigs` (`_Block.signature`'s);
        the answer kept with the root while the fingerprints are the same tensors (weights unchanged)."""
        seen = root.memo.get("current")
        if seen is not None and all(a is b for a, b in zip(seen[0], sigs, strict=True)):
            return bool(seen[1])
        ok = all(bool(root.tensors[f"memo.sig{i}"][0] == s) for i, s in enumerate(sigs))
        root.memo["current"] = (sigs, ok)
        return ok

    def _ready(self, state: State) -> torch.Tensor:
        """The rows (B,) bool whose root's cache is current (its fingerprint) and whose byte closes no segment, or
        closes one over the root (`_close`): its tail, with this byte, at most n_m bytes (so that the slots the close
        evicts are the root's) and, with "most_used" f (which weighs the slots by the segment's own queries), nothing
        evicted."""
        cfg = self.config
        sigs = [b.signature() for b in self.layers]
        current = [self._current(r, sigs) for r in state.roots]
        seen = state.tensors["seen"]  # (B,)
        ok = (seen % cfg.segment != cfg.segment - 1) | (state.tensors[TAIL_N] < cfg.mem_len)  # (B,)
        if cfg.cmem_len and cfg.compression == "most_used":
            ok &= (seen % cfg.segment != cfg.segment - 1) | (seen < cfg.mem_len)
        if len(current) == 1:
            return ok if current[0] else torch.zeros_like(ok)
        return torch.tensor(current, device=ok.device)[state.tensors[ROOT]] & ok

    def _branch_step(self, tokens: torch.Tensor, state: State, mats: torch.Tensor | None) -> Output:
        """One byte a row (B, 1) on its root, each row's tail apart, grown by a slot (`grow`): rows with a root of
        their own read its cached keys/values in one batch (`row_attention`; several roots stacked: `RootStack`),
        rows that share roots read them in place by the root's rows' queries (`tree_attention`); the block's
        projections and MLP (`_Block.step_inputs`, `_Block.step_outputs`) over all rows at once."""
        cfg = self.config
        B = tokens.shape[0]
        D, H = cfg.d_model, cfg.n_head
        Dh = D // H
        st = state.tensors
        n = st[TAIL_N]  # (B,)
        t = st["memo.tail_x0"].shape[1] + 1  # the tails with this byte
        pad = tail_padding(n + 1, t)  # (B, 1, t) or None
        own = own_keys(state, self._views, self._stack)  # (L, keys and values, no-key places) or None
        no_key = None
        if own is not None:
            Lr = own[0]  # the root keys of every row, its own right-aligned
            no_key = no_keys(own[2], pad, B, Lr, t)  # (B, 1, 1, Lr + t) or None
        else:
            rooted = [(rows, root_memo(root, self._root_views)) for rows, root in groups(state)]
            Lr = max(nc + nf for _, (nc, nf, _) in rooted)  # the most root keys a row has
        j = torch.arange(Lr + t, device=tokens.device).view(1, -1)  # (1, Lr+t) keys: the root's, the tail
        dist = torch.where(j < Lr, Lr + n.view(B, 1) - j, Lr + t - 1 - j)  # (B, Lr+t) distance of each key
        dist = dist.unsqueeze(1).expand(B, H, Lr + t)  # (B, H, Lr+t)
        sigs = [b.signature() for b in self.layers]  # every root's: the current weights' (`_ready`)
        new = dict(st)
        new["seen"], new[TAIL_N] = st["seen"] + 1, n + 1
        x = self.embed(tokens[:, 0])  # (B, D)
        for i, block in enumerate(self.layers):
            new[f"memo.tail_x{i}"] = grow(st[f"memo.tail_x{i}"], x)  # (B, t, D)
            q, kv_x = block.step_inputs(x)  # (B, D), (B, 2D)
            kept = st[f"memo.tail_kv{i}"]
            kv_x = kv_x if kv_x.dtype == kept.dtype else kv_x.to(kept.dtype)  # autocast: kept in the state's dtype
            tkv = new[f"memo.tail_kv{i}"] = grow(kept, kv_x)  # (B, t, 2D)
            tkv = tkv if tkv.dtype == q.dtype else tkv.to(q.dtype)
            r = block.positions(Lr + t, x, sigs[i])  # (Lr+t, H, Dh) by distance
            qh = q.view(B, H, Dh)
            pos = torch.bmm((qh + block.v).transpose(0, 1), r.permute(1, 2, 0)).transpose(0, 1)  # (B, H, Lr+t)
            bias = pos.gather(-1, dist)  # (B, H, Lr+t) for each key, TXL (b)+(d)
            parts = _like(own[1][i], q.dtype) if own is not None else None  # (B*H, L_i, Dh)
            roots: list[Group] | None = None if own is not None else [
                (rows, _like(views[i], q.dtype)) for rows, (_, _, views) in rooted]
            att = step_attention(qh + block.u, tkv, parts, roots, no_key, pad, bias)  # (B, D) TXL (a)-(d)
            x = block.step_outputs(x, att)  # (B, D)
            if i == self.site_layer and mats is not None:
                x = apply_adapter_positions(x.unsqueeze(1), mats).squeeze(1)  # (B, D) h' = h + M h
        hidden = self.ln_f(x)  # (B, D)
        closing = new["seen"] % cfg.segment == 0  # (B,) rows whose byte closed their segment
        after = self._close(new, state.roots, closing) if bool(closing.any()) else State(new, state.roots)
        return Output(logits=dense(self.head, hidden).unsqueeze(1), state=after, hidden=hidden.unsqueeze(1))

    def _close(self, rows: dict[str, torch.Tensor], roots: tuple[State, ...], closing: torch.Tensor) -> State:
        """The rows `closing` (B,) bool of a branch-form state (its tensors `rows`, its `roots`), whose byte just
        closed their segment, on new roots that hold the close: their tails stay as they are (the segment's newest
        inputs, now the newest of the fine memory) and the rows of one root whose tails are as long close it
        together, once (`_closed`). The close's arithmetic is the usual path's, on the same slots."""
        ids = rows[ROOT].clone()  # (B,)
        made: dict[tuple[int, int], int] = {}
        every = list(roots)
        t_all, seen_all = rows[TAIL_N].tolist(), rows["seen"].tolist()
        for b in closing.nonzero()[:, 0].tolist():
            key = (int(ids[b]), t_all[b])
            if key not in made:
                closed = self._closed(roots[key[0]], key[1], seen_all[b])
                made[key] = key[0] if closed is roots[key[0]] else len(every)  # nothing evicted: the same root
                if made[key] == len(every):
                    every.append(closed)
            ids[b] = made[key]
        return State({**rows, ROOT: ids})._keep(tuple(every))

    def _closed(self, root: State, t: int, seen: int) -> State:
        """The root `root`'s rows with tails of t bytes, the last of which closed their segment at `seen` bytes ->
        their new root: the slots that the close evicts from the fine memory (the root's oldest valid ones: t <= n_m)
        compressed by f into the compressed memory, as the usual path's `_piece` does on the same slots (f's window,
        the new compressed slots' keys and values, the compressed memory's FIFO), and cleared from a copy of the fine
        memory and its cache; the root itself where nothing is evicted. Made once per root and tail length (kept
        with the root: a search's rows at one depth cross in several rounds)."""
        key = f"_closed{t}"
        if key in root.memo:
            closed: State = root.memo[key]
            return closed
        cfg = self.config
        S, c, K, Lf = cfg.segment, cfg.rate, cfg.cmem_len, self.fine_slots
        n_ev = min(max(seen - cfg.mem_len, 0), S)  # the slots evicted, a multiple of c
        if n_ev == 0:
            return root
        nc, nf = root.tensors[FILLS][0].tolist()  # the root's valid slots before the close
        first = Lf - nf  # the oldest valid fine slot, the first evicted
        new = dict(root.tensors)
        for i, block in enumerate(self.layers):
            for name in (f"mem{i}", f"memo.kv_mem{i}"):
                new[name] = root.tensors[name].clone()  # (1, Lf, ·)
                new[name][:, first : first + n_ev] = 0
            if not K:
                continue  # no compressed memory: the evicted slots drop
            # f's window as the usual path's: the S slots before the n_m kept, the last n_ev of them evicted, zeros
            # before (the root's invalid slots)
            win = root.tensors[f"mem{i}"][:, first + n_ev - S : first + n_ev]  # (1, S, D)
            comp = block.compressor_(win)  # (1, S/c, D)
            real = (torch.arange(S // c, device=win.device) >= (S - n_ev) // c).view(1, -1, 1)  # (1, S/c, 1)
            for name, slots in ((f"cmem{i}", comp), (f"memo.kv_cmem{i}", block.project(comp))):
                old = root.tensors[name]  # (1, K, ·)
                new[name] = torch.cat([old, slots.to(old.dtype).masked_fill(~real, 0)], 1)[:, -K:]  # oldest drop
        n_f, n_c = self.fills(torch.tensor([seen], device=root.tensors["seen"].device))
        new[FILLS] = torch.stack([n_c, n_f - t], 1)  # (1, 2) the tail's t inputs are the rows'
        closed = root.memo[key] = State(new)
        return closed

    def _piece(self, x: torch.Tensor, st: dict[str, torch.Tensor], mats: torch.Tensor | None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """m bytes that do not cross any row's segment end: x (B, m, D) embedded -> the last block's output (adapted
        if the site is there) (B, m, D), the new state, the reconstruction loss of this piece (or None)."""
        cfg = self.config
        B, m, D = x.shape
        S, Nm, c = cfg.segment, cfg.mem_len, cfg.rate
        Lf = self.fine_slots
        L = cfg.cmem_len + Lf
        seen = st["seen"]  # (B,)
        n_f, n_c = self.fills(seen)
        done = (seen % S) + m == S  # (B,) rows whose segment completes with this piece
        n_ev = torch.where(done, (seen + m - Nm).clamp(0, S), 0)  # (B,) evicted slots, a multiple of c
        closing = bool(done.any())
        evicting = cfg.cmem_len > 0 and closing and bool((n_ev > 0).any())  # without a compressed memory: dropped

        def fifo(fm: torch.Tensor, add: torch.Tensor, cm: torch.Tensor, comp: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            # FIFO (kernels op: one launch on a GPU): mem <- [mem ; x][m:], cut to the newest n_m where the segment
            # completed; cmem <- [cmem ; comp][-n_cm:] with comp's first S/c - n_ev/c slots zeroed, where n_ev > 0.
            # A piece that closes no row's segment only appends.
            if not closing:
                return torch.cat([fm, add], 1)[:, m:], cm
            return fixed_memory_update(fm, add, done, cm, comp, n_ev // c, mem_len=Nm)
        # keys [valid cmem ; valid mem ; the piece]: when every row has the same fills (one session; a suggestion's
        # branches), the valid slots sliced; otherwise [cmem ; mem] with each row's valid slots made contiguous at
        # the right end by a gather (padding first, masked by key_lengths)
        uniform = B == 1 or bool((n_f == n_f[0]).all() and (n_c == n_c[0]).all())
        if uniform:
            nf, nc = int(n_f[0]), int(n_c[0])
            key_lengths = None  # every key valid

            def context(cm: torch.Tensor, fm: torch.Tensor) -> torch.Tensor:
                return torch.cat([cm[:, cfg.cmem_len - nc :], fm[:, Lf - nf :]], 1)  # (B, nc + nf, ·)
        else:
            key_lengths = n_c + n_f + m  # (B,)
            o = torch.arange(L, device=x.device).view(1, L)
            src = torch.where(o >= L - n_f.view(B, 1), o, o - (Lf - n_f).view(B, 1)).clamp(min=0)  # (B, L)
            valid = ((o >= cfg.cmem_len - n_c.view(B, 1)) & (o < cfg.cmem_len)) | (o >= L - n_f.view(B, 1))  # (B, L)
            valid = valid.unsqueeze(-1)  # (B, L, 1) the slots a row's memories hold

            def context(cm: torch.Tensor, fm: torch.Tensor) -> torch.Tensor:
                both = torch.cat([cm, fm], 1)  # (B, L, ·)
                return both.gather(1, src.unsqueeze(-1).expand(B, L, both.shape[-1]))  # (B, L, ·)
        train_f = self.training and torch.is_grad_enabled() and self.trains_compressor
        new = {"seen": seen + m}
        losses = []
        keep_kv = not self.training  # the key/value cache (module docstring): kept outside training
        for i, block in enumerate(self.layers):
            mem, cmem = st[f"mem{i}"], st[f"cmem{i}"]
            kv_mem, kv_cmem, sig = st[f"memo.kv_mem{i}"], st[f"memo.kv_cmem{i}"], st[f"memo.sig{i}"]
            now = block.signature() if keep_kv else sig
            if not (keep_kv and not block.projects_with_grad() and bool((sig == now).all())):
                # the memory projected afresh (stale cache, or weights that need the keys' gradient)
                if uniform:
                    part = block.project(context(cmem, mem))  # (B, Lc, 2D) the valid slots only
                    kv_cmem, kv_mem = left_pad(part[:, :nc], cfg.cmem_len), left_pad(part[:, nc:], Lf)
                else:
                    # the padding projects to the LN bias's keys, not zeros: cleared, as a row alone has it
                    both = block.project(torch.cat([cmem, mem], 1)).masked_fill(~valid, 0)  # (B, L, 2D)
                    kv_cmem, kv_mem = both[:, : cfg.cmem_len], both[:, cfg.cmem_len :]
            ctx_kv = context(kv_cmem, kv_mem)  # (B, Lc, 2D)
            x_in = x.detach()  # (B, m, D) memories are stop-gradient
            x, kv_x = block(x, ctx_kv, key_lengths, now if keep_kv else None)
            comp = None
            if evicting:
                ext = torch.cat([mem, x_in], 1)  # (B, Lf+m, D)
                win = ext[:, m - 1 : m - 1 + S]  # (B, S, D) the S slots before the kept n_m; the last n_ev valid
                seg = ext[:, Lf + m - S :]  # (B, S, D) the completing segment's inputs
                usage = None
                if block.compressor_.mode == "most_used":
                    with torch.no_grad():
                        w = ext[:, m - 1 :]  # (B, S + n_m, D): evicted, kept, the segment (its tail)
                        usage = block.usage(seg, w, Nm + n_ev)[:, :S]  # (B, S) sec. 3.1 "Most-used"
                        usage = usage.masked_fill(torch.arange(S, device=x.device) < S - n_ev.view(B, 1), -math.inf)
                with torch.set_grad_enabled(train_f):
                    comp = block.compressor_(win, usage)  # (B, S/c, D)
                if train_f:
                    losses.append(block.recon_loss(seg, win, comp, n_ev, c))
                comp = comp.detach()  # the LM loss gives f no gradient
            new[f"mem{i}"], new[f"cmem{i}"] = fifo(mem, x_in, cmem, comp)
            if keep_kv:  # the cache follows the memories: the piece's own projections, the new compressed slots'
                with torch.no_grad():
                    dtype = st[f"memo.kv_mem{i}"].dtype  # the state's (autocast computes bf16)
                    kv_comp = block.project(comp).to(dtype) if comp is not None else None
                    new[f"memo.kv_mem{i}"], new[f"memo.kv_cmem{i}"] = fifo(
                        kv_mem.detach().to(dtype), kv_x.detach().to(dtype), kv_cmem.detach().to(dtype), kv_comp)
                new[f"memo.sig{i}"] = now.expand_as(sig).clone()
            else:
                new[f"memo.kv_mem{i}"], new[f"memo.kv_cmem{i}"] = st[f"memo.kv_mem{i}"], st[f"memo.kv_cmem{i}"]
                new[f"memo.sig{i}"] = torch.full_like(sig, math.nan)  # the weights move under training: stale
            if i == self.site_layer and mats is not None:
                x = apply_adapter_positions(x, mats)  # (B, m, D) h' = h + M h at every position, one bmm
        return x, new, torch.stack(losses).sum() if losses else None
