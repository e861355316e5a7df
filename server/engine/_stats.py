"""The engine's counters, read by the metrics collector at each scrape."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters of the work done; written by the worker thread only (the session-store fields are filled in
    when a copy is taken), read as a copy."""

    prompt_tokens: int = 0  # bytes prefilled
    generated_tokens: int = 0  # bytes sampled
    cancelled: int = 0  # generations stopped early because their caller went away
    active: int = 0  # generations in progress
    cancelled_work: int = 0  # text work and session operations dropped because their caller went away
    budget_exceeded: int = 0  # work stopped because its request took more engine time than one may
    queued: int = 0  # work items waiting to start
    batches: int = 0  # batched model calls of text work
    batch_rows: dict[int, int] = field(default_factory=dict)  # rows in a batched call -> how many calls
    decode_rows: dict[int, int] = field(default_factory=dict)  # the same for generation's one-byte steps
    suggest_rows: dict[int, int] = field(default_factory=dict)  # the same for keyboard suggestions' steps
    suggest_cut: int = 0  # suggestions whose word search the time budget stopped
    suggest_fallbacks: int = 0  # device word searches not certified exact, searched again on the host
    updates: int = 0  # session adapter updates applied
    nonfinite_resets: int = 0  # updates refused (or adapters reset) by the non-finite guard
    # adaptations after a generation (`adapt_while_generating`) dropped: another server changed the session before
    # the write of each of its tries (SessionConflict)
    generation_adaptations_dropped: int = 0
    sessions: int = 0
    session_bytes: int = 0
    evictions: dict[str, int] = field(default_factory=dict)  # by reason: ttl, lru
    # the session slots' counters (server/engine/_slots.py SlotStats by field: capacity, used, hits, misses,
    # evictions, declined); empty when the engine keeps none
    slots: dict[str, int] = field(default_factory=dict)

    def count_cancelled(self, kind: str) -> None:
        """Work of `kind` dropped because its caller went away: generations count apart (their own metric)."""
        if kind == "generate":
            self.cancelled += 1
        else:
            self.cancelled_work += 1
