# mypy: disable-error-code="no-untyped-def"
# (the Triton functions stay untyped: their annotations are read by Triton, STYLE.md "kernel bodies may stay untyped")
"""Memory attention: causal attention over [compressed memory; memory; current segment] (Compressive Transformer,
ALGORITHMS.md §7), with optional Transformer-XL relative terms (Dai et al. 2019, sec. 3.3).

Layout: q (B, H, Lq, D); k, v (B, H, Lk, D), Lk >= Lq, the last Lq keys are the queries' own positions.
Query i may attend key j iff j <= Lk - Lq + i (causal, aligned bottom-right: every memory slot is visible).
key_lengths (B,) int, optional: row b's valid keys are its LAST key_lengths[b] (memories are left-padded while a
session's memory fills up); key_lengths[b] >= Lq. Softmax scale default D**-0.5, applied to the whole score.
rel = (r, u, v_bias): r (Lr, H, D) sinusoidal encodings already projected, indexed by distance d = Lk - Lq + i - j
(Lr >= Lk), u and v_bias (H, D) the learned global biases:
    score(i, j) = scale * ((q_i + u) . k_j + (q_i + v_bias) . r[d])       Transformer-XL eq. (terms a-d)
-> out (B, H, Lq, D).

The Triton kernel is FlashAttention-2 (Dao 2023, alg. 1 forward, alg. 2 backward): one program per (query tile,
batch, head) runs the online softmax over the key tiles a tile can see (tiles wholly before a row's padding or past
the causal edge are never visited; only the tiles that straddle an edge are masked), fp32 accumulation, and saves
the log-sum-exp. The positional term is computed by distance, in the tile: the tile's distances form one range of
BLOCK_M + BLOCK_N - 1 values, so (q + v_bias) R_range^T is one small matmul, and entry (i, j) picks its column
d(i, j) with a gather along the tile's diagonals; no (Lq, Lk) bias exists in memory. With square tiles the forward
computes only the lower half of each range (the upper half is the previous key tile's lower half), so the positional
matmul costs what the content one does. The gathers lower to warp shuffles (about BLOCK_W / 32 per element, the
rows of a tile each in one warp), which is why the rel kernels run 8 warps. The backward recomputes the
probabilities from the log-sum-exp in three kernels: dq (one program per query tile; it also writes
delta = rowsum(dO o O) for the other two, and per-tile row sums of dq's content and positional parts, whose sums
over batch and tiles are du and dv_bias); dk, dv (one per key tile); and dr, by tile diagonals: square tiles with
one (query tile - key tile) share one distance range, so one program per (diagonal, head, batch group) sums
dS-by-distance times (q + v_bias) over its tiles in registers and writes it once; the launcher adds the overlapping
halves of neighbouring diagonals (no atomics).

Known limits:
- head dims 16, 32, 64, 128; float32, float16, bfloat16 on CUDA (the CPU interpreter: float32 and float16 only,
  it mis-handles bfloat16 dots); q, k, v, r, u, v_bias share one dtype and device. float32 runs full-precision
  (IEEE) dots, not TF32. The positional scores (q + v_bias) . r[d] are rounded to the inputs' dtype before the
  gather, as the reference's matmul rounds them.
- the backward with rel recomputes the scores in all three kernels (the dr kernel included): about 3.5x the
  matmul work of a plain FlashAttention-2 backward.
- a row with no visible key (key_lengths[b] < Lq, against the contract) gives NaN, as the reference does.
- block sizes are fixed per kernel, head dim and Lq (`_block_sizes`, chosen for Hopper from the compiled code:
  few or no register spills at D <= 64; not tuned by timing, no autotuning); decoding (Lq = 1) runs one 16-row
  tile per (batch, head), with no split over the keys. The dr kernel's batch split assumes about 132 SMs.
- Triton is imported at the first launch, and TRITON_INTERPRET is read then: one process runs the kernels either
  interpreted or compiled, not both.
- the reference builds the (Lq, Lk) score matrix (the Triton kernel does not).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import torch

from kernels._dispatch import resolve_impl

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["memory_attention", "memory_attention_ref"]

Rel = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
HEAD_DIMS = (16, 32, 64, 128)


def _allowed(Lq: int, Lk: int, key_lengths: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(B or 1, Lq, Lk) bool: the causal rule aligned bottom-right, and each row's left padding."""
    i = torch.arange(Lq, device=device).view(Lq, 1)
    j = torch.arange(Lk, device=device).view(1, Lk)
    allowed = (j <= Lk - Lq + i).unsqueeze(0)  # (1, Lq, Lk)
    if key_lengths is not None:
        allowed = allowed & (j >= Lk - key_lengths.view(-1, 1)).unsqueeze(1)  # (B, Lq, Lk)
    return allowed


