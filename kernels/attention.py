# mypy: disable-error-code="no-untyped-def"
# (the Triton functions stay untyped: Triton reads their annotations itself)
"""Memory attention: causal attention over [compressed memory; memory; current segment] (Compressive Transformer,
Rae et al. 2020, sec. 3; docs/algorithms.md §7), with optional Transformer-XL relative terms (Dai et al. 2019,
sec. 3.3).

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
BLOCK_M + BLOCK_N - 1 values, so (q + v_bias) R_range^T is one small matmul, rounded to the inputs' dtype as the
reference's matmul rounds it, and entry (i, j) picks its column d(i, j) along the tile's diagonals by one gather over
the flattened tile, through shared memory; no (Lq, Lk) bias exists in memory. The backward recomputes the
probabilities from the log-sum-exp: one kernel per key tile for dk, dv; one per query tile for dq, whose
positional part scatters dS back into the distance range, giving dq's r-term and dr (fp32 atomics) from the same
tile. du and dv_bias are the sums over batch and queries of dq's content and positional parts.

`Tuning` (ADAPTLM_ATTENTION_TUNING) changes how the kernels run, never what they compute; its one setting is the
forward's key splits for query tiles too few to fill the GPU (decoding; FlashDecoding: each split's partial softmax
sums, merged by a combine kernel). No other setting is kept: measured compiled on an H200, the alternatives (other
tiles, dr by tile diagonals, fp32 gathers, the skew by warp shuffles) were slower than this kernel and half distance
ranges computed wrong results (docs/notes/2026-11-benchmarks-history.md,
"memory_attention on the H200: the settings settled").

Known limits:
- head dims 16, 32, 64, 128; float32, float16, bfloat16 on CUDA (the CPU interpreter: float32 and float16 only,
  it mis-handles bfloat16 dots); q, k, v, r, u, v_bias share one dtype and device. float32 runs full-precision
  (IEEE) dots, not TF32.
- dr is summed with fp32 atomics: its last bits vary run to run (the other gradients are deterministic).
- a row with no visible key (key_lengths[b] < Lq, against the contract) gives NaN, as the reference does with rel
  (without rel the reference is SDPA's, which gives zeros).
- block sizes are fixed per head dim (no autotuning); decoding (Lq = 1) runs one 16-row tile per (batch, head), and
  by default one program over all its keys (`Tuning.splits` splits them, FlashDecoding).
- Triton is imported at the first launch, and TRITON_INTERPRET is read then: one process runs the kernels either
  interpreted or compiled, not both.
- the reference builds the (Lq, Lk) score matrix (the Triton kernel does not).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from kernels._dispatch import cdiv, next_pow2, resolve_impl

if TYPE_CHECKING:
    import triton.language as tl

__all__ = ["Tuning", "memory_attention", "memory_attention_ref", "tuning"]

Rel = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
HEAD_DIMS = (16, 32, 64, 128)


@dataclass(frozen=True)
class Tuning:
    """How the Triton kernels run, never what they compute (the interpreter tests check each setting against the
    reference): the one kernel of the module docstring, its forward's keys split or not. The other settings (tiles,
    16-bit gathers, half distance ranges, dr by tile diagonals, the skew) were experiments for one GPU question,
    settled compiled on an H200: their winner is the only kernel now, the rest were wrong or slower
    (docs/notes/2026-11-benchmarks-history.md, "memory_attention on the H200: the settings settled").

    splits: the forward's key splits per query tile (FlashDecoding: each split's partial softmax sums, then one
        merge): 1 none, n that many, 0 by the GPU's SM count when the query tiles alone leave SMs idle (decoding
        sessions: one query row each, B * H programs)."""

    splits: int = 1

    def __post_init__(self) -> None:
        if self.splits < 0:
            raise ValueError(f"attention tuning: splits must be >= 0: {self}")

    @classmethod
    def parse(cls, text: str) -> Tuning:
        """"" or "shipped": the default; comma-separated key=count over it, "shipped" optionally first, e.g.
        "splits=0"."""
        items = [t.strip() for t in text.split(",") if t.strip()]
        if items and items[0] == "shipped":
            items.pop(0)
        keys = [f.name for f in fields(cls)]
        settings: dict[str, int] = {}
        for item in items:
            key, _, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if key not in keys or not value:
                raise ValueError(f"attention tuning: {item!r} is not a setting (the settings: "
                                 f"{', '.join(f'{k}=<count>' for k in keys)}, after an optional \"shipped\", the "
                                 "default)")
            if not value.isdigit():
                raise ValueError(f"attention tuning: {key} takes a count, not {value!r}")
            settings[key] = int(value)
        return cls(**settings)


TUNING: Tuning | None = None  # None: ADAPTLM_ATTENTION_TUNING, read at the first launch; tests and benches set it


def tuning() -> Tuning:
    """The settings the next launch uses."""
    global TUNING
    if TUNING is None:
        TUNING = Tuning.parse(os.environ.get("ADAPTLM_ATTENTION_TUNING", ""))
    return TUNING


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
    """Pure-PyTorch reference (plain autograd). Layout in the module docstring. Without rel it is PyTorch's fused
    scaled_dot_product_attention under the boolean mask (on a CPU about 2x the explicit score matrix at 128+ queries,
    the char transformer's scoring and training)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    allowed = _allowed(Lq, Lk, key_lengths, q.device).unsqueeze(1)  # (B or 1, 1, Lq, Lk)
    if rel is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    r, u, vb = rel
    scores = (q + u.view(1, H, 1, D)) @ k.transpose(-1, -2)  # (B, H, Lq, Lk) content terms (a) + (c)
    if Lq == 1:  # decoding: key j is at distance Lk - 1 - j, so the distances reversed are the keys' order
        scores = scores + (q + vb.view(1, H, 1, D)) @ r[:Lk].flip(0).permute(1, 2, 0)  # (B, H, 1, Lk)
    else:
        pos = (q + vb.view(1, H, 1, D)) @ r[:Lk].permute(1, 2, 0)  # (B, H, Lq, Lk) (b) + (d), by distance d
        i = torch.arange(Lq, device=q.device).view(Lq, 1)
        j = torch.arange(Lk, device=q.device).view(1, Lk)
        dist = (Lk - Lq + i - j).clamp(min=0)  # (Lq, Lk) distance of key j from query i
        scores = scores + pos.gather(-1, dist.expand(B, H, Lq, Lk))  # pick column d for entry (i, j)
    scores = (scores * scale).masked_fill(~allowed, -math.inf)
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
    if _TRITON is not None:
        return _TRITON
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
def _skewed(src, idx):
    """tl.gather(src, idx, 1): out[ii, jj] = src[ii, idx[ii, jj]] for 2-D src, idx with as many rows, as one gather
    over the flattened tile, which Triton lowers through shared memory (the tile stored once, each output loaded from
    where it points): a gather along rows is warp shuffles with the register layout converted around them, slower
    on an H200 (docs/notes/2026-11-benchmarks-history.md, "memory_attention on the H200: the settings settled")."""
    ROWS: tl.constexpr = src.shape[0]
    WIDTH: tl.constexpr = src.shape[1]
    COLS: tl.constexpr = idx.shape[1]
    flat = tl.arange(0, ROWS)[:, None] * WIDTH + idx
    out = tl.gather(tl.reshape(src, [ROWS * WIDTH]), tl.reshape(flat, [ROWS * COLS]), 0)
    return tl.reshape(out, [ROWS, COLS])


@_jit
def _on_diagonals(pw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """pw (BLOCK_M, BLOCK_W) by distance -> (BLOCK_M, BLOCK_N) by key: (ii, jj) takes pw[ii, ii - jj + BLOCK_N - 1]."""
    t = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_N)[None, :] + (BLOCK_N - 1)
    return _skewed(pw, t)


@_jit
def _positional(qv, rw, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32: (q_i + v_bias) . r[d(i, j)], Transformer-XL terms (b) + (d), from the tile's distance
    rows rw (BLOCK_W, D). The scores by distance are rounded to q's dtype before the gather, as the reference's
    matmul rounds them (half the bytes moved; nothing for fp32)."""
    pw = tl.dot(qv, tl.trans(rw), input_precision=PREC).to(qv.dtype)  # (BLOCK_M, BLOCK_W)
    return _on_diagonals(pw, BLOCK_M, BLOCK_N).to(tl.float32)


@_jit
def _to_distances(ds, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """ds (BLOCK_M, BLOCK_N) by key -> (BLOCK_M, BLOCK_W) by distance: g[ii, t] = ds[ii, ii - t + BLOCK_N - 1]
    (zero where that key is outside the tile); the adjoint of `_on_diagonals`."""
    jj = tl.arange(0, BLOCK_M)[:, None] - tl.arange(0, BLOCK_W)[None, :] + (BLOCK_N - 1)
    inside = (jj >= 0) & (jj < BLOCK_N)
    return tl.where(inside, _skewed(ds, tl.where(inside, jj, 0)), 0.0)


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
def _memory_attention_kernel(Q, K, V, R, U, VB, KL, O, LSE, L,
                             sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, srl, srh,
                             H, Lq, Lk, qk_scale, keys_per_split,
                             HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_W: tl.constexpr, HAS_REL: tl.constexpr, HAS_KL: tl.constexpr,
                             PREC: tl.constexpr, SPLIT: tl.constexpr):
    """Forward: one (query tile, batch * head) per program -> O (B, H, Lq, D), LSE (B, H, Lq) in log2 units.
    SPLIT (FlashDecoding): program (tile, bh, s) sees only keys [s, s + 1) * keys_per_split (a multiple of BLOCK_N)
    and writes its unnormalised partial sums: O (S, B * H * Lq, D) the accumulator, LSE its running max, L its
    denominator (fp32); `_memory_attention_combine_kernel` merges the splits."""
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
    if SPLIT:
        first = tl.maximum(first, tl.program_id(2) * keys_per_split)
        end = tl.minimum(end, (tl.program_id(2) + 1) * keys_per_split)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    for start_n in range(first, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=offs_n[:, None] < Lk, other=0.0)
        s = tl.dot(qu, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N) (q + u) . k
        if HAS_REL:
            d0 = Lk - Lq + start_m - start_n - (BLOCK_N - 1)
            rw = _rel_rows(r_base, srl, d0, Lk, offs_d, BLOCK_W)  # (BLOCK_W, D)
            s += _positional(qv, rw, PREC, BLOCK_M, BLOCK_N)  # + (q + v) . r[d]
        s = s * qk_scale
        if (start_n < full0) | (start_n >= full1):
            s = tl.where(_visible(offs_m, offs_n, Lq, Lk, lo), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if SPLIT:  # a split can start on a tile a row cannot see at all: it adds nothing (no NaN from -inf - -inf)
            m_new = tl.where(m_new == float("-inf"), -1e30, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    if SPLIT:  # this split's partial sums, at rows s * (B * H * Lq) + bh * Lq + i
        row = (tl.program_id(2) * tl.num_programs(1) + bh) * Lq + offs_m
        tl.store(O + row[:, None] * HEAD_D + offs_d[None, :], acc, mask=offs_m[:, None] < Lq)
        tl.store(LSE + row, m_i, mask=offs_m < Lq)
        tl.store(L + row, l_i, mask=offs_m < Lq)
    else:
        acc = acc / l_i[:, None]
        o_ptrs = O + bh * Lq * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < Lq)
        tl.store(LSE + bh * Lq + offs_m, m_i + tl.log2(l_i), mask=offs_m < Lq)


@_jit
def _memory_attention_combine_kernel(OP, MP, LP, O, LSE, rows, n_split, HEAD_D: tl.constexpr, BLOCK: tl.constexpr):
    """The key splits' partial sums (OP (S, rows, D), MP and LP (S, rows), fp32) -> O (rows, D), LSE (rows): each
    split rescaled to the common max, as the online softmax does tile by tile (FlashDecoding)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < rows
    offs_d = tl.arange(0, HEAD_D)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(n_split):
        m = tl.maximum(m, tl.load(MP + tl.cast(s, tl.int64) * rows + r, mask=ok, other=0.0))  # past the end: 0
    den = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_D], tl.float32)
    for s in range(n_split):
        part = tl.cast(s, tl.int64) * rows + r  # (BLOCK,) rows of split s, int64 (S * rows may pass 2**31)
        w = tl.exp2(tl.load(MP + part, mask=ok, other=0.0) - m)  # 0 for a split with no visible key
        den += w * tl.load(LP + part, mask=ok, other=1.0)
        acc += w[:, None] * tl.load(OP + part[:, None] * HEAD_D + offs_d[None, :], mask=ok[:, None], other=0.0)
    out = r.to(tl.int64)[:, None] * HEAD_D + offs_d[None, :]
    tl.store(O + out, (acc / den[:, None]).to(O.dtype.element_ty), mask=ok[:, None])
    tl.store(LSE + r, m + tl.log2(den), mask=ok)


