"""Full dynamic evaluation of one stream (thesis fig. 4.1, eq. 4.3-4.7; docs/algorithms.md §2): every adapted weight
takes a gradient step after each segment is scored.

The adapted weights live in a private trainable copy of the model (`LanguageModel.trainable_copy`): the shared,
frozen model is never written, and nothing is toggled on it. Offline evaluation (`evaluate_many`'s full mode)
and the keyboard simulator (`models.keysim`) both step a `FullStream`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from models.adaptation._cache import CacheMemory
from models.adaptation._config import CacheConfig, DynEvalConfig
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import finite_rows
from models.adaptation._step import usable_rows
from models.base import LanguageModel, Output, State
from models.copymodel import CopyMemory, CopyModel
from models.memory import Memory, NoSettings

__all__ = ["FullStream", "adapted_parameter_names"]



def adapted_parameter_names(model: LanguageModel, config: DynEvalConfig) -> list[str]:
    """Full mode: the parameters whose dotted name starts with a `params` prefix (all if none), minus `frozen`,
    minus those of layers below `layers_from` (`LanguageModel.parameter_layer`). Training-only parameters never
    adapt: the scored loss does not reach them."""
    training_only = set(model.training_only_parameters())
    names = [n for n, _ in model.named_parameters() if n not in training_only]

    def match(name: str, prefixes: Sequence[str]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    for prefix in (*config.params, *config.frozen):
        if not any(match(n, (prefix,)) for n in names):
            raise ValueError(f"no parameter matches {prefix!r}; parameters: {', '.join(names)}")
    chosen = [n for n in names if (not config.params or match(n, config.params)) and not match(n, config.frozen)]
    if config.layers_from:
        layers = {n: model.parameter_layer(n) for n in names}
        chosen = [n for n in chosen if (layer := layers[n]) is not None and layer >= config.layers_from]
        if not chosen:
            deepest = max((x for x in layers.values() if x is not None), default=0)
            raise ValueError(f"layers_from {config.layers_from} leaves no parameter to adapt (this model's parameters"
                             f" sit in layers up to {deepest})")
    if not chosen:
        raise ValueError("the params/frozen settings leave no parameter to adapt")
    return chosen


class FullStream:
    """One stream of full dynamic evaluation: `step` scores a segment with the current weights, then updates
    them. The non-finite guard: a non-finite state rewinds the segment (state and weights stay); non-finite
    weights alone are dropped (`skipped`) and the state, which the old weights produced, stands. The divergence
    guard, as sparse mode's (`DIVERGED_BITS`): weights under which a segment scores non-finite or worse than
    DIVERGED_BITS a token on average are put back to the unadapted ones (`resets`) and the segment is scored
    again under them."""

    def __init__(self, model: LanguageModel, config: DynEvalConfig,
                 stats: Mapping[str, torch.Tensor] | None = None, copy: CopyModel | None = None) -> None:
        self.names = adapted_parameter_names(model, config)
        self.model = model.trainable_copy()
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            p.requires_grad_(name in self.names)
        self.params = {n: params[n] for n in self.names}
        self.theta_g = {n: p.detach().clone() for n, p in self.params.items()}  # decay pulls towards these
        ms_g = None
        if stats is not None:
            ms_g = {n: stats[f"param.{n}"].to(p.device, p.dtype) for n, p in self.params.items()
                    if f"param.{n}" in stats}
        self.rule = UpdateRule(config, self.names, ms_g)
        # mixed into the scores (the copy model, or the neural cache in its place); the weights learn from their own
        self.memories = offline_memories(copy, config.cache)
        self.reset()

    def reset(self) -> None:
        """Back to the unadapted weights and the initial state: a fresh stream, without copying the model again."""
        self._restore_weights()
        self.state = self.model.init_state(1)
        device = next(self.model.parameters()).device
        self.memory_states: dict[str, Any] = {name: m.init(NoSettings(), device) for name, m in self.memories.items()}
        self.network_logprobs: torch.Tensor | None = None  # of the last segment `step` scored (t,)
        self.skipped = 0
        self.updates = 0
        self.resets = 0

    @property
    def copy(self) -> State | None:
        """The copy model's state (None: none)."""
        state = self.memory_states.get("copy")
        return state if isinstance(state, State) else None

    def _restore_weights(self) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.theta_g[n])

    @property
    def params_adapted(self) -> int:
        return sum(p.numel() for p in self.params.values())

    @property
    def state_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def adapted(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def _score(self, x: torch.Tensor, y: torch.Tensor) -> tuple[Output, torch.Tensor, torch.Tensor]:
        out = self.model(x, self.state)
        log_dist = self.model.log_probs(out)  # (1, t, V)
        return out, log_dist, log_dist.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # (1, t)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: (1, t) inputs and targets -> log p(y) (t,) scored before this segment's update."""
        with torch.inference_mode(False), torch.enable_grad():
            out, log_dist, lp = self._score(x, y)
            if self.updates and not bool(usable_rows(lp, lp.new_tensor([lp.shape[1]]))[0]):
                self._restore_weights()  # diverged: back to the unadapted weights, and score the segment under them
                self.resets += 1
                out, log_dist, lp = self._score(x, y)
            # a weight the segment's loss does not reach (a compressor trained by its own loss only) gets zero
            found = torch.autograd.grad(-lp.mean(), list(self.params.values()), allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(found, self.params.values(), strict=True)]
        self.network_logprobs = lp.detach()[0]  # the network's own scores, before any memory is mixed in
        if self.memories:
            mixed, mask = log_dist.detach(), torch.ones_like(y, dtype=torch.bool)
            hidden = out.hidden.detach() if out.hidden is not None else None
            for name, memory in self.memories.items():
                mixed, (self.memory_states[name],), _ = memory.learn(mixed, x, y, mask, hidden,
                                                                     [self.memory_states[name]])
            lp = mixed.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        old = {n: p.detach() for n, p in self.params.items()}
        new = self.rule.step(old, dict(zip(self.params, grads, strict=True)), self.theta_g)
        state: State = out.state.detach()
        state_ok = bool(finite_rows(list(state.tensors.values()), 1).all())
        if state_ok and bool(finite_rows(list(new.values()), 1).all()):
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(new[n])
            self.updates += 1
        else:
            self.skipped += 1
        if state_ok:
            self.state = state
        return lp.detach()[0]


def offline_memories(copy: CopyModel | None, cache: CacheConfig | None) -> dict[str, Memory]:
    """The distribution memories of an offline stream: the copy model, or the neural cache in its place."""
    if cache:
        return {"cache": CacheMemory(cache)}
    return {"copy": CopyMemory(copy)} if copy is not None else {}