def memory_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rel: Rel | None = None,
                         scale: float | None = None, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch reference (plain autograd). Layout in the module docstring."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    if rel is None:
        scores = q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
    else:
        r, u, vb = rel
        scores = (q + u.view(1, H, 1, D)) @ k.transpose(-1, -2)  # (B, H, Lq, Lk) content terms (a) + (c)
        pos = (q + vb.view(1, H, 1, D)) @ r[:Lk].permute(1, 2, 0)  # (B, H, Lq, Lk) (b) + (d), by distance d
        i = torch.arange(Lq, device=q.device).view(Lq, 1)
        j = torch.arange(Lk, device=q.device).view(1, Lk)
        dist = (Lk - Lq + i - j).clamp(min=0)  # (Lq, Lk) distance of key j from query i
        scores = scores + pos.gather(-1, dist.expand(B, H, Lq, Lk))  # pick column d for entry (i, j)
    scores = scores * scale
    allowed = _allowed(Lq, Lk, key_lengths, q.device).unsqueeze(1)  # (B or 1, 1, Lq, Lk)
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # (B, H, Lq, D)


# -- Triton ----------------------------------------------------------------------------------------------------------
# Triton is imported at the first launch, not with this module: it is optional (the `gpu` extra), and importing it
# fixes interpreted or compiled for the process (TRITON_INTERPRET is read then, and by `triton.jit`). `_jit` only
# registers a function; `_triton()` binds `tl` and replaces each registered function by its `triton.jit` form.
_TRITON_FUNCTIONS: list[str] = []


def _jit(fn: Any) -> Any:
    _TRITON_FUNCTIONS.append(fn.__name__)
    return fn


_TRITON_LOCK = threading.Lock()
_TRITON: Any = None


def _triton() -> Any:
    global _TRITON
    with _TRITON_LOCK:  # the functions are wrapped once, whichever thread launches first
        if _TRITON is None:
            import triton
            import triton.language

            namespace = globals()
            namespace["tl"] = triton.language
            for name in _TRITON_FUNCTIONS:
                namespace[name] = triton.jit(namespace[name])
            _TRITON = triton
    return _TRITON


# Tile geometry: query tile rows start_m + ii, key tile columns start_n + jj; d(ii, jj) = d0 + ii - jj + BLOCK_N - 1
# with d0 = Lk - Lq + start_m - start_n - (BLOCK_N - 1) the tile's smallest distance, so the tile needs the r rows
# d0 .. d0 + BLOCK_M + BLOCK_N - 2 (BLOCK_W >= BLOCK_M + BLOCK_N - 1 of them, a power of two).


