"""The one model interface every architecture implements (docs/architecture.md, "The model interface").

`State` and `Adapter` are explicit per-request objects with a leading batch dimension: they can be
sliced per session, stacked into a batch and serialised; they never live inside the shared module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models._skeleton import skeleton

__all__ = ["DERIVED", "ROOT", "Adapter", "FeedForward", "LanguageModel", "ModelConfig", "Output", "Site", "State",
           "left_pad"]


@dataclass(frozen=True)
class ModelConfig:
    """Base of every architecture's frozen config; `arch` names the registry entry."""

    arch: ClassVar[str] = ""
    vocab_size: int = 256

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Site:
    """Where `h' = h + M h` may be applied (Krause's thesis sec. 4.6, eq. 4.8; docs/algorithms.md §3): an
    adapter M (k, k) acts on the first k of the `dim` units of a vector. `layer` is the block it sits in (0 = the
    first; -1 = after the last), `per_step` says whether it is applied at every time step of a recurrence (the
    mLSTM's hidden state, feeding the next step) or once per position on a layer's output (a transformer block's
    residual stream). `units` is this site's default adapter size k (0: the whole `dim`)."""

    name: str
    dim: int
    layer: int = -1
    per_step: bool = True
    units: int = 0

    def adapter_size(self, requested: int = 0) -> int:
        """k for this site: `requested` (0: the site's default) capped at `dim`."""
        return min(requested or self.units or self.dim, self.dim)


DERIVED = "memo."  # State tensors named so are caches a model can rebuild (`State.persistent`)
ROOT = DERIVED + "root"  # in a state with `roots`: each row's root (B,) int64, an index into `State.roots`


