"""Multiplicative LSTM over bytes (Krause's thesis ch. 3, eq. 3.5-3.9; docs/algorithms.md §1).

    m_t = (W_mx x_t) * (W_mh h_{t-1})
    z_t = W_x x_t + W_m m_t + b            blocks i, f, o, u
    c_t = sig(f) * c_{t-1} + sig(i) * tanh(u)
    h_t = sig(o) * tanh(c_t)
    h'_t = h_t + M h_t                      adaptation site on the first k units (thesis sec. 4.6)

Eq. 3.5 is m_t, eq. 3.6-3.9 the input and the gates (from m_t instead of h_{t-1}); the cell and output updates are
the LSTM's own, eq. 2.21-2.22, which ch. 3 does not restate.

The input projections W_mx x and W_x x do not depend on the recurrence, so they are computed for the
whole sequence in two matmuls before the time loop; the loop does two matmuls per step.

Inference paths: a model frozen at load (`LanguageModel.freeze`: the weights are constants, an explicit flag,
never inferred from `requires_grad`) looks its input projections up from per-byte tables (`_input_tables`),
runs sparse adaptation through the hand-written backward of kernels.adapted_mlstm (gradient for M only), and
under `torch.autocast(dtype=torch.bfloat16)` runs only the two recurrent matmuls of the loop (and their
transposes in the sparse backward) in bfloat16, on weights converted once and cached; the input projections,
the gates, the cell state, the adapter and the output layer stay in float32 (a bf16 logit would be off by up to
1/16 at the logits' scale). The recurrent weights are read at half the bytes, and CPUs with AVX-512 BF16 or AMX
multiply them about 2x faster at 8-64 rows; without gradients (scoring, generation, the keyboard's search) they are
also packed once into oneDNN's layout (`packed_product`). An unfrozen model (training, the trainer's validation, full
dynamic evaluation's private copy) takes the plain path, and under autocast everything autocast covers runs in bf16.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.adapted_mlstm import adapted_mlstm
from kernels.adapter import AdapterSteps, apply_adapter_groups
from models.base import Adapter, LanguageModel, ModelConfig, Output, Site, State
from models.step_graphs import StepRunner

__all__ = ["MLSTM", "MLSTMConfig", "mlstm_cell", "mlstm_steps"]


@dataclass(frozen=True)
class MLSTMConfig(ModelConfig):
    arch = "mlstm"
    vocab_size: int = 256
    embed_dim: int = 64
    hidden: int = 256
    dropout_embed: float = 0.0  # locked dropout on the embedding
    dropout_hidden: float = 0.1  # locked dropout on h (recurrence and output)
    forget_bias: float = 3.0  # the thesis' forget-gate bias: the cell keeps its memory early on
    recurrent_scale: float = 0.7  # scaled-orthogonal recurrent init
    weight_norm: bool = True


class _WNLinear(nn.Module):
    """Linear map with optional weight normalisation (W = g * V / ||V||, per output row)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, weight_norm: bool) -> None:
        super().__init__()
        self.weight_norm = weight_norm
        self.v = nn.Parameter(torch.empty(n_out, n_in))
        self.g = nn.Parameter(torch.ones(n_out)) if weight_norm else None
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        self._cache: tuple[tuple[object, ...], dict[torch.dtype, torch.Tensor]] | None = None
        self._product: tuple[torch.Tensor, Product] | None = None  # `product`'s, for the weight it was made of

    def reset(self, init: str, scale: float = 1.0) -> None:
        if self.v.is_meta:  # a skeleton (models/_skeleton.py): nothing to fill, and g's norm would import torch._dynamo
            return
        with torch.no_grad():
            if init == "orthogonal":
                nn.init.orthogonal_(self.v, gain=scale)
            else:
                bound = 1.0 / math.sqrt(self.v.shape[1])
                self.v.uniform_(-bound, bound)
            if self.g is not None:
                self.g.copy_(self.v.norm(dim=1))
            if self.bias is not None:
                self.bias.zero_()

    def weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W (out, in); in `dtype` if given (a cached copy: only without gradients for v and g)."""
        # the parameters read from their dict: nn.Module's attribute lookup costs microseconds, and a search's
        # step asks every layer for its weight
        params = self._parameters
        v, g = params["v"], params.get("g")
        assert v is not None
        tracked = torch.is_grad_enabled() and (v.requires_grad or (g is not None and g.requires_grad))
        if tracked:
            if dtype is not None:
                raise RuntimeError("a converted weight is for inference: call it without gradients")
            if g is None:
                return v
            w: torch.Tensor = v * (g / v.norm(dim=1)).unsqueeze(1)  # (out, in)
            return w
        # Without gradients for v and g (scoring, generation, suggestions, sparse adaptation) the normalised
        # weight is cached: it costs a pass over the matrix, which dominates a one-byte step. The key changes
        # whenever v or g does (in-place updates bump _version; swapped or moved tensors change identity or
        # storage).
        key = _key(v, g)
        if self._cache is None or self._cache[0] != key:
            w = v if g is None else v * (g / v.norm(dim=1)).unsqueeze(1)
            self._cache = (key, {w.dtype: w})
        found = self._cache[1]
        if dtype is not None and dtype not in found:
            found[dtype] = next(iter(found.values())).to(dtype)
        return found[dtype] if dtype is not None else next(iter(found.values()))

    def product(self, dtype: torch.dtype) -> Product:
        """x -> x @ W^T with W in `dtype`, for inference without gradients: the weight packed once for oneDNN where
        that gives the same numbers (`packed_product`), else the plain product on the cached weight."""
        w = self.weight(dtype)
        if self._product is None or self._product[0] is not w:
            self._product = (w, packed_product(w))
        return self._product[1]


def _key(*tensors: torch.Tensor | None) -> tuple[object, ...]:
    """What identifies the values of `tensors` (None: absent): identity, version (in-place updates), storage
    (swapped or moved data) and dtype."""
    return tuple((id(t), t._version, t.data_ptr(), t.dtype) for t in tensors if t is not None)


Product = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # a weight (out, in), or x -> x @ W^T (`_times`)
PACK_ROWS = 16  # the rows oneDNN packs a weight for (any count of rows may then be multiplied)


def packed_product(w: torch.Tensor) -> Product:
    """x -> x @ w^T on a bf16 CPU weight packed once into oneDNN's blocked layout (the op PyTorch's inductor uses
    for frozen linear layers), or `w` itself where that is not available or would change a number. A plain bf16
    matmul reorders the weight on every call: at the search's 1-64 rows the packed product reads it as laid out,
    ~1.4x faster for the mLSTM's two recurrent products. It is used only after it matched the plain product bit for
    bit on probe rows of several counts (oneDNN chooses its kernel by the CPU and the rows), so that it never
    changes a step's output."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2 \
            or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return w
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return w
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)

        def times(x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
            return out

        gen = torch.Generator().manual_seed(0)
        for rows in (1, 3, 8, 16, 27, 64):
            x = torch.randn(rows, w.shape[1], generator=gen).to(w.dtype)
            if not torch.equal(times(x), x @ w.t()):
                return w
    except (AttributeError, RuntimeError):  # an op this build of PyTorch lacks or refuses
        return w
    return times


def _times(x: torch.Tensor, w: Product) -> torch.Tensor:
    """x @ W^T in the weight's precision (the input cast to it; a packed product's is bf16)."""
    if isinstance(w, torch.Tensor):
        return x.to(w.dtype) @ w.t()
    return w(x.to(torch.bfloat16))


def mlstm_cell(mx: torch.Tensor, zx: torch.Tensor, h: torch.Tensor, c: torch.Tensor,
               w_mh: Product, w_m: Product) -> tuple[torch.Tensor, torch.Tensor]:
    """One mLSTM step. mx: (B, H), zx: (B, 4H) (bias included), h, c: (B, H), w_mh: (H, H), w_m: (4H, H) (or their
    packed products, `_WNLinear.product`). The weights may be in a lower precision than h and c (bf16 inference):
    the matmul inputs are cast to it."""
    m = mx * _times(h, w_mh)  # (B, H) eq. 3.5
    # under bf16 autocast (or with bf16 weights) the matmuls come back in bf16; gates and the cell state stay in
    # c's dtype
    z = zx.to(c.dtype) + _times(m, w_m).to(c.dtype)  # (B, 4H) eq. 3.6-3.9
    i, f, o, u = z.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)  # eq. 2.21
    h = torch.sigmoid(o) * torch.tanh(c)  # eq. 2.22
    return h, c