@_jit
def _memory_attention_bwd_dq_kernel(Q, K, V, R, U, VB, KL, DO, LSE, DELTA, DQ, DQR, DR,
                                    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, srl, srh, sdb, sdh, sdm,
                                    H, Lq, Lk, qk_scale, scale,
                                    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    BLOCK_W: tl.constexpr, HAS_REL: tl.constexpr, HAS_KL: tl.constexpr,
                                    PREC: tl.constexpr):
    """Backward over the key tiles of one query tile -> DQ (content part), DQR (positional part), and dr by fp32
    atomics into DR (Lr, H, D)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    rows = offs_m[:, None] < Lq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=rows, other=0.0)
    lse = tl.load(LSE + bh * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))  # padded rows: p = 0
    delta = tl.load(DELTA + bh * Lq + offs_m, mask=offs_m < Lq, other=0.0)
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
        d0 = Lk - Lq + start_m - start_n - (BLOCK_N - 1)
        s = tl.dot(qu, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
        if HAS_REL:
            rw = _rel_rows(r_base, srl, d0, Lk, offs_d, BLOCK_W)  # (BLOCK_W, D)
            s += _positional(qv, rw, PREC, BLOCK_M, BLOCK_N)
        p = tl.exp2(s * qk_scale - lse[:, None])  # (BLOCK_M, BLOCK_N)
        if (start_n < full0) | (start_n >= full1):
            p = tl.where(_visible(offs_m, offs_n, Lq, Lk, lo), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])  # dL/d(score), FlashAttention-2 eq. dS = P o (dP - rowsum(dO o O))
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        if HAS_REL:
            g = _to_distances(ds, BLOCK_M, BLOCK_N, BLOCK_W).to(k.dtype)  # (BLOCK_M, BLOCK_W) dS by distance
            dqr += tl.dot(g, rw, input_precision=PREC)
            dr = tl.dot(tl.trans(g), qv, input_precision=PREC) * scale  # (BLOCK_W, D) sum_i dS(i, d) (q_i + v)
            dist = d0 + tl.arange(0, BLOCK_W)
            tl.atomic_add(DR + dist[:, None].to(tl.int64) * (H * HEAD_D) + h * HEAD_D + offs_d[None, :], dr,
                          mask=(dist[:, None] >= 0) & (dist[:, None] < Lk))
    out = bh * Lq * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :]
    tl.store(DQ + out, dq * scale, mask=rows)
    if HAS_REL:
        tl.store(DQR + out, dqr * scale, mask=rows)


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
            s += _positional(qv, rw, PREC, BLOCK_M, BLOCK_N)
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


def _block_sizes(D: int, Lq: int, is_cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward and both backward kernels: 64 x 64 tiles (16-row
    tiles decoding, 64 x 32 at head dim 128), 4 warps at head dims <= 64, else 8 (checked on a GPU; the other
    tiles measured on an H200 were slower). The interpreter gets small tiles (its cost is per element,
    and small tiles exercise the tile edges on small test shapes). `python -m bench.kernel_resources` prints each
    kernel's registers and spills at these tiles without a GPU."""
    if not is_cuda:
        return 16, 16, 4, 1
    block_m = 16 if Lq <= 16 else 64
    block_n = 64 if D <= 64 else 32
    return block_m, block_n, 4 if D <= 64 else 8, 2


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
    _triton()
    tune = tuning()
    bm, bn, warps, stages = _block_sizes(D, Lq, q.is_cuda)
    tiles = cdiv(Lq, bm)
    splits = _key_splits(tune.splits, tiles * B * H, Lk, bn, _sms(q.device))
    per = cdiv(cdiv(Lk, splits), bn) * bn  # keys a split sees, whole key tiles
    splits = cdiv(Lk, per)
    if splits > 1:  # partial sums per split (S, B * H * Lq, D), their running maxima and denominators (S, B * H * Lq)
        o_part = torch.empty((splits, B * H * Lq, D), dtype=torch.float32, device=q.device)
        m_part = torch.empty((splits, B * H * Lq), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:
        o_part, m_part, l_part = out, lse, lse
    _memory_attention_kernel[(tiles, B * H, splits)](
        q, k, v, r, u, vb, kl, o_part, m_part, l_part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), r.stride(0), r.stride(1),
        H, Lq, Lk, scale * math.log2(math.e), per,
        HEAD_D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=next_pow2(bm + bn - 1),
        HAS_REL=rel is not None, HAS_KL=key_lengths is not None,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=splits > 1, num_warps=warps, num_stages=stages)
    if splits > 1:
        rows, block = B * H * Lq, 16 if q.is_cuda else 8
        _memory_attention_combine_kernel[(cdiv(rows, block),)](
            o_part, m_part, l_part, out, lse, rows, splits, HEAD_D=D, BLOCK=block, num_warps=4 if D <= 64 else 8)
    return out, lse


