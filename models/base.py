"""The one model interface every architecture implements (ARCHITECTURE.md, "The one model interface").

`State` and `Adapter` are explicit per-request objects with a leading batch dimension: they can be
sliced per session, stacked into a batch and serialised; they never live inside the shared module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["Adapter", "LanguageModel", "ModelConfig", "Output", "Site", "State"]


@dataclass(frozen=True)
class ModelConfig:
    """Base of every architecture's frozen config; `arch` names the registry entry."""

    arch: ClassVar[str] = ""
    vocab_size: int = 256

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Site:
    """Where `h' = h + M h` may be applied (ALGORITHMS.md §3): the first `units` of a `dim`-wide vector."""

    name: str
    dim: int


@dataclass
class State:
    """Recurrent state or memories; every tensor has the batch on dim 0."""

    tensors: dict[str, torch.Tensor]

    @property
    def batch(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def detach(self) -> State:
        return State({k: v.detach() for k, v in self.tensors.items()})

    def select(self, index: torch.Tensor | slice | int) -> State:
        if isinstance(index, int):
            index = slice(index, index + 1)
        return State({k: v[index] for k, v in self.tensors.items()})

    @staticmethod
    def stack(states: list[State]) -> State:
        keys = states[0].tensors.keys()
        return State({k: torch.cat([s.tensors[k] for s in states], dim=0) for k in keys})

    def to(self, *args: Any, **kwargs: Any) -> State:
        return State({k: v.to(*args, **kwargs) for k, v in self.tensors.items()})


@dataclass
class Adapter:
    """Per-row adaptation matrices, one per site: `mats[site] : (B, k, k)` acting on the first k units."""

    mats: dict[str, torch.Tensor]

    @property
    def batch(self) -> int:
        return next(iter(self.mats.values())).shape[0]

    @staticmethod
    def zeros(sites: dict[str, int], batch: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> Adapter:
        return Adapter({n: torch.zeros(batch, k, k, dtype=dtype, device=device) for n, k in sites.items()})

    def select(self, index: torch.Tensor | slice | int) -> Adapter:
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
        return Adapter(out)


@dataclass
class Output:
    logits: torch.Tensor  # (B, T, V)
    state: State
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # (B, T, H) final hidden states h' fed to the output layer (neural cache)


class LanguageModel(nn.Module):
    """Interface shared by all architectures; the engine, trainer and dynamic evaluation use only this."""

    config: ModelConfig

    def init_state(self, batch: int) -> State:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, state: State, adapter: Adapter | None = None) -> Output:
        raise NotImplementedError

    def adaptation_sites(self) -> list[Site]:
        raise NotImplementedError
