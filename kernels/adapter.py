"""Per-session adapters h' = h + M h on the first A units of each row (Krause's thesis
sec. 4.6, eq. 4.8; docs/algorithms.md §3).

`batched_adapter`: h (N, H) rows of many sessions, m (S, A, A) one adapter per session with A <= H, index (N,) the
session of each row (any order, repeats, sessions unused) -> out (N, H):
    out[n, :A] = h[n, :A] + m[index[n]] @ h[n, :A];   out[n, A:] = h[n, A:]
`apply_adapter`: the one-row-per-session case, h (B, H) and m (B, A, A) (index = arange(B)).

A recurrent model applies the same M at every time step. Plain autograd then writes a (B, A, A) gradient for M at
every step and sums them: for B = 32 sessions and A = 768 that is 75 MB of memory traffic per step. `AdapterSteps`
instead records each step's (h_t, dL/dh'_t) and forms dL/dM = sum_t (dL/dh'_t)^T h_t as one batched matmul per
sequence, when backward reaches M; its steps run the Triton kernel when Triton is selected.

The Triton path is one launch with no host-side preparation (no sort, no sync): program (session s, block of
output units, block of rows) scans its rows' `index` in chunks of 16-64 and, for each chunk holding rows of s,
multiplies them by blocks of M[s] with tl.dot (fp32 accumulation); chunks without s are skipped after reading
their indices only. So each used M is read once per chunk of its rows (from L2 after the first), no (N, A, A)
gather is formed, and the units A.. H are copied by the same programs. dL/dM: one program per (session, block of
M) sums its rows' outer products the same way, so no atomics are needed and the result is deterministic;
sessions with no rows get zeros. When sessions x rows is large (> 2^22 index reads per unit block) the scan would
dominate; then the rows are grouped by a stable sort on the device and each program takes a tile of one session.

One row per session (`apply_adapter`, `AdapterSteps`: index = arange(B)) is exactly a batched matmul: the default
there is torch.bmm (cuBLAS), whatever the process default; impl="triton" forces the kernel.

Known limits: the Triton path computes in h's dtype (M is cast to it); fp32 dots run in IEEE fp32 (not TF32);
`adapted_mlstm` (the fused recurrence) applies its adapter with `apply_adapter_ref`. The reference forms the
gathered adapters m[index] and one bmm on a GPU when N * A^2 elements fit 256 MB (the fastest torch form
measured on an H200); otherwise, and on a CPU, it bmm's session tiles sized on the host (one sync on a GPU).
Indices outside [0, S) are not checked by the kernel (their rows are left unwritten).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels._dispatch import resolve_impl, tl, triton_kernel

__all__ = ["AdapterSteps", "apply_adapter", "apply_adapter_groups", "apply_adapter_positions", "apply_adapter_ref",
           "batched_adapter", "batched_adapter_ref"]


def apply_adapter_ref(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference. h: (B, H), m: (B, k, k) -> (B, H)."""
    k = m.shape[-1]
    head = h[:, :k]  # (B, k)
    # (B, 1, k) @ (B, k, k)^T: row-vector form, ~10x faster on CPU than bmm(M, h[..., None])
    adapted = head + torch.bmm(head.unsqueeze(1), m.transpose(1, 2)).squeeze(1)  # (B, k) h' = h + M h
    if k == h.shape[1]:
        return adapted
    return torch.cat([adapted, h[:, k:]], dim=1)  # (B, H)


