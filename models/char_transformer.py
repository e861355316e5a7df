"""Deep character transformer with auxiliary losses (Al-Rfou et al. 2019, sec. 2; docs/algorithms.md §6).

    x = E[byte]
    block l:  x += P_l[pos]                 a learned positional embedding per layer, added to every layer's input
              x += Attn(LN(x))              causal, over the current window only
              x += MLP(LN(x))
    h' = h + M h                            adaptation site "resid" on the first k units, after block `adapt_layer`
    logits = W LN(x_N)

Layer norm: the paper does not say where it sits; it builds on the Tensor2Tensor Transformer, whose defaults
normalise each sub-layer's input, so this is pre-LN (and a final LN before the classifier); pre-LN also keeps a deep
stack trainable without warm-up tricks.

Auxiliary losses (paper, "Auxiliary Losses"; returned in `Output.aux` in training mode only, weights applied):
- multiple positions: the main loss is at every position (the trainer's `loss` of the logits);
- intermediate layers: block l < N-1 has its own classifier `aux.next.{l}`; its loss counts until fraction
  (l+1)/(2N) of training (`set_training_progress`), then is dropped (all gone at half);
- multiple targets: every block l has a classifier `aux.two.{l}` for the byte two ahead, weight 0.5 times its
  layer's weight (the last block's weight is always 1).
The forward sees the inputs, not the targets: in a contiguous stream target t is input t+1, so the auxiliary losses
use the chunk's own inputs and leave out its last one (next-byte) or two (two-ahead) positions.

Training-only parameters: everything under `aux.` (`training_only_parameters`). The checkpoint keeps them, so that
training resumes, and lists their names in config.json (`training_only_parameters`). Inference never reads them
(eval mode computes no auxiliary output), so a served model works with them absent: `load_state_dict(...,
strict=False)` with only `aux.` keys missing gives the same logits.

Window, state and cost. Positions are absolute within a window of `context` C bytes (the positional embeddings are
learned for positions 0..C-1, paper: "we don't require the model to generalize to longer contexts"). State: the
window's bytes `tok` (B, C), its keys/values `k{l}`, `v{l}` (B, C, D) and `mask` (B, C), right-aligned (the newest in
slot C-1; a fresh state is all False). A new byte is appended at the next position, attending to the cached keys and
values: one position of compute per byte (generation and suggestions use this cache). When a row's window is full,
it slides by the stride S: its newest C-S bytes are re-encoded from position 0 (C-S positions of compute), then the
next S bytes are appended. So every byte is predicted with between C-S and C-1 bytes of context (at least C/2 by
default), and the amortised cost is 1 + (C-S)/S positions per byte (2 at S = C/2), attention over up to C keys. The
procedure depends only on each row's stream, not on how it is cut into calls: pieces equal one forward exactly
(up to float summation order). Rows of a batch slide independently (sessions at different fills batch together);
rows that slide together and start the same under one adapter (a search's branches) encode that start once.
With the site after an intermediate layer the adapter also shapes the cached keys/values of later layers; a slide
re-encodes with the adapter of that call.

Registered in models/registry.py as "char-transformer".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels._dispatch import resolve_impl
from kernels.adapter import apply_adapter_positions
from kernels.attention import memory_attention
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
from models.base import DERIVED, ROOT, Adapter, FeedForward, LanguageModel, ModelConfig, Output, Site, State

__all__ = ["BlockConfig", "CharTransformer", "CharTransformerConfig", "WindowedTransformer", "append_blocks",
           "resid_site", "slide_windows", "window_state"]

TRAINING_ONLY_PREFIX = "aux."
TAIL_N = DERIVED + "tail_n"  # the branch form's: each row's bytes since its root (`branch`)


@dataclass(frozen=True)
class CharTransformerConfig(ModelConfig):
    arch = "char-transformer"
    vocab_size: int = 256
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 2  # the paper's two heads
    d_ff: int = 512
    context: int = 128  # the window C (paper: 512)
    stride: int = 0  # how far a full window slides (0: C // 2)
    dropout: float = 0.0  # paper: 0.2 (T12), 0.55 (T64)
    adapt_layer: int = -1  # the site sits after this block (-1: the last)
    adapter_units: int = 0  # default k of the site (0: all of d_model)
    aux_layers: bool = True  # intermediate-layer losses
    aux_two_ahead: bool = True  # the byte-two-ahead losses


class BlockConfig(Protocol):
    """What a block reads of its model's config (this model's and models/adaptive_transformer.py's)."""

    @property
    def d_model(self) -> int: ...
    @property
    def n_head(self) -> int: ...
    @property
    def d_ff(self) -> int: ...
    @property
    def dropout(self) -> float: ...


