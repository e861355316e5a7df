"""Architecture registry: name -> (Config, Model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.base import LanguageModel, ModelConfig
from models.mlstm import MLSTM, MLSTMConfig

__all__ = ["REGISTRY", "build_model", "config_from_dict"]

REGISTRY: dict[str, tuple[type[ModelConfig], type[LanguageModel]]] = {
    "mlstm": (MLSTMConfig, MLSTM),
}


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Validate and build a config; unknown architecture or fields raise ValueError."""
    data = dict(data)
    arch = data.pop("arch", None)
    if arch not in REGISTRY:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[arch][0]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {arch} config fields: {', '.join(unknown)}")
    return cls(**data)


def build_model(config: ModelConfig) -> LanguageModel:
    return REGISTRY[config.arch][1](config)
