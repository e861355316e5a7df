"""Transformer language model with adaptive input representations and an adaptive softmax (Baevski & Auli 2019,
sec. 3-4; docs/algorithms.md §8), for word vocabularies sorted by frequency (models/word_tokenizer.py).

    x = s * AdaptiveInput(w) + PE[pos]      s = sqrt(d); PE sinusoidal over the window's positions (sec. 4.1)
    block l:  x += Attn(LN(x))              pre-LN (sec. 4.1), causal, over the current window
              x += FFN(LN(x))               ReLU(x W1 + b1) W2 + b2
    h' = h + M h                            adaptation site "resid" on the first k units, after block `adapt_layer`
    h = LN(x_N)                             `Output.hidden` (the neural cache reads it)
    log p(. | h) = AdaptiveSoftmax(h)       head words + one logit per tail cluster, then the word in the cluster

The blocks, the windowed KV cache and the sliding procedure are the character transformer's (models/
char_transformer.py: `_Block`, `slide_windows`, `append_blocks`; its docstring describes the window, the stride and
their cost); only the input (adaptive input and sinusoids added once, not a learned table per layer), the output
and the absence of auxiliary losses differ. `adaptive=False` gives the same transformer with a plain embedding
(N(0, d^-1/2), scaled by s as well) and a full softmax without bias, the issue's comparison.

Decision, `Output.logits`: with the adaptive softmax the forward's logits are the full log-probabilities (B, T, V)
(`AdaptiveSoftmax.log_prob`; log_softmax of them is the identity, so anything that normalises logits still works),
computed only in eval mode. In training mode the forward returns an empty (B, T, 0) tensor instead, the distribution
is never formed, and `loss`/`target_logprobs` read `Output.hidden` through `AdaptiveSoftmax.target_log_prob` (the
head plus only the target's band). So:
- `target_logprobs(output, targets)` uses the hidden states whenever the output has them (any mode), else gathers
  from the logits (an Output rebuilt from logits alone, as sparse dynamic evaluation does);
- `log_probs(output)` returns the logits when they hold the distribution, else computes it from the hidden states.
The two agree up to float summation order (tests/models/test_adaptive_transformer.py).

Decision, cutoffs: `cutoffs` are either all fractions of the vocabulary in (0, 1) (the default, since the trainer
sets `vocab_size` from the tokenizer only when it builds the model), turned into ids round(f * V), or all absolute
ids (integers >= 1). Fractions that fall on 0, repeat, or reach V are dropped (a tiny vocabulary gets fewer
bands); absolute ids must be valid as they are (models/adaptive.py `band_bounds`). The default (0.1, 0.3) follows
the paper's WikiText-103 split (20K / 60K of 267K: 0.075, 0.22) rounded towards a larger head for small vocabularies.

Decision, scaling: the paper adds none (sec. 3) but its code (fairseq's TransformerDecoder, `embed_scale`) multiplies
the embeddings by sqrt(d) as Vaswani et al. do, adaptive input included; so does this model, in both modes: the
adaptive input's rows have norm ~1 (entries ~d^-1/2) and the sinusoids entries of ~1, so unscaled embeddings would
be swamped by the positions.

Tying (`tie_weights`, sec. 3 "Weight sharing"): `AdaptiveSoftmax.tie(input, projections=True)`: the band embeddings
and the tail projections are the input's Parameters themselves; never the input's head projection (the softmax has
none), nor the cluster rows. The state dict holds each shared tensor once, under the input's name (a state-dict hook
drops the softmax's aliases; safetensors refuses shared storage), and loading (also with `assign=True` onto a model
built on the meta device, as the checkpoint loader does) fills the aliases in and ties again, so the softmax reads
the loaded Parameter objects themselves. `named_parameters` names a shared tensor once, by its input name. With
`adaptive=False`, tying makes the output layer read the embedding's weight itself (as the AWD-LSTM does).

Registered in models/registry.py as "adaptive-transformer".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.adaptive import AdaptiveInput, AdaptiveSoftmax
from models.base import Adapter, LanguageModel, ModelConfig, Output, State
from models.char_transformer import WindowedTransformer, _Block, append_blocks, slide_windows, window_state

__all__ = ["AdaptiveTransformer", "AdaptiveTransformerConfig", "resolve_cutoffs", "sinusoids"]


@dataclass(frozen=True)
class AdaptiveTransformerConfig(ModelConfig):
    arch = "adaptive-transformer"
    vocab_size: int = 10000
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_ff: int = 512
    context: int = 128  # the window C (paper: blocks of 512 tokens)
    stride: int = 0  # how far a full window slides (0: C // 2)
    dropout: float = 0.0  # paper: 0.3 (WikiText-103)
    cutoffs: tuple[float, ...] = (0.1, 0.3)  # band boundaries: fractions of vocab_size, or absolute ids (docstring)
    div_value: float = 4.0  # k: band i has dimension d // k**i (sec. 3)
    tie_weights: bool = True  # bands and tail projections shared with the softmax, never the head projection
    softmax_dropout: float = 0.0  # dropout after the tail projections (sec. 5.4: 0.2 on WikiText-103)
    adaptive: bool = True  # False: a plain embedding and a full softmax (the comparison)
    adapt_layer: int = -1  # the site sits after this block (-1: the last)
    adapter_units: int = 0  # default k of the site (0: all of d_model)

    def __post_init__(self) -> None:
        # a config read back from JSON gives a list; keep the frozen config hashable
        object.__setattr__(self, "cutoffs", tuple(self.cutoffs))


def resolve_cutoffs(cutoffs: tuple[float, ...], vocab_size: int) -> list[int]:
    """Absolute band boundaries for `vocab_size` (module docstring): fractions in (0, 1) -> round(f * V), those on 0,
    repeated or reaching V dropped; integers >= 1 as they are. ValueError for a mixture or anything else."""
    if all(isinstance(c, float) and 0.0 < c < 1.0 for c in cutoffs):
        ids = sorted({round(c * vocab_size) for c in cutoffs})
        return [c for c in ids if 0 < c < vocab_size]
    if all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cutoffs):
        return [int(c) for c in cutoffs]
    raise ValueError(f"cutoffs must be all fractions in (0, 1) or all integer ids >= 1, not {list(cutoffs)!r}")


def sinusoids(pos: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal position embeddings (Vaswani et al. sec. 3.5; paper sec. 4.1): pos (...) int -> (..., dim),
    [sin(p w_i) ; cos(p w_i)], w_i = 10000^(-i / (dim/2 - 1)) as fairseq's. Computed, not stored: no buffer."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) / max(half - 1, 1) * torch.arange(half, device=pos.device))  # (half,)
    angle = pos.unsqueeze(-1).float() * freq  # (..., half)
    out = torch.cat([angle.sin(), angle.cos()], -1)  # (..., 2 half)
    if dim % 2:
        out = F.pad(out, (0, 1))
    return out.to(dtype)


class AdaptiveTransformer(WindowedTransformer, LanguageModel):
    config: AdaptiveTransformerConfig

    def __init__(self, config: AdaptiveTransformerConfig) -> None:
        super().__init__()
        cfg = config
        if cfg.d_model % cfg.n_head:
            raise ValueError("d_model must be a multiple of n_head")
        if cfg.context < 2 or not 0 <= cfg.stride < cfg.context:
            raise ValueError("context must be >= 2 and 0 <= stride < context")
        if not -cfg.n_layer <= cfg.adapt_layer < cfg.n_layer:
            raise ValueError("adapt_layer must name a block")
        for name in ("dropout", "softmax_dropout"):
            if not 0.0 <= getattr(cfg, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        self.config = config
        D, V = cfg.d_model, cfg.vocab_size
        self.scale = math.sqrt(D)
        self.cutoffs = resolve_cutoffs(cfg.cutoffs, V) if cfg.adaptive else []
        self.input: AdaptiveInput | None = None
        self.softmax: AdaptiveSoftmax | None = None
        self.embed: nn.Embedding | None = None
        self.out_weight: nn.Parameter | None = None
        if cfg.adaptive:  # the input first: a shared tensor is named (named_parameters, state dict) by its input name
            self.input = AdaptiveInput(V, D, self.cutoffs, cfg.div_value)
        else:
            self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(D)
        if self.input is not None:
            self.softmax = AdaptiveSoftmax(V, D, self.cutoffs, cfg.div_value, dropout=cfg.softmax_dropout)
            if cfg.tie_weights:
                self.softmax.tie(self.input, projections=True)
                self._aliases = self._tied_names()
                self.register_state_dict_post_hook(_drop_aliases)  # type: ignore[no-untyped-call]
                self.register_load_state_dict_pre_hook(_fill_aliases)  # type: ignore[no-untyped-call]
                self.register_load_state_dict_post_hook(_tie_again)  # type: ignore[no-untyped-call]
        elif not cfg.tie_weights:
            self.out_weight = nn.Parameter(torch.empty(V, D))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.embed is not None:
                nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)  # fairseq's, with the sqrt(d) scale
            if self.out_weight is not None:
                nn.init.normal_(self.out_weight, std=self.config.d_model**-0.5)

    # -- tying ---------------------------------------------------------------------------------------------------

    def _tied_names(self) -> dict[str, str]:
        """{softmax alias: input name} of every shared Parameter (module docstring)."""
        names = {id(p): n for n, p in self.named_parameters()}  # first name of each: the input's
        return {n: names[id(p)] for n, p in self.named_parameters(remove_duplicate=False) if names[id(p)] != n}

    # -- interface -----------------------------------------------------------------------------------------------

    def parameter_layer(self, name: str) -> int | None:
        """blocks.{i}.* -> i; the input side (adaptive input or embedding, the tied bands with it) -> -1; the final
        LN and the softmax's own parameters -> n_layer."""
        if name.startswith("blocks."):
            return int(name.split(".")[1])
        if name.startswith(("input.", "embed.")):
            return -1
        return self.config.n_layer

    def init_state(self, batch: int) -> State:
        return window_state(batch, self.config.context, self.config.d_model, self.config.n_layer, self.ln_f.weight)

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        """tokens: (B, T) int64; state: tok, mask (B, C), k{l}, v{l} (B, C, D); adapter: mats["resid"] (B, k, k).
        logits: the full log-probabilities (B, T, V) in eval mode, (B, T, 0) in training (module docstring)."""
        B, T = tokens.shape
        cfg = self.config
        mats = adapter.mats["resid"] if adapter is not None else None
        finals, _, st = slide_windows(tokens, dict(state.tensors), cfg.context, self.stride, cfg.n_layer,
                                      self._append, self.init_state, mats, False)
        x = torch.cat(finals, 1) if finals else self.ln_f.weight.new_zeros(B, T, cfg.d_model)  # (B, T, D)
        hidden = self.ln_f(x)  # (B, T, D)
        if self.softmax is None:
            logits = F.linear(hidden, self._output_weight())  # (B, T, V)
        elif self.training:
            logits = hidden.new_zeros(B, T, 0)  # the loss reads `hidden` (target_log_prob): no full softmax
        else:
            logits = self.softmax.log_prob(hidden)  # (B, T, V) log-probabilities
        return Output(logits=logits, state=State(st), hidden=hidden)

    def log_probs(self, output: Output) -> torch.Tensor:
        """(B, T, V): the logits if they hold the adaptive softmax's distribution, else computed from `hidden`."""
        if self.softmax is None:
            return super().log_probs(output)
        if output.logits.shape[-1] == self.config.vocab_size:
            return output.logits.float()  # already log-probabilities
        if output.hidden is None:
            raise ValueError("an adaptive-softmax output without the distribution needs its hidden states")
        return self.softmax.log_prob(output.hidden).float()

    def target_logprobs(self, output: Output, targets: torch.Tensor) -> torch.Tensor:
        """(B, T): through `AdaptiveSoftmax.target_log_prob` (the head and the target's band only) when the output
        has its hidden states, else gathered from `log_probs`."""
        if self.softmax is not None and output.hidden is not None:
            return self.softmax.target_log_prob(output.hidden, targets).float()
        return super().target_logprobs(output, targets)

    # -- internals -----------------------------------------------------------------------------------------------

    def _output_weight(self) -> torch.Tensor:
        """The full softmax's (V, D) weight: the embedding itself when tied."""
        assert self.embed is not None
        return self.embed.weight if self.out_weight is None else self.out_weight

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, m) -> (B, m, D), scaled by sqrt(d) (module docstring)."""
        if self.input is not None:
            x: torch.Tensor = self.input(tokens)  # (B, m, D)
        else:
            assert self.embed is not None
            x = self.embed(tokens)  # (B, m, D)
        return x * self.scale

    def _append(self, tokens: torch.Tensor, st: dict[str, torch.Tensor], n: torch.Tensor,
                mats: torch.Tensor | None, collect: bool
                ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        """`append_blocks` with this model's input: tokens (B, m) at positions n..n+m-1 (char_transformer.py)."""
        B, m = tokens.shape
        pos = n.view(B, 1) + torch.arange(m, device=tokens.device).view(1, m)  # (B, m)
        x = self._embed(tokens)  # (B, m, D)
        x = F.dropout(x + sinusoids(pos, self.config.d_model, x.dtype), self.config.dropout, self.training)
        return append_blocks(self.blocks, x, tokens, st, n, mats, self.site_layer, collect)


def _drop_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict hook: each shared tensor once, under the input's name."""
    assert isinstance(module, AdaptiveTransformer)
    for alias in module._aliases:
        state_dict.pop(prefix + alias, None)


def _fill_aliases(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: the softmax's aliases read the input's tensors (re-tied by `_tie_again`)."""
    assert isinstance(module, AdaptiveTransformer)
    for alias, name in module._aliases.items():
        if prefix + name in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + name]


def _tie_again(module: nn.Module, incompatible_keys: Any) -> None:
    """Load post-hook: `assign=True` gave the aliases Parameters of their own; share the input's again."""
    assert isinstance(module, AdaptiveTransformer) and module.softmax is not None and module.input is not None
    module.softmax.tie(module.input, projections=True)
