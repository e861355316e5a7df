"""AWD-LSTM: the weight-dropped word-level LSTM of Merity et al. 2018 (docs/algorithms.md §5).

    x_t        = E'[w_t]                                       embedding dropout: whole rows of E (sec. 4.3)
    z_t        = W x_t + b_ih + U' h_{t-1} + b_hh              blocks i, f, g, o (nn.LSTM's order)
    c_t        = sig(f) * c_{t-1} + sig(i) * tanh(g)
    h_t        = sig(o) * tanh(c_t)                            (sec. 2)
    h'_t       = h_t + M h_t                                   adaptation site on the first k units (thesis 4.6)
    U'         = U * mask / (1 - wdrop)                        DropConnect, one mask per forward (sec. 2)
    logits     = E h^L_t + b                                   tied weights (sec. 4.4)

Layers are stacked; locked (variational) dropout, one mask per sequence shared over time, acts on the input, on
each layer's output but the last (`dropouth`) and on the last layer's output (`dropout`) (sec. 4.2). With tied
weights the last layer's size is the embedding size (sec. 4.5). AR (alpha * mean of the squared dropped final
output) and TAR (beta * mean of the squared step-to-step change of the undropped final output) are returned in
`Output.aux`, weighted, in training mode only (sec. 4.6).

Decision: the LSTM is written out (a loop over time with the weights as parameters, `weight_hh_raw` the
recurrent one) instead of patching `nn.LSTM`'s weights (the reference WeightDrop), which breaks
`flatten_parameters` on current PyTorch and would not let the sparse adapter act inside the recurrence. The
input projections of a layer are one matmul over the whole sequence before its loop.

Decision: the tied output layer reads `embed.weight` itself (F.linear) rather than holding a second module whose
weight aliases it, so the state dict has each tensor once (safetensors refuses tensors that share storage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.adapter import AdapterSteps
from models.base import Adapter, LanguageModel, ModelConfig, Output, Site, State

__all__ = ["AWDLSTM", "AWDLSTMConfig", "embedding_dropout", "locked_dropout", "lstm_cell"]


@dataclass(frozen=True)
class AWDLSTMConfig(ModelConfig):
    """Defaults: the paper's PTB model (sec. 5), 3 x 1150 units, 400-wide tied embedding."""

    arch = "awd-lstm"
    vocab_size: int = 10000
    emb_size: int = 400
    hidden_size: int = 1150
    layers: int = 3
    dropout: float = 0.4  # locked dropout on the last layer's output
    dropouth: float = 0.3  # locked dropout between layers
    dropouti: float = 0.4  # locked dropout on the embedded input (WikiText-2: 0.65)
    dropoute: float = 0.1  # embedding dropout: whole word rows
    wdrop: float = 0.5  # DropConnect on the hidden-to-hidden weights
    alpha: float = 2.0  # AR weight
    beta: float = 1.0  # TAR weight
    tie_weights: bool = True
    adapt_layers: tuple[int, ...] = (-1,)  # layers whose h carries a sparse adaptation site (negative: from the end)
    adapter_units: int = 0  # default adapter size k per site (0: the layer's whole width)

    def __post_init__(self) -> None:
        # a config read back from JSON gives a list; keep the frozen config hashable
        object.__setattr__(self, "adapt_layers", tuple(int(i) for i in self.adapt_layers))


