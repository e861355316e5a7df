"""Architecture registry: name -> (Config, Model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.adaptive_transformer import AdaptiveTransformer, AdaptiveTransformerConfig
from models.awd_lstm import AWDLSTM, AWDLSTMConfig
from models.base import LanguageModel, ModelConfig
from models.char_transformer import CharTransformer, CharTransformerConfig
from models.compressive import CompressiveConfig, CompressiveTransformer
from models.mlstm import MLSTM, MLSTMConfig

__all__ = ["REGISTRY", "build_model", "config_from_dict", "register"]

REGISTRY: dict[str, tuple[type[ModelConfig], type[LanguageModel]]] = {
    "mlstm": (MLSTMConfig, MLSTM),
    "char-transformer": (CharTransformerConfig, CharTransformer),
    "compressive": (CompressiveConfig, CompressiveTransformer),
    "awd-lstm": (AWDLSTMConfig, AWDLSTM),
    "adaptive-transformer": (AdaptiveTransformerConfig, AdaptiveTransformer),
}


def register(config_cls: type[ModelConfig], model_cls: type[LanguageModel]) -> None:
    """Add an architecture under `config_cls.arch` (a new model file calls this; so can a test's toy model)."""
    if not config_cls.arch:
        raise ValueError("a config class names its architecture in `arch`")
    known = REGISTRY.get(config_cls.arch)
    if known is not None and known != (config_cls, model_cls):
        raise ValueError(f"architecture {config_cls.arch!r} is already registered")
    REGISTRY[config_cls.arch] = (config_cls, model_cls)


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