def _sms(device: torch.device) -> int:
    """The device's streaming multiprocessors; 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _key_splits(setting: int, programs: int, Lk: int, block_n: int, sms: int) -> int:
    """How many key ranges the forward splits each query tile's keys into. setting 1: none (one program per tile);
    n > 1: n; 0: enough for two programs per SM (`sms`, 0 off CUDA: none) when the tiles alone leave SMs idle
    (decoding: one query row per session), with at least two key tiles a split. Never more splits than key tiles."""
    if setting == 0:
        setting = min(max(1, (2 * sms) // programs), max(1, Lk // (2 * block_n)))
    return max(1, min(setting, -(-Lk // block_n)))


def _memory_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, rel: Rel | None, key_lengths: torch.Tensor | None,
                          scale: float) -> tuple[torch.Tensor | None, ...]:
    """-> dq, dk, dv, and with rel dr (Lr, H, D), du, dv_bias (H, D); each in its input's dtype."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    do = _last_dim_contiguous(do)
    dq = torch.zeros((B, H, Lq, D), dtype=torch.float32, device=q.device)  # (B, H, Lq, D) content part
    dqr = torch.zeros_like(dq) if rel is not None else dq  # (B, H, Lq, D) positional part
    dk = torch.zeros((B, H, Lk, D), dtype=k.dtype, device=q.device)  # (B, H, Lk, D)
    dv = torch.zeros((B, H, Lk, D), dtype=v.dtype, device=q.device)
    r, u, vb = rel if rel is not None else (q, q, q)
    # (Lr, H, D): the dq kernel's atomics sum into it
    dr = torch.zeros((r.shape[0], H, D), dtype=torch.float32, device=q.device) if rel is not None else dq
    if dq.numel() != 0:
        delta = (do.float() * out.float()).sum(-1)  # (B, H, Lq) rowsum(dO o O), FlashAttention-2 preprocessing
        kl = key_lengths.to(torch.int32).contiguous() if key_lengths is not None else lse
        _triton()
        common = (r, u, vb, kl, do, lse, delta)
        strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), r.stride(0), r.stride(1),
                   do.stride(0), do.stride(1), do.stride(2))
        scales = (scale * math.log2(math.e), scale)
        bm, bn, warps, stages = _block_sizes(D, Lq, q.is_cuda)
        meta = dict(HEAD_D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=next_pow2(bm + bn - 1), HAS_REL=rel is not None,
                    HAS_KL=key_lengths is not None, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                    num_warps=warps, num_stages=stages)
        _memory_attention_bwd_dq_kernel[(cdiv(Lq, bm), B * H)](
            q, k, v, *common, dq, dqr, dr, *strides, H, Lq, Lk, *scales, **meta)
        _memory_attention_bwd_dkdv_kernel[(cdiv(Lk, bn), B * H)](
            q, k, v, *common, dk, dv, *strides, H, Lq, Lk, *scales, **meta)
    if rel is None:
        return dq.to(q.dtype), dk, dv, None, None, None
    du = dq.sum((0, 2)).to(u.dtype)  # (H, D): d score / d u = d score / d q through the content term
    dvb = dqr.sum((0, 2)).to(vb.dtype)  # (H, D): likewise through the positional term
    return (dq + dqr).to(q.dtype), dk, dv, dr.to(r.dtype), du, dvb


class _MemoryAttention(torch.autograd.Function):
    @staticmethod
    def inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor | None, u: torch.Tensor | None,
               vb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Rel | None]:
        """The layouts the kernels read: unit stride along D."""
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        rel = None
        if r is not None and u is not None and vb is not None:
            rel = (_last_dim_contiguous(r), u.contiguous(), vb.contiguous())
        return q, k, v, rel

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor | None,
                u: torch.Tensor | None, vb: torch.Tensor | None, key_lengths: torch.Tensor | None,
                scale: float) -> torch.Tensor:
        q, k, v, rel = _MemoryAttention.inputs(q, k, v, r, u, vb)
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
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *(rel or ()))):
                out: torch.Tensor = _MemoryAttention.apply(q, k, v, r, u, vb, key_lengths, scale)  # type: ignore[no-untyped-call]
                return out
            q, k, v, rel = _MemoryAttention.inputs(q, k, v, r, u, vb)
            return _memory_attention_fwd(q, k, v, rel, key_lengths, scale)[0]  # no autograd node (serving)
        if impl == "triton":
            raise ValueError(why)
    return memory_attention_ref(q, k, v, rel=rel, scale=scale, key_lengths=key_lengths)