class WindowConfig(BlockConfig, Protocol):
    """What the sliding window and the adaptation site read of a windowed model's config."""

    @property
    def n_layer(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def adapt_layer(self) -> int: ...
    @property
    def adapter_units(self) -> int: ...


class WindowedTransformer:
    """The interface the two sliding-window transformers (this one and models/adaptive_transformer.py) share: the
    window's stride, the block the site follows, and the site on the residual stream."""

    config: WindowConfig

    @property
    def stride(self) -> int:
        return self.config.stride or self.config.context // 2

    @property
    def site_layer(self) -> int:
        return self.config.adapt_layer % self.config.n_layer

    def adaptation_sites(self) -> list[Site]:
        return [resid_site(self.config.d_model, self.config.adapt_layer, self.config.adapter_units)]


# append(tokens (B, m), state, fill n (B,), adapter mats or None, collect) -> (B, m, D), block outputs, new state
AppendFn = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None, bool],
                    tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]]


class _Block(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        D = cfg.d_model
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = FeedForward(D, cfg.d_ff, cfg.dropout)

    def forward(self, x: torch.Tensor, mem_k: torch.Tensor, mem_v: torch.Tensor,
                key_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, D); mem_k, mem_v: (B, C, D), right-aligned; key_lengths: (B,) the valid keys of each row, the last
        ones of [cache; chunk]. -> x, this chunk's keys and values."""
        B, T, D = x.shape
        H = self.n_head
        q, k, v = self.inputs(x).chunk(3, -1)  # (B, T, D) each
        keys, vals = torch.cat([mem_k, k], 1), torch.cat([mem_v, v], 1)  # (B, C+T, D)
        qh = q.view(B, T, H, D // H).transpose(1, 2)  # (B, H, T, Dh)
        kh = keys.view(B, -1, H, D // H).transpose(1, 2)  # (B, H, C+T, Dh)
        vh = vals.view(B, -1, H, D // H).transpose(1, 2)  # (B, H, C+T, Dh)
        att = memory_attention(qh, kh, vh, key_lengths=key_lengths)  # (B, H, T, Dh) causal, bottom-right aligned
        return self.outputs(x, att.transpose(1, 2).reshape(B, T, D)), k, v

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The attention's queries, keys and values of x (B, T, D) -> (B, T, 3D), [q ; k ; v] on the last dim."""
        qkv: torch.Tensor = self.qkv(self.ln1(x))
        return qkv

    def step_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """`inputs` at one position a row outside autograd (a decode step): x (B, D) -> (B, 3D), through `dense`."""
        return dense(self.qkv, self.ln1(x))

    def step_outputs(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """`outputs` at one position a row outside autograd (a decode step): x, att (B, D) -> (B, D), through
        `dense`; the residual sums out of place, in x's dtype as `outputs`' (float32 under a bf16 autocast, where a
        sum into the product would round the residual stream to bf16)."""
        up, down = cast(nn.Linear, self.mlp[0]), cast(nn.Linear, self.mlp[2])
        x = x + dense(self.proj, att)  # (B, D)
        return x + dense(down, dense(up, self.ln2(x)).relu_())

    def outputs(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The block's output from its input x and the attention's att (B, T, D), heads concatenated: the
        projection and the MLP, each added to the residual -> (B, T, D)."""
        if self.training and self.dropout:
            x = x + F.dropout(self.proj(att), self.dropout)  # (B, T, D)
            return x + F.dropout(self.mlp(self.ln2(x)), self.dropout)
        x = x + self.proj(att)  # (B, T, D)
        h: torch.Tensor = self.mlp(self.ln2(x))  # (B, T, D)
        return x + h


def _classifier(cfg: CharTransformerConfig) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab_size))


class CharTransformer(WindowedTransformer, LanguageModel):
    config: CharTransformerConfig

    def __init__(self, config: CharTransformerConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError("d_model must be a multiple of n_head")
        if config.context < 2 or not 0 <= config.stride < config.context:
            raise ValueError("context must be >= 2 and 0 <= stride < context")
        if not -config.n_layer <= config.adapt_layer < config.n_layer:
            raise ValueError("adapt_layer must name a block")
        self.config = config
        N, C, D = config.n_layer, config.context, config.d_model
        self.embed = nn.Embedding(config.vocab_size, D)
        self.pos = nn.Parameter(torch.zeros(N, C, D))  # P_l[position], one table per layer (paper: L x N x d)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(N))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, config.vocab_size)
        # training-only classifiers (module docstring): intermediate next-byte, and two-ahead for every block
        self.aux = nn.ModuleDict({
            "next": nn.ModuleList(_classifier(config) for _ in range(N - 1)),
            "two": nn.ModuleList(_classifier(config) for _ in range(N)),
        })
        self._progress = 0.0
        self._stack = RootStack()  # the roots of generations fed together, stacked (`_branch_step`)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=0.1)
            nn.init.normal_(self.pos, std=0.02)

    # -- interface ---------------------------------------------------------------------------------------------

    def training_only_parameters(self) -> list[str]:
        """Names of the parameters inference never reads (kept in checkpoints so training can resume)."""
        return [n for n, _ in self.named_parameters() if n.startswith(TRAINING_ONLY_PREFIX)]

    def parameter_layer(self, name: str) -> int | None:
        """blocks.{i}.* -> i; the byte embedding -> -1; the final LN and the classifier -> n_layer; aux.* -> None.
        Decision: `pos` holds every layer's positional table in one (N, C, D) parameter and a parameter adapts
        whole, so it counts as layer 0 (its first table feeds block 0): adapting the later layers leaves it fixed."""
        if name.startswith(TRAINING_ONLY_PREFIX):
            return None
        if name.startswith("blocks."):
            return int(name.split(".")[1])
        if name == "pos":
            return 0
        if name.startswith("embed."):
            return -1
        return self.config.n_layer

    def set_training_progress(self, fraction: float) -> None:
        self._progress = float(fraction)

    def aux_weights(self, fraction: float | None = None) -> dict[str, float]:
        """The auxiliary losses' weights at `fraction` of training (default: the progress last set): `layer{l}`
        for block l's own next-byte classifier (l < N-1), `two{l}` for its two-ahead classifier; zero once dropped."""
        f = self._progress if fraction is None else fraction
        N = self.config.n_layer
        w = [1.0 if f < (l + 1) / (2 * N) else 0.0 for l in range(N - 1)] + [1.0]  # paper: l-th stops at l/2n
        out = {}
        if self.config.aux_layers:
            out.update({f"layer{l}": w[l] for l in range(N - 1)})
        if self.config.aux_two_ahead:
            out.update({f"two{l}": 0.5 * w[l] for l in range(N)})
        return out

    def init_state(self, batch: int) -> State:
        return window_state(batch, self.config.context, self.config.d_model, self.config.n_layer, self.embed.weight)

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        """tokens: (B, T) int64; state: tok, mask (B, C), k{l}, v{l} (B, C, D); adapter: mats["resid"] (B, k, k)."""
        if ROOT in state.tensors:  # the branch form (`branch`)
            return self._branch_forward(tokens, state, adapter)
        C, S, N = self.config.context, self.stride, self.config.n_layer
        mats = adapter.mats["resid"] if adapter is not None else None
        collect = self.training and bool(self.aux_weights())
        finals, outs, st = slide_windows(tokens, dict(state.tensors), C, S, N, self._append, self.init_state, mats,
                                         collect)
        x = torch.cat(finals, 1) if finals else self.embed(tokens)  # (B, T, D)
        hidden = self.ln_f(x)  # (B, T, D)
        logits = self.head(hidden)  # (B, T, V)
        aux = self._aux_losses(tokens, [torch.cat(o, 1) for o in outs]) if collect else {}
        return Output(logits=logits, state=State(st), aux=aux, hidden=hidden)

    def branch(self, state: State) -> State:
        """The branch form (models/_branches.py): each row's window as its root (one root when the rows are all one),
        with empty tails: `memo.tail_tok` (B, t) and `memo.tail_kv{l}` (B, t, 2D) hold the row's bytes since its
        root and their keys and values ([k ; v] on the last dim). With the Triton kernels (a GPU), the state itself:
        the kernels take the usual steps."""
        if ROOT in state.tensors or resolve_impl(None, state.tensors["k0"]) == "triton":
            return state
        B, D = state.batch, self.config.d_model
        ref = state.tensors["k0"]
        one = all(shared(v) for v in state.tensors.values())
        ids = torch.zeros(B, dtype=torch.long, device=ref.device) if one else torch.arange(B, device=ref.device)
        rows = {ROOT: ids, TAIL_N: torch.zeros(B, dtype=torch.long, device=ref.device),
                f"{DERIVED}tail_tok": state.tensors["tok"].new_zeros(B, 0)}
        for i in range(self.config.n_layer):
            rows[f"{DERIVED}tail_kv{i}"] = ref.new_zeros(B, 0, 2 * D)
        return State(rows, tuple(state.select(i) for i in range(1 if one else B)))

    def settle(self, state: State) -> State:
        """The usual form: each row's root with its tail written into its window (a tail never reaches past the
        window's end); a copy per row."""
        if ROOT not in state.tensors:
            return state
        st, n = state.tensors, state.tensors[TAIL_N]
        D = self.config.d_model
        tok = st[f"{DERIVED}tail_tok"]
        out = {"tok": append_tail(root_rows(state, "tok"), tok, n),  # (B, C)
               "mask": append_tail(root_rows(state, "mask"), torch.ones_like(tok, dtype=torch.bool), n)}
        for i in range(self.config.n_layer):
            kv = st[f"{DERIVED}tail_kv{i}"]  # (B, t, 2D)
            out[f"k{i}"] = append_tail(root_rows(state, f"k{i}"), kv[..., :D], n)
            out[f"v{i}"] = append_tail(root_rows(state, f"v{i}"), kv[..., D:], n)
        out = {k: out[k] for k in state.roots[0].tensors}  # the usual order
        return State({k: v.contiguous() if shared(v) and len(n) > 1 else v for k, v in out.items()})

    # -- internals -------------------------------------------------------------------------------------------

    def _branch_forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None) -> Output:
        """forward in the branch form (models/_branches.py, `branch_forward`): `_branch_step` for the rows whose byte
        fits their window, the usual forward (a slide) for the others."""
        return branch_forward(self, tokens, state, adapter, self._ready, self._branch_step)

    def _root_views(self, root: State) -> tuple[int, Parts]:
        """A root's fill and each block's keys and values of its window's valid slots by head, [(k, v)] with (H, fill,
        Dh) each, views of the window (made once per root: `root_memo`)."""
        C, D, H = self.config.context, self.config.d_model, self.config.n_head
        fill = int(root.tensors["mask"][0].sum())
        views: Parts = []
        for i in range(self.config.n_layer):
            k, v = (root.tensors[f"{name}{i}"][0, C - fill :] for name in ("k", "v"))  # (fill, D) in place
            views.append([(k.view(fill, H, D // H).transpose(0, 1), v.view(fill, H, D // H).transpose(0, 1))])
        return fill, views

    def _views(self, root: State) -> Parts:
        views: Parts = root_memo(root, self._root_views)[1]
        return views

    def _row_fills(self, state: State) -> torch.Tensor | int:
        """Each row's root's fill (B,); a number where the rows have one root."""
        fills = [root_memo(r, self._root_views)[0] for r in state.roots]
        if len(fills) == 1:
            return int(fills[0])
        return torch.tensor(fills, device=state.tensors[ROOT].device)[state.tensors[ROOT]]

    def _ready(self, state: State) -> torch.Tensor:
        """The rows (B,) bool whose byte fits their window: no slide."""
        return state.tensors[TAIL_N] + self._row_fills(state) < self.config.context

    def _branch_step(self, tokens: torch.Tensor, state: State, mats: torch.Tensor | None) -> Output:
        """One byte a row (B, 1) after its root's window and its tail, each row's tail grown by a slot (`grow`): rows
        with a root of their own read its keys and values in one batch (`row_attention`; several roots stacked:
        `RootStack`), rows that share roots read them in place by the root's rows' queries (`tree_attention`); the
        block's projections and MLP (`_Block.step_inputs`, `_Block.step_outputs`) over all rows at once, as
        `append_blocks`."""
        B = tokens.shape[0]
        D, H = self.config.d_model, self.config.n_head
        Dh = D // H
        st = state.tensors
        n = st[TAIL_N]  # (B,)
        t = st[f"{DERIVED}tail_tok"].shape[1] + 1  # the tails with this byte
        own = own_keys(state, self._views, self._stack)  # (L, keys and values, no-key places) or None
        pad = tail_padding(n + 1, t)  # (B, 1, t) or None
        no_key = no_keys(own[2], pad, B, own[0], t) if own is not None else None  # (B, 1, 1, L + t) or None
        if own is None:
            rooted = [(rows, self._views(root)) for rows, root in groups(state)]
        new = dict(st)
        new[TAIL_N] = n + 1
        new[f"{DERIVED}tail_tok"] = grow(st[f"{DERIVED}tail_tok"], tokens[:, 0])  # (B, t)
        pos = self.pos[:, self._row_fills(state) + n]  # (N, B, D) each row's positional embedding in every layer
        x = self.embed(tokens[:, 0])  # (B, D)
        for i, block in enumerate(self.blocks):
            assert isinstance(block, _Block)
            x = x + pos[i]  # (B, D) paper: a positional embedding per layer
            qkv = block.step_inputs(x)  # (B, 3D)
            tkv = new[f"{DERIVED}tail_kv{i}"] = grow(st[f"{DERIVED}tail_kv{i}"], qkv[:, D:])  # (B, t, 2D)
            roots: list[Group] | None = None if own is not None else [(rows, views[i]) for rows, views in rooted]
            att = step_attention(qkv[:, :D].view(B, H, Dh), tkv, own[1][i] if own is not None else None, roots,
                                 no_key, pad)  # (B, D)
            x = block.step_outputs(x, att)  # (B, D)
            if i == self.site_layer and mats is not None:
                x = apply_adapter_positions(x.unsqueeze(1), mats).squeeze(1)  # (B, D) h' = h + M h
        hidden = self.ln_f(x)  # (B, D)
        return Output(logits=dense(self.head, hidden).unsqueeze(1), state=State(new, state.roots),
                      hidden=hidden.unsqueeze(1))

    def _append(self, tokens: torch.Tensor, st: dict[str, torch.Tensor], n: torch.Tensor,
                mats: torch.Tensor | None, collect: bool
                ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        """Append m bytes to windows of fill n (B,), n + m <= C: tokens (B, m) take positions n..n+m-1.
        -> the last block's output (adapted if the site is there) (B, m, D), each block's output (if `collect`),
        the new state (the oldest m slots, all empty, drop off)."""
        x = self.embed(tokens)  # (B, m, D)
        return append_blocks(self.blocks, x, tokens, st, n, mats, self.site_layer, collect,
                             lambda i, pos: self.pos[i][pos])  # paper: a positional embedding per layer

    def _aux_losses(self, tokens: torch.Tensor, layer_outs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weighted auxiliary losses from each block's output (B, T, D); targets are the chunk's later inputs."""
        out: dict[str, torch.Tensor] = {}
        T = tokens.shape[1]
        for name, w in self.aux_weights().items():
            if w == 0.0:
                continue
            l, ahead = (int(name[5:]), 1) if name.startswith("layer") else (int(name[3:]), 2)
            if T <= ahead:
                continue
            heads = self.aux["next"] if ahead == 1 else self.aux["two"]
            assert isinstance(heads, nn.ModuleList)
            head = heads[l]
            logits = head(layer_outs[l][:, : T - ahead])  # (B, T-ahead, V)
            out[name] = w * F.cross_entropy(logits.float().flatten(0, 1), tokens[:, ahead:].flatten())
        return out



def window_state(batch: int, context: int, d_model: int, n_layer: int, ref: torch.Tensor) -> State:
    """An empty window (module docstring): tok, mask (B, C) and every layer's k{l}, v{l} (B, C, D), on `ref`'s
    device and dtype."""
    tensors = {"mask": torch.zeros(batch, context, dtype=torch.bool, device=ref.device),
               "tok": torch.zeros(batch, context, dtype=torch.long, device=ref.device)}
    for i in range(n_layer):
        tensors[f"k{i}"] = torch.zeros(batch, context, d_model, dtype=ref.dtype, device=ref.device)
        tensors[f"v{i}"] = torch.zeros(batch, context, d_model, dtype=ref.dtype, device=ref.device)
    return State(tensors)


def resid_site(d_model: int, layer: int, units: int) -> Site:
    """The sparse site h' = h + M h on the residual stream after block `layer` (thesis §4.6 on a transformer)."""
    return Site("resid", d_model, layer=layer, per_step=False, units=units)


def slide_windows(tokens: torch.Tensor, st: dict[str, torch.Tensor], context: int, stride: int, n_layer: int,
                  append: AppendFn, init_state: Callable[[int], State], mats: torch.Tensor | None, collect: bool
                  ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """The sliding window of the module docstring, shared with models/adaptive_transformer.py: tokens (B, T) into
    windows of `context` C with state `st` (tok, mask, k{l}, v{l}), each full window slid by `stride` S (its newest
    C-S tokens re-encoded from position 0 by `append`). -> the last block's outputs of each piece (B, m_j, D), each
    block's outputs per piece (if `collect`), the new state."""
    T = tokens.shape[1]
    C, S = context, stride
    outs: list[list[torch.Tensor]] = [[] for _ in range(n_layer)]  # per block, its outputs over the chunk's pieces
    finals = []
    n = st["mask"].sum(1)  # (B,) the fill of each row's window
    i = 0
    while i < T:
        full = n == C
        if bool(full.any()):  # slide those rows' windows by S: re-encode their newest C-S tokens from position 0
            rows = full.nonzero()[:, 0]
            new = _reencode(st["tok"][rows, S:], append, init_state, mats[rows] if mats is not None else None)
            st = {k: v.index_copy(0, rows, new[k]) for k, v in st.items()}
            n = n.masked_fill(full, C - S)
        m = min(T - i, int((C - n).min()))
        x, layer_outs, st = append(tokens[:, i : i + m], st, n, mats, collect)
        finals.append(x)
        for acc, o in zip(outs, layer_outs, strict=False):
            acc.append(o)
        n = n + m
        i += m
    return finals, outs, st


def _reencode(kept: torch.Tensor, append: AppendFn, init_state: Callable[[int], State], mats: torch.Tensor | None
              ) -> dict[str, torch.Tensor]:
    """Windows of the tokens `kept` (R, L), encoded from position 0 by `append` -> their state. Outside autograd,
    rows that start with the same tokens under the same adapter (the branches of one keyboard search, the choices of
    one prompt: they slide together, and differ only in their last bytes) have that start encoded once, then each
    its own rest; the same keys and values as each row encoded alone (causal: a position reads only those before)."""
    R, L = kept.shape
    zeros = torch.zeros(R, dtype=torch.long, device=kept.device)
    if R == 1 or torch.is_grad_enabled():  # (training: each row its own dropout)
        return append(kept, init_state(R).tensors, zeros, mats, False)[2]
    parts = []
    for rows, start in _common_starts(kept, mats, L // 2):
        m = mats[rows] if mats is not None else None
        if len(rows) == 1:
            parts.append((rows, append(kept[rows], init_state(1).tensors, zeros[:1], m, False)[2]))
            continue
        lead = rows[:1]
        pre = append(kept[lead, :start], init_state(1).tensors, zeros[:1], mats[lead] if mats is not None else None,
                     False)[2]  # the common start, once
        shared = {k: v.expand(len(rows), *v.shape[1:]) for k, v in pre.items()}
        if start < L:
            shared = append(kept[rows, start:], shared, torch.full_like(rows, start), m, False)[2]
        parts.append((rows, shared))
    if len(parts) == 1:
        return parts[0][1]
    order = torch.cat([rows for rows, _ in parts]).argsort()  # (R,) each row's place in the parts
    return {k: torch.cat([p[k] for _, p in parts])[order] for k in parts[0][1]}


def _common_starts(tokens: torch.Tensor, mats: torch.Tensor | None, least: int) -> list[tuple[torch.Tensor, int]]:
    """The rows of `tokens` (R, L) in groups that start with the same tokens (at least `least` of them) under the same
    adapter matrix: [(rows, the length of the start they share)], each row in one group, in order of their first."""
    R, L = tokens.shape
    left = torch.ones(R, dtype=torch.bool, device=tokens.device)
    groups = []
    while bool(left.any()):
        lead = int(left.nonzero()[0, 0])
        same = (tokens == tokens[lead]).cumprod(1).sum(1)  # (R,) how many tokens each row starts with as the lead
        if mats is not None:
            same = same * (mats == mats[lead]).flatten(1).all(1)
        member = left & (same >= max(least, 1))
        member[lead] = True
        rows = member.nonzero()[:, 0]
        groups.append((rows, int(same[rows].min())))
        left &= ~member
    return groups


def append_blocks(blocks: nn.ModuleList, x: torch.Tensor, tokens: torch.Tensor, st: dict[str, torch.Tensor],
                  n: torch.Tensor, mats: torch.Tensor | None, site_layer: int, collect: bool,
                  layer_input: Callable[[int, torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Append m tokens to windows of fill n (B,), n + m <= C: x (B, m, D) their embeddings, tokens (B, m) taking
    positions n..n+m-1; `layer_input(l, pos)` (B, m, D), if given, is added to block l's input (pos (B, m)).
    -> the last block's output (adapted if the site `site_layer` is there) (B, m, D), each block's output (if
    `collect`), the new state (the oldest m slots, all empty, drop off)."""
    B, m = tokens.shape
    pos = n.view(B, 1) + torch.arange(m, device=tokens.device).view(1, m)  # (B, m)
    valid = torch.cat([st["mask"], st["mask"].new_ones(B, m)], 1)  # (B, C+m)
    key_lengths = n + m  # (B,) the cache is right-aligned: its last n slots, then the chunk
    new: dict[str, torch.Tensor] = {}
    layer_outs = []
    for i, block in enumerate(blocks):
        if layer_input is not None:
            x = x + layer_input(i, pos)  # (B, m, D)
        mk, mv = st[f"k{i}"], st[f"v{i}"]
        x, k, v = block(x, mk, mv, key_lengths)
        new[f"k{i}"] = torch.cat([mk, k], 1)[:, m:]  # (B, C, D)
        new[f"v{i}"] = torch.cat([mv, v], 1)[:, m:]
        if collect:
            layer_outs.append(x)
        if i == site_layer and mats is not None:
            x = apply_adapter_positions(x, mats)  # (B, m, D) h' = h + M h at every position, one bmm
    new["mask"] = valid[:, m:]
    new["tok"] = torch.cat([st["tok"], tokens], 1)[:, m:]
    return x, layer_outs, new