def _locked_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """One dropout mask per sequence, shared over time (variational dropout). x: (B, T, D) -> (B, 1, D)."""
    return x.new_empty(x.shape[0], 1, x.shape[2]).bernoulli_(1 - p) / (1 - p)


def mlstm_steps(mx: torch.Tensor, zx: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_mh: Product,
                w_m: Product, site: Callable[[torch.Tensor], torch.Tensor] | None = None,
                h_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence over a segment's input projections mx (B, T, H), zx (B, T, 4H) from (h, c) -> (every step's
    output (B, T, H), h, c); `site` the adapter h' = h + M h after each step (recurrence and output), `h_mask`
    the hidden dropout on the recurrent input."""
    outs = []
    # unbind (whose backward is one stack) rather than indexing mx[:, t] (whose backward materialises a full-size
    # zero tensor per step)
    for mx_t, zx_t in zip(mx.transpose(0, 1).unbind(0), zx.transpose(0, 1).unbind(0), strict=True):
        h_in = h if h_mask is None else h * h_mask
        h, c = mlstm_cell(mx_t, zx_t, h_in, c, w_mh, w_m)
        if site is not None:
            h = site(h)
        outs.append(h)
    return torch.stack(outs, dim=1), h, c


class MLSTM(LanguageModel):
    config: MLSTMConfig
    bf16_inference = True  # only the recurrent matmuls in bf16 when frozen (module docstring)
    grouped_adapters = True
    # runs the frozen no-gradient forward in bucketed static shapes, as CUDA graphs on a GPU (models/step_graphs.py;
    # the server's ADAPTLM_CUDA_GRAPHS installs it); None: this module's own path
    step_runner: StepRunner | None = None

    def __init__(self, config: MLSTMConfig) -> None:
        super().__init__()
        self.config = config
        E, H, V = config.embed_dim, config.hidden, config.vocab_size
        wn = config.weight_norm
        self.embed = nn.Embedding(V, E)
        self.w_mx = _WNLinear(E, H, bias=False, weight_norm=wn)
        self.w_x = _WNLinear(E, 4 * H, bias=True, weight_norm=wn)
        self.w_mh = _WNLinear(H, H, bias=False, weight_norm=wn)
        self.w_m = _WNLinear(H, 4 * H, bias=False, weight_norm=wn)
        self.head = _WNLinear(H, V, bias=True, weight_norm=wn)
        self._tables: tuple[tuple[object, ...], torch.Tensor, torch.Tensor] | None = None  # _input_tables
        self.reset_parameters()

    def reset_parameters(self) -> None:
        cfg = self.config
        nn.init.normal_(self.embed.weight, std=0.1)
        self.w_mx.reset("uniform")
        self.w_x.reset("uniform")
        self.w_mh.reset("orthogonal", cfg.recurrent_scale)
        self.w_m.reset("orthogonal", cfg.recurrent_scale)
        self.head.reset("uniform")
        assert self.w_x.bias is not None
        with torch.no_grad():
            H = cfg.hidden
            self.w_x.bias[H:2 * H].fill_(cfg.forget_bias)  # gate order i, f, o, u

    def init_state(self, batch: int) -> State:
        p = self.embed.weight
        z = torch.zeros(batch, self.config.hidden, dtype=p.dtype, device=p.device)
        return State({"h": z, "c": z.clone()})

    def adaptation_sites(self) -> list[Site]:
        return [Site("h", self.config.hidden)]

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        """tokens: (B, T) int64; state: h, c (B, H); adapter: mats["h"] (B, k, k) or None."""
        device = tokens.device.type
        frozen = self.frozen  # weights are constants (LanguageModel.freeze, at load): the inference paths
        runner = self.step_runner
        if runner is not None and frozen and not self.training and not torch.is_grad_enabled():
            lowp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            out = runner(tokens, state, adapter, lowp)
            if out is not None:
                return out
        if frozen and torch.is_autocast_enabled(device):
            # inference or sparse adaptation under autocast (module docstring): bf16 recurrent matmuls only
            with torch.autocast(device, enabled=False):
                return self._forward(tokens, state, adapter, frozen, lowp=torch.get_autocast_dtype(device))
        return self._forward(tokens, state, adapter, frozen)

    def _input_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_mx e and W_x e + b for every byte's embedding e: (V, H), (V, 4H), cached until a weight changes."""
        layers = self._modules  # not nn.Module's attribute lookup (`_WNLinear.weight`)
        w_mx, w_x = layers["w_mx"], layers["w_x"]
        assert isinstance(w_mx, _WNLinear) and isinstance(w_x, _WNLinear)
        embed = layers["embed"]
        assert isinstance(embed, nn.Embedding)
        e = embed._parameters["weight"]  # (V, E)
        assert e is not None
        key = _key(e, *w_mx._parameters.values(), *w_x._parameters.values())
        if self._tables is None or self._tables[0] != key:
            self._tables = (key, F.linear(e, w_mx.weight()), F.linear(e, w_x.weight(), w_x._parameters.get("bias")))
        return self._tables[1], self._tables[2]

    def _forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None, frozen: bool,
                 lowp: torch.dtype | None = None) -> Output:
        cfg = self.config
        if frozen and not self.training:
            # A byte's input projections are constants of the byte: looked up, not multiplied (the same rows
            # of the same products; at 16-32 rows of a 20-byte segment that is ~10% of a sparse step).
            mx_table, zx_table = self._input_tables()
            mx, zx = F.embedding(tokens, mx_table), F.embedding(tokens, zx_table)  # (B, T, H), (B, T, 4H)
        else:
            x = self.embed(tokens)  # (B, T, E)
            if self.training and cfg.dropout_embed > 0:
                x = x * _locked_mask(x, cfg.dropout_embed)
            mx = F.linear(x, self.w_mx.weight())  # (B, T, H)
            zx = F.linear(x, self.w_x.weight(), self.w_x.bias)  # (B, T, 4H)
        w_mh: Product
        w_m: Product
        if frozen and lowp is not None and not self.training and not torch.is_grad_enabled():
            # inference (scoring, generation, the keyboard's search): the low-precision weights packed once
            w_mh, w_m = self.w_mh.product(lowp), self.w_m.product(lowp)
        else:
            w_mh, w_m = self.w_mh.weight(lowp), self.w_m.weight(lowp)
        h, c = state.tensors["h"], state.tensors["c"]
        h_mask = None
        if self.training and cfg.dropout_hidden > 0:
            h_mask = _locked_mask(h.unsqueeze(1), cfg.dropout_hidden)[:, 0]  # (B, H)
        if (frozen and adapter is not None and adapter.counts is None and h_mask is None and torch.is_grad_enabled()
                and not torch.is_autocast_enabled(mx.device.type)):
            # sparse adaptation (frozen weights): hand-written backward through time, gradient for M only
            assert isinstance(w_mh, torch.Tensor) and isinstance(w_m, torch.Tensor)  # with gradients: the weights
            hs, h, c = adapted_mlstm(mx, zx, h, c, w_mh, w_m, adapter.mats["h"])  # (B, T, H)
            logits = F.linear(hs, self.head.weight(), self.head.bias)  # (B, T, V)
            return Output(logits=logits, state=State({"h": h, "c": c}), hidden=hs)
        m_site: Callable[[torch.Tensor], torch.Tensor] | None = None
        if adapter is not None and adapter.counts is not None:  # one matrix per session (a search's rows)
            if torch.is_grad_enabled():
                raise ValueError("an adapter of one matrix per session is for inference only")
            m_site = functools.partial(apply_adapter_groups, m=adapter.mats["h"], counts=adapter.counts)
        elif adapter is not None:
            m_site = AdapterSteps(adapter.mats["h"])
        hs, h, c = mlstm_steps(mx, zx, h, c, w_mh, w_m, m_site, h_mask)
        if h_mask is not None:
            hs = hs * h_mask.unsqueeze(1)
        logits = F.linear(hs, self.head.weight(), self.head.bias)  # (B, T, V)
        return Output(logits=logits, state=State({"h": h, "c": c}), hidden=hs)
