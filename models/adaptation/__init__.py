"""Test-time adaptation: dynamic evaluation (full and sparse) and the neural cache (ALGORITHMS.md §2-4).

    evaluate(model, text, DynEvalConfig(mode="sparse"), stats=ckpt.stats) -> EvalResult
    sparse_step(...)   one batched score-then-update step over B streams (the server engine's unit)
"""

from models.adaptation._cache import NeuralCache
from models.adaptation._config import MODES, RULES, CacheConfig, DynEvalConfig
from models.adaptation._evaluate import (
    EvalResult,
    adapted_parameter_names,
    evaluate,
    evaluate_many,
    split_documents,
)
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import SparseStep, adapter_ms_g, sparse_step

__all__ = [
    "MODES", "RULES", "CacheConfig", "DynEvalConfig", "EvalResult", "NeuralCache", "SparseStep", "UpdateRule",
    "adapted_parameter_names", "adapter_ms_g", "evaluate", "evaluate_many", "sparse_step", "split_documents",
]
