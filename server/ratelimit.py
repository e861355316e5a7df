"""Per-API-key rate limits: a token bucket per key (ADAPTLM_RATE_LIMIT_PER_S, ADAPTLM_RATE_LIMIT_BURST).

Each request to a /v1 route takes one token from its key's bucket, which refills at `rate` tokens a second up to
`burst`; a request that finds it empty is refused (429, `Retry-After`: the seconds until a token is back). Without
API keys, all clients share one bucket. The queue's own 429 (`max_queue`) bounds the work in flight whatever the
keys; this bounds what one key may ask for, so that one client cannot take all of it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

__all__ = ["RateLimiter"]


class RateLimiter:
    """Token buckets by key; thread-safe (FastAPI runs sync dependencies on a thread pool). `rate` 0: no limit."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, max(1, burst), clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when they were counted)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, key: str) -> float | None:
        """Take a token from `key`'s bucket -> None, or the seconds until one is back if the bucket is empty."""
        if not self.enabled:
            return None
        now = self._clock()
        with self._lock:
            tokens, then = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                return None
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate

    @staticmethod
    def retry_after(seconds: float) -> str:
        """A Retry-After header value: whole seconds, at least 1."""
        return str(max(1, math.ceil(seconds)))
