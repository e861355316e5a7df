"""The sparse adapter as a session memory: M of h' = h + M h at every adaptation site (Krause's thesis, sec. 4.6;
docs/algorithms.md, "Sparse dynamic evaluation"), learned by `batch_step`'s gradient step on each scored segment.

Its state is a `State` of one (1, k, k) matrix per site, named by the site; its settings are the session's
learning rate, decay and k (`AdapterSettings`). The update rule and eps are the checkpoint's (dyneval.json
"session", else "sparse"), with MS_g of each (k, k) block where the rule needs the statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from models.adaptation._config import DynEvalConfig
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import sparse_rule
from models.base import Adapter, LanguageModel, State
from models.memory import Memory, MemorySettings, MemorySettingsError, check_restored, register

if TYPE_CHECKING:
    from models.checkpoint import Checkpoint

__all__ = ["MAX_SESSION_LR", "AdapterMemory", "AdapterSettings", "adapter_limits"]

# The largest learning rate a session may ask for: far above any rate that adapts (the checkpoints' tuned ones are
# 1e-6 to 1e-2), far below those whose adapters overflow into non-finite generations.
MAX_SESSION_LR = 1e4
_RULE_CACHE = 256  # update rules kept, by (lr, decay, adapter size)


class AdapterSettings(MemorySettings):
    lr: float = Field(ge=0, le=MAX_SESSION_LR, allow_inf_nan=False, description="Learning rate of the adapter.")
    decay: float = Field(ge=0, le=1, allow_inf_nan=False, description="Decay of M towards 0 at each step.")
    size: int = Field(ge=1, description="k: M is (k, k) on the first k units of every adaptation site.")


def adapter_limits(ckpt: Checkpoint) -> tuple[DynEvalConfig | None, int, int, str]:
    """(the checkpoint's session settings, default k, largest k, "") or (None, 0, 0, why sessions cannot adapt)."""
    # "session": serving defaults for users' own text, when the checkpoint has them; else "sparse", the settings
    # tuned on the validation book
    base = ckpt.dyneval.session
    sites = ckpt.model.adaptation_sites()
    if not sites:
        return None, 0, 0, f"{type(ckpt.model).__name__} has no adaptation sites"
    units = min(s.dim for s in sites)
    if base.rule in ("rms", "rms_decay"):
        stats = [ckpt.stats.get(f"adapter.{s.name}") for s in sites]
        if any(t is None for t in stats):
            return None, 0, 0, (f"the checkpoint has no adapter statistics (MS_g) for the {base.rule!r} rule; "
                                "train it to the end (or collect them) to serve sessions")
        units = min([units, *(min(t.shape) for t in stats if t is not None)])
    # the settings' k, else the sites' own default (`Site.adapter_size`), within what the sites and statistics cover
    default = min(base.adapter_units or min(s.adapter_size() for s in sites), units)
    return base, default, units, ""


@register
class AdapterMemory(Memory):
    name = "adapter"
    kind = "network"
    settings_type = AdapterSettings
    learns_weights = True

    def __init__(self, model: LanguageModel, stats: Mapping[str, torch.Tensor] | None, base: DynEvalConfig,
                 default_size: int, max_size: int, on: bool = True) -> None:
        self.model, self.stats, self.base = model, stats, base
        self.default_size, self.max_size, self.on = default_size, max_size, on
        self._rules: dict[tuple[float, float, int], UpdateRule] = {}

    @classmethod
    def build(cls, ckpt: Checkpoint) -> AdapterMemory | None:
        base, default, units, _ = adapter_limits(ckpt)
        # the "session" section's "adapter": false makes M a memory a session has only on request (another memory,
        # the output rows' delta, may learn in its place); absent: on
        section = ckpt.dyneval.get("session")
        on = section.get("adapter", True) if isinstance(section, Mapping) else True
        if not isinstance(on, bool):
            raise ValueError(f"the session section's adapter must be true or false, not {on!r}")
        return cls(ckpt.model, ckpt.stats, base, default, units, on) if base is not None else None

    def defaults(self) -> AdapterSettings | None:
        return self.initial_settings() if self.on else None

    def initial_settings(self) -> AdapterSettings:
        """The checkpoint's settings, also where M is off unless asked for (its defaults are then None)."""
        return AdapterSettings(lr=self.base.lr, decay=self.base.decay, size=self.default_size)

    def check(self, settings: MemorySettings) -> None:
        assert isinstance(settings, AdapterSettings)
        if settings.size > self.max_size:
            raise MemorySettingsError(f"Input should be less than or equal to {self.max_size} (this server's limit)",
                                      memory=self.name, param="size", code="less_than_equal")

    def init(self, settings: MemorySettings, device: torch.device) -> State:
        assert isinstance(settings, AdapterSettings)
        ref = next(self.model.parameters())
        sites = {s.name: settings.size for s in self.model.adaptation_sites()}
        return State(Adapter.zeros(sites, 1, dtype=ref.dtype, device=device).mats)

    def restore(self, settings: MemorySettings, tensors: dict[str, torch.Tensor], meta: Any,
                device: torch.device) -> State:
        template = self.init(settings, device)
        check_restored(self.name, tensors, template.tensors)
        return State({k: tensors[k].to(device) for k in template.tensors})

    def rule(self, settings: AdapterSettings) -> UpdateRule:
        """The update rule of a session's settings: the checkpoint's rule and eps, MS_g of its (k, k) block; built
        once per (lr, decay, k)."""
        key = (settings.lr, settings.decay, settings.size)
        rule = self._rules.get(key)
        if rule is None:
            cfg = dataclasses.replace(self.base, lr=settings.lr, decay=settings.decay, adapter_units=settings.size)
            _, rule = sparse_rule(self.model, cfg, self.stats)
            if len(self._rules) >= _RULE_CACHE:
                self._rules.clear()
            self._rules[key] = rule
        return rule
