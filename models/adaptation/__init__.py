"""Test-time adaptation: dynamic evaluation (full and sparse) and the neural cache (docs/algorithms.md §2-4).

    evaluate(model, text, DynEvalConfig(mode="sparse"), stats=ckpt.stats) -> EvalResult
    batch_step(model, jobs, segment)   the one score-then-update step over many streams, each with its own
                                       state, adapter, rule and guard: evaluation, the engine and keysim run it
    sparse_step(...)   its adapting half: one forward, backward and update of B streams' adapters
    score_step(...)    its scoring half (fixed adapters)
    FullStream         full dynamic evaluation of one stream (a private copy of the weights)
    VariantStream      one stream of a variant of the session's adaptation (other parts, rates; bench.adapt_losses)
"""

from models.adaptation._adapter_memory import MAX_SESSION_LR, AdapterMemory, AdapterSettings, adapter_limits
from models.adaptation._cache import CacheMemory, NeuralCache, hidden_size, read_memory
from models.adaptation._config import EVAL_MODES, MODES, RULES, CacheConfig, DynEvalConfig, DynEvalSettings
from models.adaptation._evaluate import EvalResult, evaluate, evaluate_many, split_documents
from models.adaptation._full import FullStream, adapted_parameter_names
from models.adaptation._rules import UpdateRule
from models.adaptation._sparse import (
    ScoreStep,
    SparseStep,
    adapter_ms_g,
    score_step,
    sparse_rule,
    sparse_sites,
    sparse_step,
)
from models.adaptation._step import DIVERGED_BITS, STATIC_SEGMENT, Row, RuleCache, TextJob, batch_step
from models.adaptation._variants import VariantConfig, VariantStream

__all__ = [
    "DIVERGED_BITS", "EVAL_MODES", "MAX_SESSION_LR", "MODES", "RULES", "STATIC_SEGMENT", "AdapterMemory",
    "AdapterSettings", "CacheConfig", "CacheMemory", "DynEvalConfig", "DynEvalSettings", "EvalResult", "FullStream",
    "NeuralCache", "Row", "RuleCache", "ScoreStep", "SparseStep", "TextJob", "UpdateRule", "VariantConfig",
    "VariantStream", "adapter_limits",
    "adapted_parameter_names", "adapter_ms_g", "batch_step", "evaluate", "evaluate_many", "hidden_size",
    "read_memory", "score_step", "sparse_rule", "sparse_sites", "sparse_step", "split_documents",
]
