"""Hyper-parameters of dynamic evaluation (docs/algorithms.md §2-3) and of the neural cache (§4)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from models.copymodel import CopyConfig

__all__ = ["EVAL_MODES", "MODES", "RULES", "CacheConfig", "DynEvalConfig", "DynEvalSettings"]

MODES = ("static", "full", "sparse")
RULES = ("sgd", "sgd_decay", "rms", "rms_decay")
# names other tools write into dyneval.json for the same settings
_ALIASES = {"eta": "lr", "lambda": "decay", "epsilon": "eps", "n": "segment"}


@dataclass(frozen=True)
class CacheConfig:
    """Neural cache (Grave et al. 2017, sec. 3; docs/algorithms.md §4): p = (1 - lam) p_model + lam p_cache over
    `window` pairs."""

    window: int = 2000
    theta: float = 1.0  # inverse temperature of the cache's softmax over h_t . h_i
    lam: float = 0.1

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"cache window must be >= 1, not {self.window}")
        if not math.isfinite(self.theta):
            raise ValueError("cache theta must be finite")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"cache lam must be in [0, 1], not {self.lam}")


@dataclass(frozen=True)
class DynEvalConfig:
    """How a text is scored: "static" (fixed weights), "full" (dynamic evaluation of the weights) or
    "sparse" (dynamic evaluation of the adapter matrices M only, thesis sec. 4.6)."""

    mode: str = "full"
    rule: str = "rms_decay"  # sgd | sgd_decay | rms | rms_decay (thesis eq. 4.3, 4.5, 4.7)
    lr: float = 1e-4  # eta
    decay: float = 0.002  # lambda
    eps: float = 1e-8  # epsilon in g / (sqrt(MS_g) + eps)
    segment: int = 20  # n: tokens scored per update
    adapter_units: int = 0  # sparse: k units of each site get an M (0: the whole site)
    params: tuple[str, ...] = ()  # full: parameter-name prefixes that adapt (empty: all)
    frozen: tuple[str, ...] = ()  # full: prefixes left out of `params` (e.g. ("embed",))
    # full: adapt only the layers from this block on, and the output layers (thesis ch. 6: adapting the later layers
    # of GPT-2 was cheaper and better); the embedding and earlier blocks stay fixed. 0: every layer
    layers_from: int = 0
    reset: bytes | None = None  # a separator: each document after it starts afresh (state and adaptation)
    cache: CacheConfig | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, not {self.rule!r}")
        for name in ("lr", "decay", "eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, not {value!r}")
        if self.decay > 1:
            raise ValueError(f"decay must be <= 1, not {self.decay}")
        for name in ("segment", "adapter_units", "layers_from"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be a whole number, not {value!r}")
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, not {self.segment}")
        for name in ("adapter_units", "layers_from"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.reset is not None and not self.reset:
            raise ValueError("reset separator must not be empty")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> DynEvalConfig:
        """Build from a checkpoint's dyneval.json, then apply `overrides` (field names only).

        Keys of `data` that name no field (e.g. "tuned", tuning scores) are ignored; "eta" and "lambda"
        are read as `lr` and `decay`. `reset` may be a str (UTF-8) or a list of byte values; `cache` a dict.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown dynamic-evaluation setting(s): {', '.join(unknown)}")
        merged: dict[str, Any] = {}
        for key, value in data.items():
            key = _ALIASES.get(key, key)
            if key in names:
                merged[key] = value
        merged.update(overrides)
        if isinstance(merged.get("reset"), str):
            merged["reset"] = merged["reset"].encode("utf-8")
        elif isinstance(merged.get("reset"), list):
            merged["reset"] = bytes(merged["reset"])
        if isinstance(merged.get("cache"), Mapping):
            merged["cache"] = CacheConfig(**merged["cache"])
        for key in ("params", "frozen"):
            if isinstance(merged.get(key), str):
                merged[key] = (merged[key],)
            elif key in merged:
                merged[key] = tuple(merged[key])
        for key in ("lr", "decay", "eps"):
            if key in merged:
                merged[key] = float(merged[key])
        for key in ("segment", "adapter_units", "layers_from"):  # a whole number written as 20.0 is still 20
            value = merged.get(key)
            if isinstance(value, float) and value.is_integer():
                merged[key] = int(value)
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; `from_dict(to_dict())` gives an equal config."""
        out = dataclasses.asdict(self)
        out["params"], out["frozen"] = list(self.params), list(self.frozen)
        if self.reset is not None:
            try:
                out["reset"] = self.reset.decode("utf-8")
            except UnicodeDecodeError:
                out["reset"] = list(self.reset)
        return out


# user-facing evaluation mode -> (DynEvalConfig mode, dyneval.json section, neural cache on)
EVAL_MODES: dict[str, tuple[str, str | None, bool]] = {
    "static": ("static", None, False),
    "dynamic": ("full", "full", False),
    "sparse": ("sparse", "sparse", False),
    "cache": ("static", None, True),
    "dynamic+cache": ("full", "full", True),
    "sparse+cache": ("sparse", "sparse", True),
}


class DynEvalSettings(Mapping[str, Any]):
    """A checkpoint's dyneval.json, parsed and validated once by the checkpoint loader.

    Sections: "full" and "sparse" (tuned on validation text by `adaptlm tune`), "session" (the serving default
    for users' sessions; falls back to "sparse"), "cache" (the neural cache); other keys (notes, tuning
    provenance) are kept as written. It reads as the JSON object it was parsed from (a Mapping), and gives each
    mode's typed `DynEvalConfig`. Any invalid section raises ValueError naming it.
    """

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._raw = dict(data or {})
        for key, value in self._raw.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key!r} is not finite")
        for mode in EVAL_MODES:  # every mode's settings must build
            self.config(mode)
        self.session = self._section_config("session" if self._raw.get("session") else "sparse", "sparse")
        section = self._raw.get("session") or {}
        weight = section.get("cache_weight", 0.0) if isinstance(section, Mapping) else 0.0
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight <= 1:
            raise ValueError(f"the session section's cache_weight must be a number in [0, 1], not {weight!r}")
        self.cache_weight = float(weight)  # the word cache's weight in keyboard suggestions
        # the neural cache a session may mix in (an option of the session, off unless the section says
        # "neural_cache": true): the "cache" section's window, theta and lam (`adaptlm tune --mode cache`)
        neural = section.get("neural_cache", False) if isinstance(section, Mapping) else False
        if not isinstance(neural, bool):
            raise ValueError(f"the session section's neural_cache must be true or false, not {neural!r}")
        self.neural_cache = neural
        cache = self.config("cache").cache
        assert cache is not None
        self.cache = cache
        # the sessions' copy model (models/copymodel.py): on when the checkpoint has the section (of the shipped
        # ones only checkpoints/default does: `python -m bench.copy_defaults` writes it; the transformers and the word
        # model have none); absent, null or false: off
        section = self._raw.get("copy")
        try:
            self.copy = CopyConfig.from_dict(section) if section not in (None, False) else None
        except (TypeError, ValueError) as e:
            raise ValueError(f"section 'copy': {e}") from None

    def __getitem__(self, key: str) -> Any:
        return self._raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def _section(self, name: str | None) -> dict[str, Any]:
        if name is None:
            return {}
        section = self._raw.get(name, {})
        if not isinstance(section, Mapping):
            raise ValueError(f"section {name!r} must be an object")
        return dict(section)

    def _section_config(self, name: str, mode: str) -> DynEvalConfig:
        try:
            return DynEvalConfig.from_dict(self._section(name), mode=mode, cache=None)
        except (TypeError, ValueError) as e:
            raise ValueError(f"section {name!r}: {e}") from None

    def config(self, mode: str, **overrides: Any) -> DynEvalConfig:
        """The settings of a user-facing mode (`EVAL_MODES`), with `overrides` (None values ignored) on top."""
        if mode not in EVAL_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(EVAL_MODES)}")
        inner, name, cache = EVAL_MODES[mode]
        base = self._section(name)
        if cache:  # its settings; the rest of the section is what `adaptlm tune --mode cache` measured
            fields = {f.name for f in dataclasses.fields(CacheConfig)}
            base["cache"] = {k: v for k, v in self._section("cache").items() if k in fields}
        else:
            base.pop("cache", None)
        given = {k: v for k, v in overrides.items() if v is not None}
        if "cache" in given and isinstance(given["cache"], Mapping):
            given["cache"] = CacheConfig(**{**base.get("cache", {}), **given["cache"]})
        try:
            return DynEvalConfig.from_dict(base, mode=inner, **given)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{mode} (section {name!r}): {e}") from None
