"""The start-up check of the Triton kernels on the model they are about to serve.

A kernel can compile and still compute something else on a given GPU and Triton build
(docs/notes/2026-11-benchmarks-history.md: a rewrite of the attention kernel was off by 1.0 on an H200 with `rel`,
from a Triton bug before its fix). So before a server serves with the kernels, `check_model` runs the loaded model
under both implementations, on a short random prompt and one decoding step after it, with a random adapter on every
adaptation site (what sessions run), and compares the next-token log-probabilities. On a disagreement, or an
exception, the server serves with the references (server/engine/_loading.py) and says why in its log; `/metrics`'
`kernel` label then reads "reference".
"""

from __future__ import annotations

import math

import torch

from kernels._dispatch import forced
from models.base import Adapter, LanguageModel

PROMPT_TOKENS = 40  # more than one attention tile of the interpreter (16) and of the GPU's decoding tiles
# log-probabilities (nats) the two may differ by: float32 models compute alike up to summation order; half-precision
# ones round differently in each (the kernels keep fp32 softmax statistics where the references round)
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.2}


def check_model(model: LanguageModel, vocab_size: int) -> str | None:
    """Why the Triton kernels cannot serve `model` (an exception, or log-probabilities off the references'), or
    None. It runs the model three times on two rows (tiny shapes: a few milliseconds on a GPU, plus compiling)."""
    param = next(model.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (2, PROMPT_TOKENS + 1), generator=g).to(param.device)
    sites = {s.name: s.units or s.dim for s in model.adaptation_sites()}
    adapter = None
    if sites:
        adapter = Adapter({n: (0.05 * torch.randn(2, k, k, generator=g)).to(param.device, param.dtype)
                           for n, k in sites.items()})

    def run(impl: str) -> torch.Tensor:
        with forced(impl), torch.no_grad():
            out = model(tokens[:, :-1], model.init_state(2), adapter)
            step = model(tokens[:, -1:], out.state, adapter)  # decoding: one query row
            return torch.cat([out.logits, step.logits], 1).float().log_softmax(-1)  # (2, T + 1, V)

    try:
        got = run("triton")
    except Exception as e:  # a kernel that does not compile or launch here
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    want = run("reference")
    tolerance = TOLERANCE.get(param.dtype, 0.2)
    err = (got - want).abs().max().item()
    if not math.isfinite(err) or err > tolerance:
        return f"next-token log-probabilities {err:.3g} off the references' (at most {tolerance:g} allowed)"
    return None