@_jit
def _key_range(KL, b, Lq, Lk, start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KL: tl.constexpr):
    """Key tiles a query tile visits: [first, end) in BLOCK_N steps, of which [full0, full1) need no mask; lo is the
    row's first valid key (left padding)."""
    lo = 0
    if HAS_KL:
        lo = tl.maximum(Lk - tl.load(KL + b), 0)
    first = (lo // BLOCK_N) * BLOCK_N
    end = tl.minimum(Lk, Lk - Lq + start_m + BLOCK_M)  # past the last row's causal edge
    full0 = ((lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N  # after the tile holding the padding edge
    full1 = tl.maximum((tl.minimum(Lk - Lq + start_m + 1, Lk) // BLOCK_N) * BLOCK_N, full0)  # first row sees it all
    return lo, first, end, full0, full1


@_jit
def _visible(offs_m, offs_n, Lq, Lk, lo):
    """(BLOCK_M, BLOCK_N) bool: key j visible to query i (causal bottom-right, after the padding, in range)."""
    j = offs_n[None, :]
    return (j <= Lk - Lq + offs_m[:, None]) & (j >= lo) & (j < Lk)


@_jit
def _rel_rows(r_base, srl, d0, Lk, offs_d, BLOCK_W: tl.constexpr):
    """(BLOCK_W, D): r[d0 + t], zero outside 0 <= d < Lk."""
    dist = d0 + tl.arange(0, BLOCK_W)
    ok = (dist[:, None] >= 0) & (dist[:, None] < Lk)
    return tl.load(r_base + dist[:, None].to(tl.int64) * srl + offs_d[None, :], mask=ok, other=0.0)


@_jit
def _on_diagonals(pw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """pw (BLOCK_M, BLOCK_W) by distance -> (BLOCK_M, BLOCK_N) by key: (ii, jj) takes pw[ii, ii - jj + BLOCK_N - 1]."""
    t = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :] + (BLOCK_N - 1)
    return tl.gather(pw, t, 1)


@_jit
def _on_two_halves(p_lo, p_hi, BLOCK: tl.constexpr):
    """Square tiles: the distance range as two (BLOCK, BLOCK) halves, p_lo for t < BLOCK and p_hi for t >= BLOCK ->
    (BLOCK, BLOCK) by key, as `_on_diagonals` of their concatenation (two gathers from half as many columns: the
    same shuffles per element)."""
    t = tl.arange(0, BLOCK)[:, None] - tl.arange(0, BLOCK)[None, :] + (BLOCK - 1)
    low = t < BLOCK
    return tl.where(low, tl.gather(p_lo, tl.where(low, t, 0), 1), tl.gather(p_hi, tl.where(low, 0, t - BLOCK), 1))


@_jit
def _to_distances(ds, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """ds (BLOCK_M, BLOCK_N) by key -> (BLOCK_M, BLOCK_W) by distance: g[ii, t] = ds[ii, ii - t + BLOCK_N - 1]
    (zero where that key is outside the tile); the adjoint of `_on_diagonals`."""
    jj = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_W)[None, :] + (BLOCK_N - 1)
    inside = (jj >= 0) & (jj < BLOCK_N)
    return tl.where(inside, tl.gather(ds, tl.where(inside, jj, 0), 1), 0.0)


@_jit
def _biased(q, U, VB, h, offs_d, HEAD_D: tl.constexpr, HAS_REL: tl.constexpr):
    """q + u (content) and q + v_bias (position), rounded to q's dtype as the reference adds them."""
    qu = q
    qv = q
    if HAS_REL:
        u = tl.load(U + h * HEAD_D + offs_d).to(tl.float32)
        vb = tl.load(VB + h * HEAD_D + offs_d).to(tl.float32)
        qu = (q.to(tl.float32) + u[None, :]).to(q.dtype)
        qv = (q.to(tl.float32) + vb[None, :]).to(q.dtype)
    return qu, qv


@_jit
def _memory_attention_kernel(Q, K, V, R, U, VB, KL, O, LSE,
                             sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, srl, srh,
                             H, Lq, Lk, qk_scale,
                             HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_W: tl.constexpr, HAS_REL: tl.constexpr, HAS_KL: tl.constexpr,
                             PREC: tl.constexpr):
    """Forward: one (query tile, batch * head) per program -> O (B, H, Lq, D), LSE (B, H, Lq) in log2 units."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=offs_m[:, None] < Lq,
                other=0.0)  # (BLOCK_M, D)
    qu, qv = _biased(q, U, VB, h, offs_d, HEAD_D, HAS_REL)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    r_base = R + h * srh
    lo, first, end, full0, full1 = _key_range(KL, b, Lq, Lk, start_m, BLOCK_M, BLOCK_N, HAS_KL)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    if HAS_REL and BLOCK_M == BLOCK_N:
        # square tiles: the next key tile's distances are this one's shifted down by BLOCK_N, so the upper half of
        # its range is this tile's lower half: one (BLOCK_M, BLOCK_N) matmul per tile instead of (BLOCK_M, BLOCK_W)
        r_hi = _rel_rows(r_base, srl, Lk - Lq + start_m - first + 1, Lk, offs_d, BLOCK_N)  # first tile's upper half
        p_hi = tl.dot(qv, tl.trans(r_hi), input_precision=PREC).to(q.dtype)  # (BLOCK_M, BLOCK_N)
    for start_n in range(first, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        s = tl.dot(qu, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N) (q + u) . k
        if HAS_REL:
            d0 = Lk - Lq + start_m - start_n - (BLOCK_N - 1)
            if BLOCK_M == BLOCK_N:
                r_lo = _rel_rows(r_base, srl, d0, Lk, offs_d, BLOCK_N)  # (BLOCK_N, D)
                p_lo = tl.dot(qv, tl.trans(r_lo), input_precision=PREC).to(q.dtype)  # (BLOCK_M, BLOCK_N)
                s += _on_two_halves(p_lo, p_hi, BLOCK_N).to(tl.float32)  # + (q + v) . r[d]
                p_hi = p_lo
            else:
                rw = _rel_rows(r_base, srl, d0, Lk, offs_d, BLOCK_W)
                pw = tl.dot(qv, tl.trans(rw), input_precision=PREC).to(q.dtype)  # (BLOCK_M, BLOCK_W) by distance
                s += _on_diagonals(pw, BLOCK_M, BLOCK_N).to(tl.float32)  # + (q + v) . r[d]
        s = s * qk_scale
        if (start_n < full0) | (start_n >= full1):
            s = tl.where(_visible(offs_m, offs_n, Lq, Lk, lo), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    o_ptrs = O + bh * Lq * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < Lq)
    tl.store(LSE + bh * Lq + offs_m, m_i + tl.log2(l_i), mask=offs_m < Lq)


@_jit
def _memory_attention_bwd_dq_kernel(Q, K, V, R, U, VB, KL, DO, LSE, DELTA, O, DQ, UVP,
                                    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, srl, srh, sdb, sdh, sdm,
                                    H, Lq, Lk, qk_scale, scale,
                                    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_W: tl.constexpr, HAS_REL: tl.constexpr, HAS_KL: tl.constexpr,
                                    PREC: tl.constexpr):
    """Backward over the key tiles of one query tile -> DELTA (B, H, Lq) = rowsum(dO o O) (FlashAttention-2's
    preprocessing, read by the other two kernels after this one), DQ (B, H, Lq, D) in q's dtype, and with rel UVP
    (B * query tiles, 2, H, D): the tile's row sums of dq's content part (-> du) and positional part (-> dv_bias)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    rows = offs_m[:, None] < Lq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=rows, other=0.0)
    out = bh * Lq * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :]
    o = tl.load(O + out, mask=rows, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA + bh * Lq + offs_m, delta, mask=offs_m < Lq)
    lse = tl.load(LSE + bh * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))  # padded rows: p = 0
    qu, qv = _biased(q, U, VB, h, offs_d, HEAD_D, HAS_REL)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    r_base = R + h * srh
    lo, first, end, full0, full1 = _key_range(KL, b, Lq, Lk, start_m, BLOCK_M, BLOCK_N, HAS_KL)
    dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    dqr = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    for start_n in range(first, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        s = tl.dot(qu, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
        if HAS_REL:
            rw = _rel_rows(r_base, srl, Lk - Lq + start_m - start_n - (BLOCK_N - 1), Lk, offs_d, BLOCK_W)
            pw = tl.dot(qv, tl.trans(rw), input_precision=PREC).to(q.dtype)  # (BLOCK_M, BLOCK_W)
            s += _on_diagonals(pw, BLOCK_M, BLOCK_N).to(tl.float32)
        p = tl.exp2(s * qk_scale - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if (start_n < full0) | (start_n >= full1):
            p = tl.where(_visible(offs_m, offs_n, Lq, Lk, lo), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])  # dL/d(score), FlashAttention-2 eq. dS = P o (dP - rowsum(dO o O))
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        if HAS_REL:
            g = _to_distances(ds, BLOCK_M, BLOCK_N, BLOCK_W).to(k.dtype)  # (BLOCK_M, BLOCK_W) dS by distance
            dqr += tl.dot(g, rw, input_precision=PREC)
    tl.store(DQ + out, ((dq + dqr) * scale).to(DQ.dtype.element_ty), mask=rows)
    if HAS_REL:  # rows past Lq hold zeros
        part = UVP + ((b * tl.num_programs(0) + tl.program_id(0)) * 2 * H + h) * HEAD_D + offs_d
        tl.store(part, tl.sum(dq, 0) * scale)
        tl.store(part + H * HEAD_D, tl.sum(dqr, 0) * scale)


@_jit
def _memory_attention_bwd_dkdv_kernel(Q, K, V, R, U, VB, KL, DO, LSE, DELTA, DK, DV,
                                      sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, srl, srh, sdb, sdh, sdm,
                                      H, Lq, Lk, qk_scale, scale,
                                      HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                      BLOCK_W: tl.constexpr, HAS_REL: tl.constexpr, HAS_KL: tl.constexpr,
                                      PREC: tl.constexpr):
    """Backward over the query tiles that see one key tile -> DK, DV (B, H, Lk, D)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    cols = offs_n[:, None] < Lk
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], mask=cols, other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], mask=cols, other=0.0)
    q_base = Q + b * sqb + h * sqh
    do_base = DO + b * sdb + h * sdh
    r_base = R + h * srh
    lo = 0
    if HAS_KL:
        lo = tl.maximum(Lk - tl.load(KL + b), 0)
    # query tiles [first, end): rows from the first that sees the tile's first key; none if the tile is padding.
    # [full0, full1) need no mask: every row sees every key of an in-range tile that starts after the padding.
    first = (tl.maximum(start_n - (Lk - Lq), 0) // BLOCK_M) * BLOCK_M
    end = tl.where(start_n + BLOCK_N > lo, Lq, first)
    interior = (start_n >= lo) & (start_n + BLOCK_N <= Lk)
    full0 = tl.maximum(((tl.maximum(start_n + BLOCK_N - 1 - (Lk - Lq), 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, first)
    full0 = tl.where(interior, full0, first)
    full1 = tl.where(interior, tl.maximum((Lq // BLOCK_M) * BLOCK_M, full0), first)
    dk = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
    for start_m in range(first, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] < Lq
        q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=rows, other=0.0)  # (BLOCK_M, D)
        do = tl.load(do_base + offs_m[:, None] * sdm + offs_d[None, :], mask=rows, other=0.0)
        lse = tl.load(LSE + bh * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))
        delta = tl.load(DELTA + bh * Lq + offs_m, mask=offs_m < Lq, other=0.0)
        qu, qv = _biased(q, U, VB, h, offs_d, HEAD_D, HAS_REL)
        s = tl.dot(qu, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
        if HAS_REL:
            rw = _rel_rows(r_base, srl, Lk - Lq + start_m - start_n - (BLOCK_N - 1), Lk, offs_d, BLOCK_W)
            pw = tl.dot(qv, tl.trans(rw), input_precision=PREC).to(q.dtype)  # (BLOCK_M, BLOCK_W)
            s += _on_diagonals(pw, BLOCK_M, BLOCK_N).to(tl.float32)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if (start_m < full0) | (start_m >= full1):
            p = tl.where(_visible(offs_m, offs_n, Lq, Lk, lo), p, 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(qu.dtype)), qu, input_precision=PREC)
    out = bh * Lk * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=cols)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=cols)


@_jit
def _memory_attention_bwd_dr_kernel(Q, K, V, R, U, VB, KL, DO, LSE, DELTA, DRP,
                                    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, srl, srh, sdb, sdh, sdm,
                                    B, H, Lq, Lk, qk_scale, scale, batch_per_program,
                                    HEAD_D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                                    HAS_KL: tl.constexpr, PREC: tl.constexpr):
    """dr by tile diagonals: square BLOCK x BLOCK tiles with one m - n (query tile m, key tile n) share one distance
    range of BLOCK_W = 2 * BLOCK rows (d0 .. d0 + 2 BLOCK - 2, the last row empty), so one program per (diagonal,
    head, batch group) sums dS by distance times (q + v_bias) over the diagonal's tiles in registers and writes it
    once -> DRP (batch groups, diagonals, BLOCK_W, H, D) fp32; the launcher adds the overlapping halves of
    neighbouring diagonals (no atomics: dr is deterministic)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    grp = tl.program_id(2)
    n_m = tl.cdiv(Lq, BLOCK)
    n_n = tl.cdiv(Lk, BLOCK)
    diag = c - (n_n - 1)  # m - n
    d0 = Lk - Lq + diag * BLOCK - (BLOCK - 1)
    offs_d = tl.arange(0, HEAD_D)
    rw = _rel_rows(R + h * srh, srl, d0, Lk, offs_d, BLOCK_W)  # (BLOCK_W, D), the diagonal's distances
    u = tl.load(U + h * HEAD_D + offs_d).to(tl.float32)
    vb = tl.load(VB + h * HEAD_D + offs_d).to(tl.float32)
    # query tiles m with key tile n = m - diag in range; none if the diagonal lies past the causal edge
    m_lo = tl.maximum(diag, 0)
    m_hi = tl.minimum(n_m, diag + n_n)
    m_hi = tl.where(-diag * BLOCK > Lk - Lq + BLOCK - 1, m_lo, m_hi)
    acc = tl.zeros([BLOCK_W, HEAD_D], tl.float32)
    b_end = tl.minimum(B, (grp + 1) * batch_per_program)
    for b in range(grp * batch_per_program, b_end):
        lo = 0
        if HAS_KL:
            lo = tl.maximum(Lk - tl.load(KL + b), 0)
        b64 = tl.cast(b, tl.int64)
        q_base = Q + b64 * sqb + h * sqh
        do_base = DO + b64 * sdb + h * sdh
        k_base = K + b64 * skb + h * skh
        v_base = V + b64 * svb + h * svh
        row0 = (b64 * H + h) * Lq
        for m in range(tl.maximum(m_lo, diag + lo // BLOCK), m_hi):  # key tiles wholly in the padding skipped
            offs_m = m * BLOCK + tl.arange(0, BLOCK)
            offs_n = (m - diag) * BLOCK + tl.arange(0, BLOCK)
            rows = offs_m[:, None] < Lq
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :], mask=rows, other=0.0)  # (BLOCK, D)
            do = tl.load(do_base + offs_m[:, None] * sdm + offs_d[None, :], mask=rows, other=0.0)
            lse = tl.load(LSE + row0 + offs_m, mask=offs_m < Lq, other=float("inf"))
            delta = tl.load(DELTA + row0 + offs_m, mask=offs_m < Lq, other=0.0)
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
            qu = (q.to(tl.float32) + u[None, :]).to(q.dtype)
            qv = (q.to(tl.float32) + vb[None, :]).to(q.dtype)
            s = tl.dot(qu, tl.trans(k), input_precision=PREC)  # (BLOCK, BLOCK)
            pw = tl.dot(qv, tl.trans(rw), input_precision=PREC).to(q.dtype)  # (BLOCK, BLOCK_W)
            s += _on_diagonals(pw, BLOCK, BLOCK).to(tl.float32)
            p = tl.exp2(s * qk_scale - lse[:, None])
            p = tl.where(_visible(offs_m, offs_n, Lq, Lk, lo), p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            g = _to_distances(ds, BLOCK, BLOCK, BLOCK_W).to(q.dtype)  # (BLOCK, BLOCK_W) dS by distance
            acc += tl.dot(tl.trans(g), qv, input_precision=PREC)  # (BLOCK_W, D)
    offs_w = tl.arange(0, BLOCK_W)
    part = DRP + ((grp * tl.num_programs(0) + c) * BLOCK_W + offs_w[:, None]).to(tl.int64) * (H * HEAD_D)
    tl.store(part + h * HEAD_D + offs_d[None, :], acc * scale)


# -- launchers -------------------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: Rel | None,
           key_lengths: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected (B, H, L, D)")
    if k.shape[2] < q.shape[2]:
        raise ValueError("memory_attention needs Lk >= Lq (the keys end with the queries' own positions)")
    if rel is not None:
        r, u, vb = rel
        H, D = q.shape[1], q.shape[3]
        if r.dim() != 3 or r.shape[0] < k.shape[2] or r.shape[1:] != (H, D) or u.shape != (H, D) or vb.shape != (H, D):
            raise ValueError("rel = (r (Lr >= Lk, H, D), u (H, D), v_bias (H, D))")
    if key_lengths is not None and key_lengths.shape != (q.shape[0],):
        raise ValueError("key_lengths must have shape (B,)")


def _triton_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: Rel | None,
                        key_lengths: torch.Tensor | None) -> str | None:
    """Why the Triton kernel cannot run these inputs, or None."""
    tensors = [q, k, v, *(rel or ())]
    if q.shape[3] not in HEAD_DIMS:
        return f"the Triton memory_attention supports head dims {HEAD_DIMS}, not {q.shape[3]}"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or any(t.dtype != q.dtype for t in tensors):
        return "the Triton memory_attention needs q, k, v (and rel) in one of float32, float16, bfloat16"
    if any(t.device != q.device for t in tensors) or (key_lengths is not None and key_lengths.device != q.device):
        return "the Triton memory_attention needs all tensors on one device"
    if key_lengths is not None and (key_lengths.dtype.is_floating_point or key_lengths.dtype == torch.bool):
        return "key_lengths must be integers"
    return None


def _block_sizes(D: int, Lq: int, is_cuda: bool, rel: bool = False, kernel: str = "fwd"
                 ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for kernel "fwd", "dq", "dkdv" or "dr" (square BLOCK_N tiles).

    On a GPU (picked for Hopper from the compiled SASS: few or no register spills, few shuffles): the positional
    term's distance range is BLOCK_M + BLOCK_N - 1 rows padded to a power of two (128 for 32 x 64 tiles; the
    forward's square tiles compute half of it per tile). Its gathers are warp-local shuffles, about BLOCK_W / 32 per
    element when each warp owns whole rows, so the rel kernels run 8 warps (with 4, a 64 x 64 tile spills registers
    and shuffles twice as much). Without rel the forward takes FlashAttention-2's 128 x 64 tiles with 8 warps once
    there are enough query rows (Lq >= 256) to fill the GPU. The interpreter gets small tiles (its cost is per
    element, and small tiles exercise the tile edges on small test shapes)."""
    if not is_cuda:
        return 16, 16, 4, 1
    if kernel == "dr":
        return (32, 32, 8, 2) if D <= 64 else (16, 16, 4, 2)
    if Lq <= 16:  # decoding: one 16-row tile
        return 16, 64 if D <= 64 else 32, 4, 3 if kernel == "fwd" else 2
    if D > 64:
        if kernel == "fwd":
            return ((128, 64, 8, 2) if Lq >= 256 else (64, 32, 4, 2)) if not rel else (64, 64, 8, 2)
        return (32, 32, 8, 2) if rel else (64, 32, 8, 2)
    if kernel == "fwd":
        if rel:
            return 64, 64, 8, 3
        return (128, 64, 8, 3) if Lq >= 256 else (64, 64, 4, 3)
    return (32, 64, 8, 2) if rel else (64, 64, 8, 2)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _memory_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: Rel | None,
                          key_lengths: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) float32 in log2 units."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    out = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)  # (B, H, Lq, D)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)  # (B, H, Lq)
    if out.numel() == 0:
        return out, lse
    r, u, vb = rel if rel is not None else (q, q, q)  # placeholders: never read without rel
    kl = key_lengths.to(torch.int32).contiguous() if key_lengths is not None else lse
    triton = _triton()
    bm, bn, warps, stages = _block_sizes(D, Lq, q.is_cuda, rel is not None, "fwd")
    _memory_attention_kernel[(triton.cdiv(Lq, bm), B * H)](
        q, k, v, r, u, vb, kl, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), r.stride(0), r.stride(1),
        H, Lq, Lk, scale * math.log2(math.e),
        HEAD_D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=triton.next_power_of_2(bm + bn - 1),
        HAS_REL=rel is not None, HAS_KL=key_lengths is not None,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out, lse


def _dr_from_diagonals(drp: torch.Tensor, Lq: int, Lk: int, Lr: int, T: int) -> torch.Tensor:
    """drp (groups, C, 2T, H, D): diagonal c's sums for distances d0(c) + t, d0(c) = Lk - Lq + (c - nN + 1) T - T + 1
    with nN = cdiv(Lk, T) -> (Lr, H, D) fp32. Row t + T of diagonal c and row t of c + 1 are one distance: add the
    halves, flatten, slice."""
    part = drp.sum(0) if drp.shape[0] > 1 else drp[0]  # (C, 2T, H, D)
    C, _, H, D = part.shape
    edge = part.new_zeros((1, T, H, D))
    by_block = torch.cat([part[:, :T], edge]) + torch.cat([edge, part[:, T:]])  # (C + 1, T, H, D)
    off = (-(-Lk // T) - 1) * T - (Lk - Lq) + T - 1  # flat row of distance 0
    dr = by_block.reshape((C + 1) * T, H, D)[off : off + Lk]  # (Lk, H, D)
    return dr if Lr == Lk else torch.cat([dr, dr.new_zeros((Lr - Lk, H, D))])


_SM_COUNT_GUESS = 132  # H100 / H200 SXM; only sizes the dr kernel's batch split


def _memory_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, rel: Rel | None, key_lengths: torch.Tensor | None,
                          scale: float) -> tuple[torch.Tensor | None, ...]:
    """-> dq, dk, dv, and with rel dr (Lr, H, D), du, dv_bias (H, D); each in its input's dtype."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    do = _last_dim_contiguous(do)
    dq = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)  # (B, H, Lq, D)
    dk = torch.empty((B, H, Lk, D), dtype=k.dtype, device=q.device)  # (B, H, Lk, D)
    dv = torch.empty((B, H, Lk, D), dtype=v.dtype, device=q.device)
    r, u, vb = rel if rel is not None else (q, q, q)
    if dq.numel() == 0:
        dk.zero_()
        dv.zero_()
        if rel is None:
            return dq, dk, dv, None, None, None
        return dq, dk, dv, torch.zeros_like(r), torch.zeros_like(u), torch.zeros_like(vb)
    triton = _triton()
    delta = torch.empty_like(lse)  # (B, H, Lq) rowsum(dO o O), written by the dq kernel
    kl = key_lengths.to(torch.int32).contiguous() if key_lengths is not None else lse
    common = (r, u, vb, kl, do, lse, delta)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), r.stride(0), r.stride(1),
               do.stride(0), do.stride(1), do.stride(2))
    scales = (scale * math.log2(math.e), scale)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    flags = dict(HEAD_D=D, HAS_KL=key_lengths is not None, PREC=prec)

    def meta(kernel: str) -> tuple[int, int, dict[str, Any]]:
        bm, bn, warps, stages = _block_sizes(D, Lq, q.is_cuda, rel is not None, kernel)
        return bm, bn, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=triton.next_power_of_2(bm + bn - 1),
                            HAS_REL=rel is not None, num_warps=warps, num_stages=stages, **flags)

    bm, _, dq_meta = meta("dq")
    n_m = triton.cdiv(Lq, bm)
    uvp = torch.empty((B * n_m, 2, H, D), dtype=torch.float32, device=q.device) if rel is not None else lse
    _memory_attention_bwd_dq_kernel[(n_m, B * H)](q, k, v, *common, out, dq, uvp, *strides, H, Lq, Lk, *scales,
                                                  **dq_meta)
    _, bn, dkdv_meta = meta("dkdv")
    _memory_attention_bwd_dkdv_kernel[(triton.cdiv(Lk, bn), B * H)](q, k, v, *common, dk, dv, *strides, H, Lq, Lk,
                                                                     *scales, **dkdv_meta)
    if rel is None:
        return dq, dk, dv, None, None, None
    _, T, warps, stages = _block_sizes(D, Lq, q.is_cuda, True, "dr")  # square T x T tiles
    C = triton.cdiv(Lq, T) + triton.cdiv(Lk, T) - 1  # tile diagonals
    groups = max(1, min(B, (2 * _SM_COUNT_GUESS) // (C * H)))  # batch groups: enough programs to fill the GPU
    per = triton.cdiv(B, groups)
    groups = triton.cdiv(B, per)
    drp = torch.empty((groups, C, 2 * T, H, D), dtype=torch.float32, device=q.device)
    _memory_attention_bwd_dr_kernel[(C, H, groups)](
        q, k, v, *common, drp, *strides, B, H, Lq, Lk, *scales, per, BLOCK=T, BLOCK_W=2 * T, num_warps=warps,
        num_stages=stages, **flags)
    dr = _dr_from_diagonals(drp, Lq, Lk, r.shape[0], T)
    uv = uvp.sum(0)  # (2, H, D): du, dv_bias
    return dq, dk, dv, dr.to(r.dtype), uv[0].to(u.dtype), uv[1].to(vb.dtype)


class _MemoryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor | None,
                u: torch.Tensor | None, vb: torch.Tensor | None, key_lengths: torch.Tensor | None,
                scale: float) -> torch.Tensor:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        rel = None
        if r is not None and u is not None and vb is not None:
            rel = (_last_dim_contiguous(r), u.contiguous(), vb.contiguous())
        out, lse = _memory_attention_fwd(q, k, v, rel, key_lengths, scale)
        ctx.save_for_backward(q, k, v, out, lse, key_lengths, *(rel or ()))
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, key_lengths, *rel = ctx.saved_tensors
        grads = _memory_attention_bwd(do, q, k, v, out, lse, tuple(rel) if rel else None, key_lengths, ctx.scale)
        return (*grads, None, None)


def memory_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rel: Rel | None = None,
                     scale: float | None = None, key_lengths: torch.Tensor | None = None,
                     impl: str | None = None) -> torch.Tensor:
    """Public op. `impl`: "triton" | "reference" (default: the implementation chosen at start; inputs the kernel
    cannot run, such as another head dim, then take the reference, while impl="triton" refuses them)."""
    _check(q, k, v, rel, key_lengths)
    if resolve_impl(impl, q, k, v) == "triton":
        why = _triton_unsupported(q, k, v, rel, key_lengths)
        if why is None:
            r, u, vb = rel if rel is not None else (None, None, None)
            scale = q.shape[3] ** -0.5 if scale is None else float(scale)
            out: torch.Tensor = _MemoryAttention.apply(q, k, v, r, u, vb, key_lengths, scale)  # type: ignore[no-untyped-call]
            return out
        if impl == "triton":
            raise ValueError(why)
    return memory_attention_ref(q, k, v, rel=rel, scale=scale, key_lengths=key_lengths)
