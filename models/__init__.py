"""The math: tokenizer, architectures, checkpoints, scoring and sampling."""

from models.base import Adapter, LanguageModel, ModelConfig, Output, Site, State
from models.mlstm import MLSTM, MLSTMConfig
from models.registry import REGISTRY, build_model, config_from_dict
from models.tokenizer import ByteTokenizer

__all__ = [
    "MLSTM", "REGISTRY", "Adapter", "ByteTokenizer", "LanguageModel", "MLSTMConfig", "ModelConfig",
    "Output", "Site", "State", "build_model", "config_from_dict",
]