def lstm_cell(xw: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
              w_hh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step (sec. 2). xw: (B, 4H) = W x_t + biases, h, c: (B, H), w_hh: (4H, H), gates i, f, g, o."""
    z = xw + h @ w_hh.t()  # (B, 4H)
    i, f, g, o = z.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (B, H)
    h = torch.sigmoid(o) * torch.tanh(c)  # (B, H)
    return h, c


def locked_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Variational dropout (sec. 4.2): one mask per sequence, shared over time. x: (B, T, D) -> (B, T, D)."""
    if not training or p == 0.0:
        return x
    mask = x.new_empty(x.shape[0], 1, x.shape[2]).bernoulli_(1 - p) / (1 - p)  # (B, 1, D)
    return x * mask


def embedding_dropout(weight: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Embedding dropout (sec. 4.3): whole rows (words) of weight (V, E) zeroed, the others scaled by 1/(1-p).
    -> (V, E), the matrix to look the forward's tokens up in (every occurrence of a word shares its fate)."""
    if not training or p == 0.0:
        return weight
    mask = weight.new_empty(weight.shape[0], 1).bernoulli_(1 - p) / (1 - p)  # (V, 1)
    return weight * mask


class _LSTMLayer(nn.Module):
    """One LSTM layer with its weights as plain parameters, laid out as nn.LSTM's (gates i, f, g, o)."""

    def __init__(self, n_in: int, n_hidden: int) -> None:
        super().__init__()
        self.hidden = n_hidden
        self.weight_ih = nn.Parameter(torch.empty(4 * n_hidden, n_in))
        self.weight_hh_raw = nn.Parameter(torch.empty(4 * n_hidden, n_hidden))
        self.bias_ih = nn.Parameter(torch.empty(4 * n_hidden))
        self.bias_hh = nn.Parameter(torch.empty(4 * n_hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden)  # nn.LSTM's initialisation, as the reference code uses
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def hh_weight(self, wdrop: float, training: bool) -> torch.Tensor:
        """U' (4H, H): DropConnect on the raw recurrent weight (sec. 2), one mask per call, i.e. per forward pass
        (the loop reuses it at every step); gradients flow to `weight_hh_raw` through the mask."""
        if not training or wdrop == 0.0:
            return self.weight_hh_raw
        return F.dropout(self.weight_hh_raw, p=wdrop, training=True)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_hh: torch.Tensor,
                m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, D_in), h, c: (B, H), w_hh: (4H, H), m: (B, k, k) or None -> hs (B, T, H), h, c."""
        xw = F.linear(x, self.weight_ih, self.bias_ih + self.bias_hh)  # (B, T, 4H)
        site = AdapterSteps(m) if m is not None else None
        outs = []
        for xw_t in xw.transpose(0, 1).unbind(0):  # unbind: one stack in backward, not T zero-filled slices
            h, c = lstm_cell(xw_t, h, c, w_hh)
            if site is not None:
                h = site(h)  # h' = h + M h: used by the recurrence and by the layer above (thesis sec. 4.6)
            outs.append(h)
        return torch.stack(outs, dim=1), h, c  # (B, T, H)


class AWDLSTM(LanguageModel):
    config: AWDLSTMConfig

    def __init__(self, config: AWDLSTMConfig) -> None:
        super().__init__()
        cfg = config
        if cfg.layers < 1 or cfg.emb_size < 1 or cfg.hidden_size < 1 or cfg.vocab_size < 1:
            raise ValueError("layers, emb_size, hidden_size and vocab_size must be positive")
        for name in ("dropout", "dropouth", "dropouti", "dropoute", "wdrop"):
            if not 0.0 <= getattr(cfg, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        if cfg.alpha < 0 or cfg.beta < 0:
            raise ValueError("alpha and beta must be >= 0")
        if not all(-cfg.layers <= i < cfg.layers for i in cfg.adapt_layers):
            raise ValueError("adapt_layers must name layers")
        if cfg.adapter_units < 0:
            raise ValueError("adapter_units must be >= 0")
        self.config = config
        # sec. 4.5: with tied weights the last layer's output is the embedding size
        self.sizes = [cfg.hidden_size] * (cfg.layers - 1) + [cfg.emb_size if cfg.tie_weights else cfg.hidden_size]
        ins = [cfg.emb_size, *self.sizes[:-1]]
        self.embed = nn.Embedding(cfg.vocab_size, cfg.emb_size)
        self.layers = nn.ModuleList(_LSTMLayer(i, o) for i, o in zip(ins, self.sizes, strict=True))
        self.decoder_weight = None if cfg.tie_weights else nn.Parameter(torch.empty(cfg.vocab_size, self.sizes[-1]))
        self.decoder_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self._adapted = sorted({i % cfg.layers for i in cfg.adapt_layers})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.uniform_(self.embed.weight, -0.1, 0.1)  # the reference code's init
            if self.decoder_weight is not None:
                nn.init.uniform_(self.decoder_weight, -0.1, 0.1)
            self.decoder_bias.zero_()
        for layer in self.layers:
            layer.reset_parameters()  # type: ignore[operator]

    def output_weight(self) -> torch.Tensor:
        """The decoder's (V, H_L) weight: the embedding itself when tied (sec. 4.4)."""
        return self.embed.weight if self.decoder_weight is None else self.decoder_weight

    def init_state(self, batch: int) -> State:
        p = self.embed.weight
        out = {}
        for i, n in enumerate(self.sizes):
            out[f"h{i}"] = torch.zeros(batch, n, dtype=p.dtype, device=p.device)
            out[f"c{i}"] = torch.zeros(batch, n, dtype=p.dtype, device=p.device)
        return State(out)

    def adaptation_sites(self) -> list[Site]:
        return [Site(f"h{i}", self.sizes[i], layer=i, per_step=True, units=self.config.adapter_units)
                for i in self._adapted]

    def parameter_layer(self, name: str) -> int | None:
        """layers.{i}.* -> i; the embedding -> -1; the decoder's own weight and bias -> `layers`. Decision: the
        tied embedding counts as the input side, so adapting the later layers leaves it fixed (thesis ch. 6)."""
        if name.startswith("layers."):
            return int(name.split(".")[1])
        if name.startswith("embed."):
            return -1
        return self.config.layers

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> (B, T, E), with embedding dropout in training mode (sec. 4.3)."""
        weight = embedding_dropout(self.embed.weight, self.config.dropoute, self.training)  # (V, E)
        return F.embedding(tokens, weight)

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        """tokens: (B, T) int64; state: h{i}, c{i} (B, H_i) per layer; adapter: mats["h{i}"] (B, k, k) or None."""
        cfg, training = self.config, self.training
        x = locked_dropout(self.embed_tokens(tokens), cfg.dropouti, training)  # (B, T, E) sec. 4.2
        new: dict[str, torch.Tensor] = {}
        raw = x
        for i, layer in enumerate(self.layers):
            m = adapter.mats.get(f"h{i}") if adapter is not None else None
            w_hh = layer.hh_weight(cfg.wdrop, training)  # type: ignore[operator]
            raw, new[f"h{i}"], new[f"c{i}"] = layer(x, state.tensors[f"h{i}"], state.tensors[f"c{i}"], w_hh, m)
            if i < cfg.layers - 1:
                x = locked_dropout(raw, cfg.dropouth, training)  # (B, T, H_i) sec. 4.2, between layers
        out = locked_dropout(raw, cfg.dropout, training)  # (B, T, H_L) sec. 4.2, final output
        logits = F.linear(out, self.output_weight(), self.decoder_bias)  # (B, T, V) sec. 4.4
        aux: dict[str, torch.Tensor] = {}
        if training:
            if cfg.alpha > 0:
                aux["ar"] = cfg.alpha * out.pow(2).mean()  # sec. 4.6 AR: on the dropped output
            if cfg.beta > 0 and raw.shape[1] > 1:
                aux["tar"] = cfg.beta * (raw[:, 1:] - raw[:, :-1]).pow(2).mean()  # sec. 4.6 TAR: undropped
        return Output(logits=logits, state=State(new), aux=aux, hidden=out)
