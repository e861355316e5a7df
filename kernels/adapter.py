"""Batched per-session adapter: h' = h + M_b h on the first k units of each row (thesis sec. 4.6).

Layout: h (B, H) with k <= H; M (B, k, k), one matrix per batch row (session). Units k..H pass through.

A recurrent model applies the same M at every time step. Plain autograd then writes a (B, k, k)
gradient for M at every step and sums them: for B = 32 sessions and k = 768 that is 75 MB of memory
traffic per step. `AdapterSteps` instead records each step's (h_t, dL/dh'_t) and forms
dL/dM = sum_t (dL/dh'_t)^T h_t as one batched matmul per sequence, when backward reaches M.

Known limits: the Triton kernel is not written yet; every device runs the PyTorch path.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["AdapterSteps", "adapter_implementation", "apply_adapter", "apply_adapter_ref", "batched_adapter",
           "batched_adapter_ref"]


def apply_adapter_ref(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference. h: (B, H), m: (B, k, k) -> (B, H)."""
    k = m.shape[-1]
    head = h[:, :k]  # (B, k)
    # (B, 1, k) @ (B, k, k)^T: row-vector form, ~10x faster on CPU than bmm(M, h[..., None])
    adapted = head + torch.bmm(head.unsqueeze(1), m.transpose(1, 2)).squeeze(1)  # (B, k) h' = h + M h
    if k == h.shape[1]:
        return adapted
    return torch.cat([adapted, h[:, k:]], dim=1)  # (B, H)


def batched_adapter_ref(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference. h (N, H) rows of many sessions, m (S, A, A) one adapter per session acting on the
    first A <= H units, index (N,) int64 each row's session (any order, repeats, sessions unused) -> (N, H):
    out[n, :A] = h[n, :A] + m[index[n]] @ h[n, :A]; other units unchanged."""
    return apply_adapter_ref(h, m[index])  # m[index]: (N, A, A); autograd sums each session's rows into grad m


def adapter_implementation() -> str:
    """Which implementation `apply_adapter` runs ("reference": no Triton kernel exists yet)."""
    return "reference"


def _check(h: torch.Tensor, m: torch.Tensor) -> None:
    if m.dim() != 3 or m.shape[0] != h.shape[0] or m.shape[1] != m.shape[2] or m.shape[2] > h.shape[1]:
        raise ValueError(f"adapter of shape {tuple(m.shape)} does not fit hidden state {tuple(h.shape)}")


def apply_adapter(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Public op for one application; for a recurrence over many steps use `AdapterSteps`."""
    _check(h, m)
    return apply_adapter_ref(h, m)


class _Tape:
    """Per-sequence record shared by the step nodes and the gather node."""

    def __init__(self) -> None:
        self.heads: list[torch.Tensor] = []  # h_t[:, :k] in forward order, (B, k) each
        self.grads: dict[int, torch.Tensor] = {}  # step index -> dL/dh'_t[:, :k], filled by backward


class _Gather(torch.autograd.Function):
    """M -> a token that every step consumes; its backward runs after all the steps' backwards."""

    @staticmethod
    def forward(ctx: Any, m: torch.Tensor, tape: _Tape) -> torch.Tensor:
        ctx.tape = tape
        return m.new_zeros(1)

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        tape: _Tape = ctx.tape
        if not tape.grads:
            return None, None
        order = sorted(tape.grads)
        g = torch.stack([tape.grads[i] for i in order], dim=1)  # (B, T, k)
        hs = torch.stack([tape.heads[i] for i in order], dim=1)  # (B, T, k)
        tape.grads.clear()
        return torch.bmm(g.transpose(1, 2), hs), None  # (B, k, k) dL/dM = sum_t g_t h_t^T


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, token: torch.Tensor, m: torch.Tensor, tape: _Tape) -> torch.Tensor:
        ctx.m, ctx.tape, ctx.index = m, tape, len(tape.heads)
        tape.heads.append(h[:, : m.shape[-1]].detach())
        return apply_adapter_ref(h, m)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        m: torch.Tensor = ctx.m
        k = m.shape[-1]
        g = grad_out[:, :k]  # (B, k)
        ctx.tape.grads[ctx.index] = g
        grad_head = g + torch.bmm(g.unsqueeze(1), m).squeeze(1)  # (B, k) (I + M)^T g
        grad_h = grad_head if k == grad_out.shape[1] else torch.cat([grad_head, grad_out[:, k:]], dim=1)
        return grad_h, grad_out.new_zeros(1), None, None


class AdapterSteps:
    """Applies one M (B, k, k) at every step of a sequence: `op = AdapterSteps(m); h = op(h)` per step.

    Gradients w.r.t. `m` (when it requires grad) equal plain autograd's through `apply_adapter_ref`.
    """

    def __init__(self, m: torch.Tensor) -> None:
        self.m = m
        self._track = m.requires_grad and torch.is_grad_enabled()
        if self._track:
            self._tape = _Tape()
            self._token = _Gather.apply(m, self._tape)  # type: ignore[no-untyped-call]
            self._m_data = m.detach()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        _check(h, self.m)
        if not self._track:
            return apply_adapter_ref(h, self.m)
        out: torch.Tensor = _Step.apply(h, self._token, self._m_data, self._tape)  # type: ignore[no-untyped-call]
        return out


def batched_adapter(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Public op. Layout in `batched_adapter_ref`. `impl`: "triton" | "reference"."""
    if (h.dim() != 2 or m.dim() != 3 or m.shape[1] != m.shape[2] or m.shape[2] > h.shape[1]
            or index.shape != (h.shape[0],)):
        raise ValueError(f"h {tuple(h.shape)}, m {tuple(m.shape)}, index {tuple(index.shape)}: expected (N, H), "
                         "(S, A, A) with A <= H, (N,)")
    return batched_adapter_ref(h, m, index)