@dataclass
class State:
    """Recurrent state or memories; every tensor has the batch on dim 0.

    A state may hold memories that fill up over time (a transformer's keys and values, (B, L, ...)), with a
    boolean `mask` (B, L) marking each row's valid slots. `stack` then left-pads every tensor whose dim 1
    differs between the states (zeros; False in `mask`), so rows of different lengths batch together; the
    model must ignore the masked slots. Recurrent states (fixed shapes) stack with a plain `cat`.

    `roots`, in a model's branch form (`LanguageModel.branch`), are what rows share, kept once: batch-1 states, row
    b's being `roots[tensors[ROOT][b]]`. Row operations (`select`, `take`, `stack`) index the rows' tensors and keep
    the roots the rows still name, never copying one: the rows of many searches (many typists) stack into one batch
    whose rows point at their own searches' roots. Such a state is settled (`LanguageModel.settle`) before it is kept
    or exported.

    `memo` holds what a model derived once from a root's tensors (its fills, views of its keys and values by head:
    models/_branches.py `root_memo`), for every later step over the root; a root is never changed in place, and
    every operation that makes a new state starts an empty one.
    """

    tensors: dict[str, torch.Tensor]
    roots: tuple[State, ...] = ()
    memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def row_bytes(self) -> int:
        """Bytes one row holds (what a session's state costs in memory; padding included)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values()) if self.batch else 0

    def persistent(self) -> State:
        """Without its derived tensors, those named `memo.*`: caches the model rebuilds from the rest when they are
        stale (the compressive model's keys and values). Exports and stores keep this; an import starts the derived
        tensors afresh from a new state."""
        self._no_roots("persistent")
        return State({k: v for k, v in self.tensors.items() if not k.startswith(DERIVED)})

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Flat, contiguous CPU tensors for serialisation (safetensors), names prefixed."""
        self._no_roots("to_tensors")
        return {prefix + k: v.detach().to("cpu").contiguous() for k, v in self.tensors.items()}

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], prefix: str = "") -> State:
        """The inverse of `to_tensors`: the tensors whose name starts with `prefix`."""
        return State({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})

    def batch_device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def detach(self) -> State:
        return State({k: v.detach() for k, v in self.tensors.items()}, tuple(r.detach() for r in self.roots))

    def select(self, index: torch.Tensor | slice | int) -> State:
        if isinstance(index, int):
            index = slice(index, index + 1)
        return State({k: v[index] for k, v in self.tensors.items()})._keep(self.roots)

    def take(self, index: torch.Tensor) -> State:
        """Rows `index` (1-D int64), as `select` with an index, except that a tensor whose rows are all one row (a
        batch of 1, or a stride-0 view of one) stays such a view."""
        return State({k: _one_row(v).expand(len(index), *v.shape[1:]) if _is_one_row(v) else v.index_select(0, index)
                      for k, v in self.tensors.items()})._keep(self.roots)

    @staticmethod
    def stack(states: list[State]) -> State:
        if any(s.roots for s in states):  # the branch form: the rows' roots in one tuple, each once
            if not all(s.roots for s in states):
                raise ValueError("cannot stack states in a branch form with states in the usual form")
            roots: dict[int, tuple[int, State]] = {}
            for s in states:
                for r in s.roots:
                    roots.setdefault(id(r), (len(roots), r))
            states = [State({**s.tensors, ROOT: torch.tensor([roots[id(r)][0] for r in s.roots],
                                                             device=s.tensors[ROOT].device)[s.tensors[ROOT]]})
                      for s in states]
            return State(State.stack(states).tensors, tuple(r for _, r in roots.values()))
        keys = states[0].tensors.keys()
        out = {}
        for k in keys:
            parts = [s.tensors[k] for s in states]
            if all(_is_one_row(p) for p in parts) and len({(p.data_ptr(), p.shape[1:], p.stride()[1:], p.dtype,
                                                             p.device) for p in parts}) == 1:
                # rows that are all one shared row stay a view of it (branches of one state; no copy)
                out[k] = _one_row(parts[0]).expand(sum(p.shape[0] for p in parts), *parts[0].shape[1:])
                continue
            if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
                L = max(p.shape[1] for p in parts)
                parts = [left_pad(p, L) for p in parts]  # memories of different lengths: pad the oldest end
            out[k] = torch.cat(parts, dim=0)
        return State(out)

    def where(self, rows: torch.Tensor, other: State) -> State:
        """Row b from this state where `rows[b]` (B,) bool, else from `other`; memories of different lengths are
        left-padded to the longer first, as `stack` does."""
        self._no_roots("where")
        out = {}
        for k, mine in self.tensors.items():
            theirs = other.tensors[k]
            if mine.dim() >= 2 and mine.shape[1] != theirs.shape[1]:
                L = max(mine.shape[1], theirs.shape[1])
                mine, theirs = left_pad(mine, L), left_pad(theirs, L)
            out[k] = torch.where(rows.view(-1, *([1] * (mine.dim() - 1))), mine, theirs)
        return State(out)

    def to(self, *args: Any, **kwargs: Any) -> State:
        return State({k: v.to(*args, **kwargs) for k, v in self.tensors.items()},
                     tuple(r.to(*args, **kwargs) for r in self.roots))

    def _keep(self, roots: tuple[State, ...]) -> State:
        """These rows with the roots they name of `roots` (the others dropped, so that nothing keeps them alive)."""
        if not roots:
            return self
        ids = self.tensors[ROOT]
        used = torch.unique(ids)  # (R',) sorted
        if len(used) == len(roots):
            return State(self.tensors, roots)
        renum = torch.full((len(roots),), -1, dtype=ids.dtype, device=ids.device)
        renum[used] = torch.arange(len(used), device=ids.device)
        return State({**self.tensors, ROOT: renum[ids]}, tuple(roots[i] for i in used.tolist()))

    def _no_roots(self, what: str) -> None:
        if self.roots:
            raise ValueError(f"{what} of a state in a branch form: settle it first (`LanguageModel.settle`)")


