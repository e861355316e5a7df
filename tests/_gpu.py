"""What the CUDA test files (tests/test_gpu.py, tests/test_gpu_graphs.py) share: their `gpu` marker (the root
conftest skips it, with the reason, where there is no CUDA device), the text they serve, and an engine started for
one piece of async work and stopped after it.

    pytestmark = GPU
    bits = served(tiny_checkpoint, observed_bits, device="cuda", precision="float32")
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from server.engine import Engine, EngineConfig

__all__ = ["GPU", "TEXT", "observe", "served"]

T = TypeVar("T")

GPU = pytest.mark.gpu
TEXT = b"It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 4


def served(checkpoint: Path, work: Callable[[Engine], Coroutine[Any, Any, T]], **config: Any) -> T:
    """`work`'s result on an engine of `checkpoint` (`config`: EngineConfig's fields), stopped whatever happens."""
    engine = Engine(checkpoint, config=EngineConfig(**config))
    engine.start()
    try:
        return asyncio.run(work(engine))
    finally:
        engine.stop()


async def observe(engine: Engine) -> tuple[str, float]:
    """A new session that has observed TEXT: (its id, the bits it was scored at)."""
    session, _ = await engine.create_session(owner=None)
    observed = await engine.score(TEXT, session_id=session.id, adapt=True)
    return session.id, observed.bits
