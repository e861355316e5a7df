"""Test-time adaptation: dynamic evaluation (full and sparse) and the neural cache (ALGORITHMS.md §2-4).

    evaluate(model, text, DynEvalConfig(mode="sparse"), stats=ckpt.stats) -> EvalResult
    sparse_step(...)   one batched score-then-update step over B streams (the server engine's unit)
    score_step(...)    the same step without the update (scoring with fixed adapters)
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
from models.adaptation._sparse import ScoreStep, SparseStep, adapter_ms_g, score_step, sparse_step

__all__ = [
    "MODES", "RULES", "CacheConfig", "DynEvalConfig", "EvalResult", "NeuralCache", "ScoreStep", "SparseStep",
    "UpdateRule", "adapted_parameter_names", "adapter_ms_g", "evaluate", "evaluate_many", "score_step", "sparse_step",
    "split_documents",
]