class FeedForward(nn.Sequential):
    """A transformer block's position-wise feed-forward: Linear -> ReLU -> dropout -> Linear. Dropout on the ReLU
    activations is where Al-Rfou et al. (sec. "Model", "dropout in the attention and ReLU layers") and
    Transformer-XL's position-wise net put it; the blocks drop the sub-layer's output on the residual as well. The
    layers keep nn.Sequential's indices (`mlp.0`, `mlp.2`), so checkpoints' tensor names are unchanged."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(self[1](self[0](x)), self.dropout, self.training)  # (..., d_ff)
        out: torch.Tensor = self[2](hidden)
        return out


def _is_one_row(t: torch.Tensor) -> bool:
    """Every row of `t` (B, ...) is the same memory: a batch of 1 or a stride-0 view of one row."""
    return t.dim() >= 1 and t.shape[0] >= 1 and (t.shape[0] == 1 or t.stride(0) == 0)


def _one_row(t: torch.Tensor) -> torch.Tensor:
    return t[:1]


def left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """(b, l, ...) -> (b, length, ...), the new slots first (zeros, or False for a mask)."""
    pad = t.new_zeros(t.shape[0], length - t.shape[1], *t.shape[2:])
    return torch.cat([pad, t], dim=1)


@dataclass
class Adapter:
    """Per-row adaptation matrices, one per site: `mats[site] : (B, k, k)` acting on the first k units.

    `memories` carries what else the rows' sessions learned, for a search or sampling that reads them
    (`models.memory.MemoryMixed`): per memory name, (one view per session, the session of each row (B,) int64, -1
    for a row whose session has none; None: every row reads view 0). The matrices' operations below leave them out.

    `counts`, where given, says that `mats` hold one matrix per session, (S, k, k), session i's for counts[i]
    consecutive rows: a search's many rows of a few sessions without a (B, k, k) copy of every matrix for every row
    (`models.suggest.row_adapters`). Only a model with `LanguageModel.grouped_adapters` is given one, and only
    without gradients.
    """

    mats: dict[str, torch.Tensor]
    memories: dict[str, tuple[list[Any], torch.Tensor | None]] = field(default_factory=dict)
    counts: tuple[int, ...] | None = None

    @property
    def batch(self) -> int:
        """Rows; an adapter with no matrices (only memories, full dynamic evaluation's) counts as one."""
        if self.counts is not None:
            return sum(self.counts)
        return next(iter(self.mats.values())).shape[0] if self.mats else 1

    @staticmethod
    def zeros(sites: dict[str, int], batch: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> Adapter:
        return Adapter({n: torch.zeros(batch, k, k, dtype=dtype, device=device) for n, k in sites.items()})

    def select(self, index: torch.Tensor | slice | int) -> Adapter:
        if self.counts is not None:
            raise ValueError("rows of an adapter of one matrix per session: take them from the sessions' adapters")
        if isinstance(index, int):
            index = slice(index, index + 1)
        return Adapter({k: v[index] for k, v in self.mats.items()})

    @staticmethod
    def stack(adapters: list[Adapter]) -> Adapter:
        keys = adapters[0].mats.keys()
        return Adapter({k: torch.cat([a.mats[k] for a in adapters], dim=0) for k in keys})

    @staticmethod
    def stack_padded(adapters: Sequence[Adapter | None]) -> Adapter | None:
        """Stack adapters of different sizes: each (b, k, k) fills the corner of a zero (b, K, K), K the largest
        k of the site; a None entry is one row of M = 0. Padding changes nothing: the padded rows and columns
        of M are 0, so h' = h + M h is the same on every unit. -> None if every entry is None."""
        given = [a for a in adapters if a is not None]
        if not given:
            return None
        out = {}
        for site, ref in given[0].mats.items():
            K = max(a.mats[site].shape[-1] for a in given)
            rows = sum(a.batch if a is not None else 1 for a in adapters)
            padded = ref.new_zeros(rows, K, K)  # (B, K, K)
            b = 0
            for a in adapters:
                if a is None:
                    b += 1
                    continue
                m = a.mats[site]  # (b_i, k, k)
                padded[b : b + m.shape[0], : m.shape[1], : m.shape[2]] = m
                b += m.shape[0]
            out[site] = padded
        return Adapter(out).with_sessions(adapters, [a.batch if a is not None else 1 for a in adapters])

    def with_sessions(self, adapters: Sequence[Adapter | None], rows: Sequence[int]) -> Adapter:
        """These matrices, with the memories of `adapters` (one session each, view 0 of each memory), whose
        adapter i stands for rows[i] consecutive rows."""
        names = dict.fromkeys(name for a in adapters if a is not None for name in a.memories)
        memories: dict[str, tuple[list[Any], torch.Tensor | None]] = {}
        for name in names:
            views: list[Any] = []
            index: list[int] = []
            for a, r in zip(adapters, rows, strict=True):
                if a is not None and name in a.memories:
                    index += [len(views)] * r
                    views.append(a.memories[name][0][0])
                else:
                    index += [-1] * r
            memories[name] = (views, torch.tensor(index))
        return Adapter(self.mats, memories, self.counts)


@dataclass
class Output:
    logits: torch.Tensor  # (B, T, V)
    state: State
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # (B, T, H) final hidden states h' fed to the output layer (neural cache)


class LanguageModel(nn.Module):
    """Interface shared by all architectures; the engine, trainer and dynamic evaluation use only this.

    `frozen` is set once, by `freeze()` when a checkpoint is loaded for inference: the weights are constants
    from then on (no gradients for them, never toggled while serving), and a model may use that for faster
    inference and for a cheaper backward that computes the adapters' gradients only (sparse adaptation). The
    trainer's models are not frozen; full dynamic evaluation adapts an unfrozen private copy (`trainable_copy`).
    """

    config: ModelConfig
    frozen: bool = False
    # Capability: frozen and under bf16 autocast, the model itself keeps in float32 what must stay there (the
    # logits, the state it hands back). Without it the server runs the model in float32 whatever it is asked.
    bf16_inference: ClassVar[bool] = False
    # Capability: the forward takes, without gradients, an adapter of one matrix per session for runs of consecutive
    # rows (`Adapter.counts`).
    grouped_adapters: bool = False

    def init_state(self, batch: int) -> State:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        raise NotImplementedError

    def adaptation_sites(self) -> list[Site]:
        raise NotImplementedError

    def branch(self, state: State) -> State:
        """`state` in the form a search steps its branches in (suggestions, generation: many continuations of one
        state, or one continued a token at a time). A model whose state is large may then keep what the rows share
        once instead of copying it per row (the transformers: models/_branches.py); the forward keeps the form it is
        given, with the same results. Idempotent. Here: the state itself."""
        return state

    def settle(self, state: State) -> State:
        """A state in the usual form again (what `branch` made, for keeping: a session cursor). Here: itself."""
        return state

    def training_only_parameters(self) -> list[str]:
        """Names of parameters only training reads (auxiliary heads): checkpoints keep them, so training resumes,
        and list them in config.json (`training_only_parameters`); inference never reads them. None here."""
        return []

    def parameter_layer(self, name: str) -> int | None:
        """Which layer parameter `name` belongs to, for full dynamic evaluation of the later layers only (thesis
        ch. 6; `DynEvalConfig.layers_from`): block i of a stack -> i, the input side (embeddings) -> below 0, the
        output side (final norm, classifier) -> above the last block; None for a training-only parameter. Here:
        the whole model is one layer, 0."""
        return None if name in self.training_only_parameters() else 0

    def set_training_progress(self, fraction: float) -> None:
        """Called by the trainer before each step with the fraction of training done (step / max_steps), for
        models whose losses follow a schedule (the character transformer's auxiliary losses); a no-op here."""

    def freeze(self) -> LanguageModel:
        """Make the weights constants for inference (once, at load); -> self."""
        for p in self.parameters():
            p.requires_grad_(False)
        self.frozen = True
        return self.eval()

    def trainable_copy(self) -> LanguageModel:
        """A private copy whose weights take gradients (full dynamic evaluation); this model is untouched."""
        # built on the meta device, uninitialised, and given clones of this model's tensors: no random initialisation
        # to throw away (an orthogonal init of a large recurrent matrix costs more than the copy), no torch._dynamo
        # import on the engine thread (models/_skeleton.py)
        with skeleton():
            copy = type(self)(self.config)
        copy.load_state_dict({k: v.detach().clone() for k, v in self.state_dict().items()}, assign=True)
        if any(b.is_meta for b in copy.buffers()):  # buffers the state dict does not carry: build it for real
            ref = next(self.parameters())
            copy = type(self)(self.config).to(ref.device, ref.dtype)
            copy.load_state_dict(self.state_dict())
        for p in copy.parameters():
            p.requires_grad_(True)
        return copy.eval()

    # -- losses and scores through the model, so that a model with an adaptive softmax or auxiliary losses
    #    needs no special case in the trainer, dynamic evaluation or the server --------------------------

    def log_probs(self, output: Output) -> torch.Tensor:
        """log p over the vocabulary at every position: (B, T, V), at least float32."""
        logits = output.logits
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return torch.log_softmax(logits, dim=-1)

    def target_logprobs(self, output: Output, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) at every position: targets (B, T) -> (B, T). A large-vocabulary model may override it
        to avoid the full distribution."""
        return self.log_probs(output).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def loss(self, output: Output, targets: torch.Tensor) -> torch.Tensor:
        """The training loss: mean cross-entropy of the targets (B, T) plus every auxiliary loss the forward
        returned in `output.aux` (already weighted by the model)."""
        nll = -self.target_logprobs(output, targets).mean()
        return nll + sum(output.aux.values()) if output.aux else nll
