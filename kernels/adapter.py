"""Batched per-session adapter: h' = h + M_b h on the first k units of each row (thesis sec. 4.6).

Layout: h (B, H) with k <= H; M (B, k, k), one matrix per batch row (session). Units k..H pass through.
Known limits: the Triton kernel is not written yet; every device runs `apply_adapter_ref`.
"""

from __future__ import annotations

import torch

__all__ = ["apply_adapter", "apply_adapter_ref"]


def apply_adapter_ref(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference. h: (B, H), m: (B, k, k) -> (B, H)."""
    k = m.shape[-1]
    head = h[:, :k]  # (B, k)
    # (B, 1, k) @ (B, k, k)^T: row-vector form, ~10x faster on CPU than bmm(M, h[..., None])
    adapted = head + torch.bmm(head.unsqueeze(1), m.transpose(1, 2)).squeeze(1)  # (B, k) h' = h + M h
    if k == h.shape[1]:
        return adapted
    return torch.cat([adapted, h[:, k:]], dim=1)  # (B, H)


def apply_adapter(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Public op; picks the implementation (the reference everywhere for now)."""
    if m.shape[0] != h.shape[0] or m.shape[1] != m.shape[2] or m.shape[2] > h.shape[1]:
        raise ValueError(f"adapter of shape {tuple(m.shape)} does not fit hidden state {tuple(h.shape)}")
    return apply_adapter_ref(h, m)
