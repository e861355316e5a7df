"""Checks and session helpers shared by the tests of each model family (tests/models/test_<family>.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient


def random_tokens(n: int, batch: int = 1, seed: int = 0) -> Any:
    """(batch, n) random bytes from a seeded generator."""
    import torch

    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def assert_batched_steppers_equal_each_alone(steppers: Any, steps: int, **tol: float) -> None:
    """Two sets of `Stepper`s made alike by `steppers()`: one fed a token each in one batched step
    (`Stepper.feed_many`) `steps` times, the other each alone; they sample the same tokens and their next-token
    log-probabilities agree within `tol` (torch.testing.assert_close's rtol/atol)."""
    import torch

    from models.sampling import Stepper

    batched, single = steppers(), steppers()
    for _ in range(steps):
        tokens = [s.sample().token for s in batched]
        assert [s.sample().token for s in single] == tokens
        Stepper.feed_many(batched, tokens)
        for s, t in zip(single, tokens, strict=True):
            s.feed(t)
        for a, b in zip(batched, single, strict=True):
            torch.testing.assert_close(a._logits, b._logits, **tol)  # type: ignore[arg-type]


def assert_states_close(a: Any, b: Any, **tol: float) -> None:
    """Two `State`s hold the same tensors: integer and boolean ones (positions, fills, masks, bytes) exactly, floating
    ones within `tol` (torch.testing.assert_close's rtol/atol)."""
    import torch

    assert a.tensors.keys() == b.tensors.keys()
    for k, v in a.tensors.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, b.tensors[k], **tol)  # type: ignore[arg-type]
        else:
            assert torch.equal(v, b.tensors[k]), k


def assert_rows_batch_like_each_alone(model: Any, fills: tuple[int, ...] = (3, 11, 12, 25), *,
                                     states: list[Any] | None = None, steps: int = 9) -> None:
    """Rows whose states come from histories of different lengths (`fills` bytes; or the given one-row `states`),
    run as one batch for `steps` bytes, give each row's logits and state as if it ran alone."""
    import torch

    from models.base import State

    with torch.no_grad():
        if states is None:
            states = [model(random_tokens(n, seed=n), model.init_state(1)).state for n in fills]
        x = random_tokens(steps, batch=len(states), seed=9)
        batched = model(x, State.stack(states))
        for r, st in enumerate(states):
            alone = model(x[r : r + 1], st)
            torch.testing.assert_close(batched.logits[r : r + 1], alone.logits, rtol=1e-5, atol=1e-5)
            assert_states_close(batched.state.select(r), alone.state, rtol=1e-5, atol=1e-6)


def input_dependence(model: Any, T: int) -> list[list[bool]]:
    """Row t: for each input s < T, whether output t's logits have a nonzero gradient with respect to input s. The T
    input bytes are distinct, so a probe added to the embedding of byte value x_s is input s, wherever the model
    embeds it (a window's re-encoding included)."""
    import torch

    x = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:T].view(1, T)
    probe = torch.zeros(256, model.config.d_model, requires_grad=True)
    hook = model.embed.register_forward_hook(lambda _m, inp, out: out + probe[inp[0]])
    try:
        out = model(x, model.init_state(1))
    finally:
        hook.remove()
    rows = []
    for t in range(T):
        (grad,) = torch.autograd.grad(out.logits[0, t].sum(), probe, retain_graph=True)
        rows.append((grad[x[0]].abs().sum(1) > 0).tolist())  # (T,) whether output t depends on input s
    return rows


def assert_evaluate_many_equals_each_text_alone(model: Any) -> None:
    """Batched sparse dynamic evaluation (3 streams for 5 texts, segments ending at different times) equals each text
    alone: log-probabilities, adapters and final states."""
    import numpy as np
    import torch

    from models.adaptation import DynEvalConfig, evaluate, evaluate_many
    from tests._training import repetitive

    text = b"It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want"
    texts = [repetitive(57, seed=1), text, repetitive(13, seed=2), b"x", repetitive(90, seed=3)]
    cfg = DynEvalConfig(mode="sparse", rule="sgd", lr=0.3, segment=10, adapter_units=20)
    for res, one in zip(evaluate_many(model, texts, cfg, max_streams=3), texts, strict=True):
        alone = evaluate(model, one, cfg)
        assert res.bytes == len(one)
        np.testing.assert_allclose(res.logprobs, alone.logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res.adapted["resid"], alone.adapted["resid"], rtol=1e-4, atol=1e-6)
        assert res.state is not None and alone.state is not None
        assert_states_close(res.state, alone.state, rtol=1e-4, atol=1e-5)


def assert_greedy_generation_equals_recomputation(model: Any, prompt: bytes = b"It is a ", n: int = 30) -> None:
    """Greedy generation of n bytes after `prompt` (one byte a call, through the model's state) equals the argmax of
    a fresh forward over the whole text (BOS, prompt, bytes so far) at each step."""
    import torch

    from models.sampling import SamplingParams, generate
    from models.scoring import BOS

    greedy = "".join(generate(model, prompt, SamplingParams(max_tokens=n, temperature=0)))
    ctx, expected = [BOS, *prompt], []
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ctx]), model.init_state(1)).logits[0, -1].argmax())
        expected.append(nxt)
        ctx.append(nxt)
    assert greedy == bytes(expected).decode("utf-8", errors="replace")


@contextmanager
def served(checkpoint: Path, **settings: Any) -> Iterator[TestClient]:
    """An in-process server of `checkpoint` (float32, max_wait_ms=100 unless `settings` say otherwise)."""
    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(**{"checkpoint": checkpoint, "precision": "float32", "max_wait_ms": 100, **settings}))
    with TestClient(app) as c:
        yield c


def create_session(client: TestClient, **body: Any) -> dict[str, Any]:
    """POST /v1/sessions with `body`: -> the created session (status 201 asserted)."""
    r = client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def observe_text(client: TestClient, sid: str, text: str) -> dict[str, Any]:
    """POST /v1/sessions/{sid}/observe with `text`: -> the response body (status 200 asserted)."""
    r = client.post(f"/v1/sessions/{sid}/observe", json={"text": text})
    assert r.status_code == 200, r.text
    return dict(r.json())