def apply_adapter_groups(h: torch.Tensor, m: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """h (B, H), m (S, k, k), session i's matrix for counts[i] consecutive rows (sum = B) -> (B, H), h' = h + M h
    without gradients, the same numbers as `apply_adapter_ref` on the matrices repeated per row: each session's rows
    one batched product on its matrix repeated as a view. Repeating them in memory costs more than the products on
    a CPU (8 sessions of 8 rows, k = 256: 0.57 against 2.3 ms)."""
    if len(counts) == 1:
        return apply_adapter_ref(h, m.expand(counts[0], *m.shape[1:]))
    k = m.shape[-1]
    heads = torch.split(h[:, :k], list(counts))  # (n, k) each
    parts = [head + torch.bmm(head.unsqueeze(1), m[i : i + 1].expand(n, k, k).transpose(1, 2)).squeeze(1)
             for i, (head, n) in enumerate(zip(heads, counts, strict=True))]
    adapted = torch.cat(parts)  # (B, k)
    return adapted if k == h.shape[1] else torch.cat([adapted, h[:, k:]], dim=1)  # (B, H)


def apply_adapter_positions(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """A site outside any recurrence (the transformers' residual stream): x (B, T, H), m (B, k, k) -> (B, T, H),
    h' = h + M h at every position as one bmm (a loop of `AdapterSteps` over positions is T launches and T graph
    nodes). Plain autograd: dL/dM = sum_t g_t h_t^T is the bmm's own backward, one matmul."""
    k = m.shape[-1]
    head = x[..., :k]  # (B, T, k)
    adapted = head + torch.bmm(head, m.transpose(1, 2))  # (B, T, k) row-vector form
    return adapted if k == x.shape[-1] else torch.cat([adapted, x[..., k:]], dim=-1)  # (B, T, H)


_GATHER_BYTES = 1 << 28  # the reference gathers m[index] on a GPU up to this size


def batched_adapter_ref(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch reference (plain autograd; grad m sums each session's rows). Layout in the module docstring.

    On a GPU, when the gathered adapters m[index] fit `_GATHER_BYTES`: one bmm on them. Otherwise vectorised
    without the (N, A, A) gather: rows are placed in tiles of one session each (a row's tile and slot come from its
    rank among its session's rows) and the tiles multiplied by one bmm. When every session fits one tile with little
    padding, tile s is session s and m is used as it is; otherwise tiles of ceil(N / sessions used) rows take their
    session's M by a gather of at most 2x the used adapters."""
    N, H = h.shape
    S, A, _ = m.shape
    if N == 0:
        return h.clone()
    head = h[:, :A]  # (N, A)
    if h.is_cuda and N * A * A * m.element_size() <= _GATHER_BYTES:
        adapted = head + torch.bmm(m[index], head.unsqueeze(-1)).squeeze(-1)  # (N, A, A) @ (N, A, 1): h + M h
        return adapted if A == H else torch.cat([adapted, h[:, A:]], dim=1)  # (N, H)
    counts = torch.zeros(S, dtype=torch.int64, device=h.device).index_add_(0, index, torch.ones_like(index))  # (S,)
    order = torch.argsort(index, stable=True)  # (N,) rows grouped by session
    starts = counts.cumsum(0) - counts  # (S,) first sorted position of each session
    rank = torch.empty_like(index)
    rank[order] = torch.arange(N, device=h.device) - starts[index[order]]  # (N,) rank within its session
    width, used = int(counts.max()), int((counts > 0).sum())
    if S * width <= 2 * N and 2 * used >= S:
        tile, slot, mats = index, rank, m  # one tile per session: (S, width)
    else:
        width = -(-N // used)
        per = (counts + width - 1) // width  # (S,) tiles of each session
        tile = (per.cumsum(0) - per)[index] + rank // width  # (N,)
        slot = rank % width
        sess = torch.repeat_interleave(torch.arange(S, device=h.device), per, output_size=int(per.sum()))  # (T,)
        mats = m[sess]  # (T, A, A)
    tiles = head.new_zeros(mats.shape[0], width, A).index_put((tile, slot), head)  # (T, width, A)
    adapted = head + torch.bmm(tiles, mats.transpose(1, 2))[tile, slot]  # (N, A) h + M h, row-vector form
    return adapted if A == H else torch.cat([adapted, h[:, A:]], dim=1)  # (N, H)


@triton_kernel
def _adapter_scan_kernel(x_ptr, m_ptr, out_ptr, idx_ptr, N, A, H, span,
                         s_xn, s_xa, s_ms, s_mj, s_mk, s_on, s_oa,
                         BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # program (session s, block of units j < A, rows [r0, r1)): for every chunk of rows holding rows of s,
    # out[r, j] = x[r, j] + sum_{k < A} m[s, j, k] x[r, k]. A block of units j >= A is a plain copy: there program
    # s copies the s-th of S equal parts of [r0, r1), no scan. The backward's (I + M)^T g swaps s_mj and s_mk.
    s = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_J
    offs_j = j0 + tl.arange(0, BLOCK_J)
    jmask = offs_j < H
    wj = offs_j < A
    r0 = tl.program_id(2) * span
    r1 = tl.minimum(r0 + span, N)
    if j0 >= A:
        part = (span + tl.num_programs(0) - 1) // tl.num_programs(0)
        c0 = r0 + s * part
        c1 = tl.minimum(c0 + part, r1)
        for p0 in range(c0, c1, BLOCK_N):
            p = p0 + tl.arange(0, BLOCK_N)
            cmask = (p < c1)[:, None] & jmask[None, :]
            xj = tl.load(x_ptr + p[:, None] * s_xn + offs_j[None, :] * s_xa, mask=cmask, other=0.0)
            tl.store(out_ptr + p[:, None] * s_on + offs_j[None, :] * s_oa, xj.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        for p0 in range(r0, r1, BLOCK_N):
            p = p0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,) row ids
            pmask = p < r1
            mine = pmask & (tl.load(idx_ptr + p, mask=pmask, other=-1) == s)
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                acc = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
                for k0 in range(0, A, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    kmask = offs_k < A
                    x = tl.load(x_ptr + p[:, None] * s_xn + offs_k[None, :] * s_xa,
                                mask=mine[:, None] & kmask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
                    w = tl.load(m_ptr + s * s_ms + offs_k[:, None] * s_mk + offs_j[None, :] * s_mj,
                                mask=kmask[:, None] & wj[None, :], other=0.0)  # (BLOCK_K, BLOCK_J) M[s]^T
                    if IEEE:
                        acc = tl.dot(x, w, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(x, w, acc)
                omask = mine[:, None] & jmask[None, :]
                xj = tl.load(x_ptr + p[:, None] * s_xn + offs_j[None, :] * s_xa, mask=omask, other=0.0)
                y = xj.to(tl.float32) + acc
                tl.store(out_ptr + p[:, None] * s_on + offs_j[None, :] * s_oa, y.to(out_ptr.dtype.element_ty),
                         mask=omask)


@triton_kernel
def _adapter_scan_grad_m_kernel(g_ptr, x_ptr, dm_ptr, idx_ptr, N, A,
                                s_gn, s_ga, s_xn, s_xa, s_ds, s_dj, s_dk,
                                BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                                IEEE: tl.constexpr):
    # program (session s, block j, block k): dm[s, j, k] = sum over s's rows r of g[r, j] x[r, k], scanning all rows
    s = tl.program_id(0)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    jmask = offs_j < A
    kmask = offs_k < A
    acc = tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32)
    for p0 in range(0, N, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        pmask = p < N
        mine = pmask & (tl.load(idx_ptr + p, mask=pmask, other=-1) == s)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            gt = tl.load(g_ptr + p[None, :] * s_gn + offs_j[:, None] * s_ga, mask=jmask[:, None] & mine[None, :],
                         other=0.0)  # (BLOCK_J, BLOCK_N) g^T
            x = tl.load(x_ptr + p[:, None] * s_xn + offs_k[None, :] * s_xa, mask=mine[:, None] & kmask[None, :],
                        other=0.0)  # (BLOCK_N, BLOCK_K)
            if IEEE:
                acc = tl.dot(gt, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(gt, x, acc)
    tl.store(dm_ptr + s * s_ds + offs_j[:, None] * s_dj + offs_k[None, :] * s_dk, acc.to(dm_ptr.dtype.element_ty),
             mask=jmask[:, None] & kmask[None, :])


@triton_kernel
def _batched_adapter_kernel(x_ptr, m_ptr, out_ptr, rows_ptr, tile_sess_ptr, tile_lo_ptr, tile_hi_ptr, A,
                            s_xn, s_xa, s_ms, s_mj, s_mk, s_on, s_oa,
                            BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                            IEEE: tl.constexpr):
    # program (tile t, block of units j): the tile's rows rows[lo:hi] all belong to session s;
    # out[r, j] = x[r, j] + sum_k m[s, j, k] x[r, k]. The backward's (I + M)^T g swaps s_mj and s_mk.
    t = tl.program_id(0)
    s = tl.load(tile_sess_ptr + t)
    lo = tl.load(tile_lo_ptr + t)
    hi = tl.load(tile_hi_ptr + t)
    p = lo + tl.arange(0, BLOCK_N)
    rmask = p < hi
    rows = tl.load(rows_ptr + p, mask=rmask, other=0)  # (BLOCK_N,)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    jmask = offs_j < A
    a_live = tl.where(hi > lo, A, 0)  # padding tiles (the grid is an upper bound) read nothing of M
    acc = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
    for k0 in range(0, A, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < A
        x = tl.load(x_ptr + rows[:, None] * s_xn + offs_k[None, :] * s_xa, mask=rmask[:, None] & kmask[None, :],
                    other=0.0)  # (BLOCK_N, BLOCK_K)
        w = tl.load(m_ptr + s * s_ms + offs_k[:, None] * s_mk + offs_j[None, :] * s_mj,
                    mask=(offs_k < a_live)[:, None] & jmask[None, :], other=0.0)  # (BLOCK_K, BLOCK_J) M[s]^T
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    omask = rmask[:, None] & jmask[None, :]
    xj = tl.load(x_ptr + rows[:, None] * s_xn + offs_j[None, :] * s_xa, mask=omask, other=0.0)
    y = xj.to(tl.float32) + acc
    tl.store(out_ptr + rows[:, None] * s_on + offs_j[None, :] * s_oa, y.to(out_ptr.dtype.element_ty), mask=omask)


@triton_kernel
def _adapter_grad_m_kernel(g_ptr, x_ptr, dm_ptr, rows_ptr, starts_ptr, ends_ptr, A,
                           s_gn, s_ga, s_xn, s_xa, s_ds, s_dj, s_dk,
                           BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                           IEEE: tl.constexpr):
    # program (session s, block j, block k): dm[s, j, k] = sum over s's rows r of g[r, j] x[r, k]
    s = tl.program_id(0)
    lo = tl.load(starts_ptr + s)
    hi = tl.load(ends_ptr + s)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    jmask = offs_j < A
    kmask = offs_k < A
    acc = tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32)
    for p0 in range(lo, hi, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        rmask = p < hi
        rows = tl.load(rows_ptr + p, mask=rmask, other=0)
        gt = tl.load(g_ptr + rows[None, :] * s_gn + offs_j[:, None] * s_ga, mask=jmask[:, None] & rmask[None, :],
                     other=0.0)  # (BLOCK_J, BLOCK_N) g^T
        x = tl.load(x_ptr + rows[:, None] * s_xn + offs_k[None, :] * s_xa, mask=rmask[:, None] & kmask[None, :],
                    other=0.0)  # (BLOCK_N, BLOCK_K)
        if IEEE:
            acc = tl.dot(gt, x, acc, input_precision="ieee")
        else:
            acc = tl.dot(gt, x, acc)
    tl.store(dm_ptr + s * s_ds + offs_j[:, None] * s_dj + offs_k[None, :] * s_dk, acc.to(dm_ptr.dtype.element_ty),
             mask=jmask[:, None] & kmask[None, :])


_TILE = 16  # rows per program of the sorted path (tl.dot's minimum)
_SCAN_LIMIT = 1 << 22  # sessions x rows above which the rows are sorted instead of scanned


@dataclass(frozen=True)
class _Plan:
    """Rows grouped by session, built on the device without a host sync (the sorted path)."""

    n_sessions: int
    rows: torch.Tensor  # (N,) row ids sorted by session (stable)
    starts: torch.Tensor  # (S,) each session's first position in `rows`
    ends: torch.Tensor  # (S,)
    tile_sess: torch.Tensor  # (T,) T = min(S, N) + ceil(N / 16), an upper bound on the tiles needed
    tile_lo: torch.Tensor  # (T,) positions [lo, hi) in `rows`; lo = hi for padding tiles
    tile_hi: torch.Tensor


@dataclass(frozen=True)
class _Rows:
    """Which session each row belongs to, as the kernels take it: the index itself (scan) or a sorted plan."""

    n_sessions: int
    index: torch.Tensor  # (N,) int32 / int64
    plan: _Plan | None  # the sorted path when sessions x rows > _SCAN_LIMIT


def _plan(index: torch.Tensor, n_sessions: int) -> _Plan:
    N, S = index.shape[0], n_sessions
    index = index.to(torch.int64)
    counts = torch.zeros(S, dtype=torch.int64, device=index.device).index_add_(0, index, torch.ones_like(index))
    rows = torch.argsort(index, stable=True)  # (N,)
    ends = counts.cumsum(0)
    starts = ends - counts
    per = (counts + _TILE - 1) // _TILE  # (S,) tiles per session
    tile_ends = per.cumsum(0)
    t = torch.arange(min(S, N) + -(-N // _TILE), device=index.device)  # (T,)
    sess = torch.searchsorted(tile_ends, t, right=True)  # (T,) first session whose tiles reach past t
    live = sess < S
    sess = sess.clamp(max=S - 1)
    lo = starts[sess] + (t - (tile_ends - per)[sess]) * _TILE
    hi = torch.minimum(lo + _TILE, ends[sess])
    lo, hi = torch.where(live, lo, 0), torch.where(live, hi, 0)
    return _Plan(S, rows, starts, ends, sess, lo, hi)


def _rows(index: torch.Tensor, n_sessions: int) -> _Rows:
    big = n_sessions * index.shape[0] > _SCAN_LIMIT
    return _Rows(n_sessions, index, _plan(index, n_sessions) if big else None)


def _block(A: int) -> int:
    return 64 if A > 32 else 32 if A > 16 else 16


def _adapter_triton(x: torch.Tensor, m: torch.Tensor, rows: _Rows, transpose: bool = False) -> torch.Tensor:
    """Launcher: x (N, H), m (S, A, A) -> x + M x on the first A units (M^T x when `transpose`)."""
    N, H = x.shape
    S, A = m.shape[0], m.shape[-1]
    m = m.to(x.dtype)  # one dtype in the dots (autocast may hand an fp32 M with bf16 rows)
    out = x.new_empty(N, H)
    if N == 0:
        return out
    s_ms, s_mj, s_mk = m.stride()
    if transpose:
        s_mj, s_mk = s_mk, s_mj
    block = _block(A)
    ieee = x.dtype == torch.float32
    plan = rows.plan
    if plan is None:
        chunk = 16 if N <= 32 * S else 64  # rows per chunk: few rows per session waste less of a 16-row dot
        j_blocks = -(-H // block)
        n_chunks = -(-N // chunk)
        busy = max(1, S * -(-A // block))  # programs that scan
        splits = max(1, min(n_chunks, -(-2048 // busy)))  # split the rows when few programs scan
        span = chunk * -(-n_chunks // splits)
        _adapter_scan_kernel[(S, j_blocks, -(-N // span))](
            x, m, out, rows.index, N, A, H, span, *x.stride(), s_ms, s_mj, s_mk, *out.stride(),
            BLOCK_N=chunk, BLOCK_J=block, BLOCK_K=block, IEEE=ieee)
        return out
    if A < H:
        out[:, A:] = x[:, A:]
    if A == 0:
        return out
    _batched_adapter_kernel[(plan.tile_sess.shape[0], -(-A // block))](
        x, m, out, plan.rows, plan.tile_sess, plan.tile_lo, plan.tile_hi, A, *x.stride(), s_ms, s_mj, s_mk,
        *out.stride(), BLOCK_N=_TILE, BLOCK_J=block, BLOCK_K=block, IEEE=ieee)
    return out


def _grad_m_triton(g: torch.Tensor, x: torch.Tensor, rows: _Rows, A: int, dtype: torch.dtype) -> torch.Tensor:
    """Launcher: dL/dM (S, A, A), dm[s] = sum over s's rows of g[:, :A]^T x[:, :A]."""
    dm = torch.empty(rows.n_sessions, A, A, device=g.device, dtype=dtype)
    if dm.numel() == 0:
        return dm
    block = _block(A)
    grid = (rows.n_sessions, -(-A // block), -(-A // block))
    ieee = g.dtype == torch.float32
    if rows.plan is None:
        N = g.shape[0]
        chunk = 16 if N <= 32 * rows.n_sessions else 64
        _adapter_scan_grad_m_kernel[grid](g, x, dm, rows.index, N, A, *g.stride(), *x.stride(), *dm.stride(),
                                          BLOCK_N=chunk, BLOCK_J=block, BLOCK_K=block, IEEE=ieee)
        return dm
    plan = rows.plan
    _adapter_grad_m_kernel[grid](g, x, dm, plan.rows, plan.starts, plan.ends, A, *g.stride(), *x.stride(),
                                 *dm.stride(), BLOCK_N=32, BLOCK_J=block, BLOCK_K=block, IEEE=ieee)
    return dm


class _BatchedAdapter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, m: torch.Tensor, rows: _Rows) -> torch.Tensor:
        ctx.rows = rows
        ctx.save_for_backward(h, m)
        return _adapter_triton(h, m, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        h, m = ctx.saved_tensors
        gh = _adapter_triton(grad, m, ctx.rows, transpose=True) if ctx.needs_input_grad[0] else None  # (I + M)^T g
        gm = _grad_m_triton(grad, h, ctx.rows, m.shape[-1], m.dtype) if ctx.needs_input_grad[1] else None
        return gh, gm, None


def _check(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor | None) -> None:
    if (h.dim() != 2 or m.dim() != 3 or m.shape[1] != m.shape[2] or m.shape[2] > h.shape[1]
            or (index is None and m.shape[0] != h.shape[0]) or (index is not None and index.shape != (h.shape[0],))):
        raise ValueError(f"adapter of shape {tuple(m.shape)} does not fit hidden state {tuple(h.shape)}"
                         + ("" if index is None else f" with index {tuple(index.shape)}")
                         + ": expected (N, H), (S, A, A) with A <= H, index (N,) (without index: S = N)")


def batched_adapter(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Public op. Layout in the module docstring. `impl`: "triton" | "reference" (default: chosen at start)."""
    _check(h, m, index)
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError("index must be int32 or int64")
    if resolve_impl(impl, h, m, index) == "reference":
        return batched_adapter_ref(h, m, index.long())
    if not (torch.is_grad_enabled() and (h.requires_grad or m.requires_grad)):
        return _adapter_triton(h, m, _rows(index, m.shape[0]))  # no autograd node (serving)
    out: torch.Tensor = _BatchedAdapter.apply(h, m, _rows(index, m.shape[0]))  # type: ignore[no-untyped-call]
    return out


def apply_adapter(h: torch.Tensor, m: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Public op for one application, h (B, H), m (B, A, A); for a recurrence over many steps use `AdapterSteps`.
    `impl`: None takes the bmm form (one row per session is a batched matmul: cuBLAS beats the grouped kernel);
    "triton" forces the kernel."""
    _check(h, m, None)
    if impl is None or resolve_impl(impl, h, m) == "reference":
        return apply_adapter_ref(h, m)
    out: torch.Tensor = _BatchedAdapter.apply(  # type: ignore[no-untyped-call]
        h, m, _rows(torch.arange(h.shape[0], device=h.device), m.shape[0]))
    return out


class _Tape:
    """Per-sequence record shared by the step nodes and the gather node."""

    def __init__(self, plan: _Rows | None) -> None:
        self.heads: list[torch.Tensor] = []  # h_t[:, :k] in forward order, (B, k) each
        self.grads: dict[int, torch.Tensor] = {}  # step index -> dL/dh'_t[:, :k], filled by backward
        self.plan = plan  # the Triton kernel's rows (index = arange(B)), None on the bmm form


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
        return apply_adapter_ref(h, m) if tape.plan is None else _adapter_triton(h, m, tape.plan)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        m: torch.Tensor = ctx.m
        tape: _Tape = ctx.tape
        k = m.shape[-1]
        tape.grads[ctx.index] = grad_out[:, :k]  # (B, k)
        if tape.plan is not None:
            return _adapter_triton(grad_out, m, tape.plan, transpose=True), grad_out.new_zeros(1), None, None
        g = grad_out[:, :k]  # (B, k)
        grad_head = g + torch.bmm(g.unsqueeze(1), m).squeeze(1)  # (B, k) (I + M)^T g
        grad_h = grad_head if k == grad_out.shape[1] else torch.cat([grad_head, grad_out[:, k:]], dim=1)
        return grad_h, grad_out.new_zeros(1), None, None


class AdapterSteps:
    """Applies one M (B, k, k) at every step of a sequence: `op = AdapterSteps(m); h = op(h)` per step.

    Gradients w.r.t. `m` (when it requires grad) equal plain autograd's through `apply_adapter_ref`. `impl`: None
    takes the bmm form on every device (one row per session: the grouped kernel only adds work, and measured 0.77x
    end to end on 64 adapting mLSTM sessions); "triton" forces the kernel with index = arange(B) (tests).
    """

    def __init__(self, m: torch.Tensor, *, impl: str | None = None) -> None:
        self.m = m
        self.impl = "reference" if impl is None else resolve_impl(impl, m)
        self._plan = _rows(torch.arange(m.shape[0], device=m.device), m.shape[0]) if self.impl == "triton" else None
        self._track = m.requires_grad and torch.is_grad_enabled()
        if self._track:
            self._tape = _Tape(self._plan)
            self._token = _Gather.apply(m, self._tape)  # type: ignore[no-untyped-call]
            self._m_data = m.detach()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        _check(h, self.m, None)
        out: torch.Tensor
        if not self._track:
            if self._plan is None:
                return apply_adapter_ref(h, self.m)
            out = _BatchedAdapter.apply(h, self.m, self._plan)  # type: ignore[no-untyped-call]
            return out
        out = _Step.apply(h, self._token, self._m_data, self._tape)  # type: ignore[no-untyped-call]
        return out
