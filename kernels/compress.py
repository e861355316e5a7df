"""Compressive-memory compression and the FIFO memory update (Compressive Transformer, Rae et al. 2020, sec. 3.1;
docs/algorithms.md §7).

`compress_memory`: mem (B, N, D), N a multiple of `rate` c -> compressed (B, N / c, D).
mode "mean" / "max": pool each run of c slots; "conv": 1-D convolution, kernel = stride = c, weight (D, D, c) in
nn.Conv1d layout, bias (D,) optional.

The FIFO update of one layer (paper fig. 1): a segment of n_s activations is appended to the memory, which keeps
exactly the last n_m inputs; the evicted oldest slots are compressed by c and appended to the compressed memory,
which keeps its last n_cm slots. `memory_update_ref` is that update with torch.cat semantics (plain autograd: the
model's path when it needs gradients). `MemoryRing` is the serving form: preallocated ring buffers, one token
counter per batch row (sessions fill at their own pace), `update` writes and compresses in place with no
reallocation per step (mean/max: one fused Triton kernel; conv: a GEMM kernel reads the evicted runs straight from
the ring and the segment and writes the compressed slots, then the write kernel: two launches), `view` returns
[cmem ; mem] in time order, left-padded, with per-row lengths (attention's `key_lengths`).

`fixed_memory_update`: the Compressive Transformer model's own update (models/compressive.py), on fixed-shape,
right-aligned (newest last, zeros first) state, compression done by the model's f beforehand: mem (B, L, D), the
piece's inputs x (B, m, D) with m <= L, done (B,) bool (rows whose segment completes: their memory is cut to the
newest `mem_len`), cmem (B, K, D), comp (B, n, D) the compressed evicted window of which the last n_new[b] slots are
real (n_new (B,) int; 0: cmem unchanged) ->
    new mem[b] = ([mem[b] ; x[b]])[m:], its first L - mem_len slots zeroed where done[b]      (B, L, D)
    new cmem[b] = ([cmem[b] ; comp[b] with its first n - n_new[b] slots zeroed])[-K:]  where n_new[b] > 0   (B, K, D)
Both new tensors come from one Triton launch (eager: ~8 launches of cat / slice / where per layer); no gradient on
the Triton path (the model's memories are stop-gradient), the reference is plain autograd.

Known limits:
- Standalone `compress_memory` conv runs as a matmul (cuBLAS on a GPU) on the Triton path; the ring's conv is a
  Triton GEMM (tl.dot, fp32 accumulation; weight cast to the ring's dtype tile by tile).
- Standalone mean / max are memory-bound single passes: a few microseconds, so launch overhead weighs as much
  as the kernel; eager PyTorch is one launch too (the H200 run had eager at 17 us for 17 MB).
- The ring is state, not a graph: `MemoryRing.update` runs under no_grad (the paper stops gradients at the memory).
  Use `memory_update_ref` where gradients must reach the segment or the conv weights.
- With per-row lengths that are not multiples of c, up to c - 1 evicted slots wait in the ring for their run to
  complete: they are no longer in the memory's view and not yet in the compressed memory's.
- `memory_update_ref` takes one length for the whole batch and needs the evicted count to be a multiple of c.
- Index arithmetic is int64 per row; per-tensor offsets assume tensors under 2^31 elements per batch row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels._dispatch import cdiv, resolve_impl, tl, triton_kernel

__all__ = ["COMPRESS_MODES", "MemoryRing", "compress_memory", "compress_memory_ref", "fixed_memory_update",
           "fixed_memory_update_ref", "memory_update_ref"]

COMPRESS_MODES = ("conv", "mean", "max")
_MODE_IDS = {"mean": 0, "max": 1, "conv": 2}  # 2: the update kernel only writes (`_ring_conv_kernel` compresses)


def compress_memory_ref(mem: torch.Tensor, *, rate: int, mode: str, weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-PyTorch reference. Layout in the module docstring."""
    B, N, D = mem.shape
    if mode == "conv":
        assert weight is not None
        return F.conv1d(mem.transpose(1, 2), weight, bias, stride=rate).transpose(1, 2)  # (B, N/c, D)
    runs = mem.view(B, N // rate, rate, D)  # (B, N/c, c, D)
    return runs.mean(2) if mode == "mean" else runs.amax(2)  # (B, N/c, D)


def memory_update_ref(mem: torch.Tensor, cmem: torch.Tensor, segment: torch.Tensor, *, mem_len: int,
                      cmem_len: int, rate: int, mode: str, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One FIFO step with torch.cat semantics (plain autograd). mem (B, m, D) with m <= mem_len, cmem (B, k, D)
    with k <= cmem_len, segment (B, n_s, D) -> new mem (B, min(m + n_s, mem_len), D), new cmem (B, <= cmem_len, D).
    The evicted count max(0, m + n_s - mem_len) must be a multiple of `rate`."""
    x = torch.cat([mem, segment], dim=1)  # (B, m + n_s, D)
    n_evict = max(0, x.shape[1] - mem_len)
    if n_evict % rate:
        raise ValueError(f"{n_evict} evicted slots are not a multiple of rate {rate}")
    if n_evict == 0:
        return x, cmem
    squeezed = compress_memory_ref(x[:, :n_evict], rate=rate, mode=mode, weight=weight, bias=bias)  # (B, n/c, D)
    c = torch.cat([cmem, squeezed], dim=1)  # (B, k + n/c, D)
    return x[:, n_evict:], c[:, max(0, c.shape[1] - cmem_len):]


def fixed_memory_update_ref(mem: torch.Tensor, x: torch.Tensor, done: torch.Tensor, cmem: torch.Tensor,
                            comp: torch.Tensor | None, n_new: torch.Tensor, *, mem_len: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference. Layout in the module docstring (`fixed_memory_update`)."""
    B, L, D = mem.shape
    m = x.shape[1]
    ext = torch.cat([mem, x], 1)[:, m:]  # (B, L, D)
    keep = (torch.arange(L, device=mem.device) >= L - mem_len) | ~done.view(B, 1)  # (B, L)
    new_mem = torch.where(keep.unsqueeze(-1), ext, torch.zeros((), dtype=ext.dtype, device=ext.device))
    if comp is None:
        return new_mem, cmem
    K, n = cmem.shape[1], comp.shape[1]
    ok = torch.arange(n, device=comp.device) >= n - n_new.view(B, 1)  # (B, n) the real compressed slots
    comp = torch.where(ok.unsqueeze(-1), comp, torch.zeros((), dtype=comp.dtype, device=comp.device))
    grown = torch.cat([cmem, comp.to(cmem.dtype)], 1)[:, -K:]  # (B, K, D) oldest drop
    return new_mem, torch.where((n_new > 0).view(B, 1, 1), grown, cmem)


@triton_kernel
def _fixed_update_kernel(mem_ptr, x_ptr, done_ptr, cmem_ptr, comp_ptr, nnew_ptr, nmem_ptr, ncmem_ptr,
                         L, m, mem_len, K, n, D, mem_blocks,
                         s_mb, s_mn, s_xb, s_xn, s_cb, s_cn, s_pb, s_pn, s_ob, s_on, s_qb, s_qn,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_COMP: tl.constexpr):
    # program (b, block of output slots, d block): blocks [0, mem_blocks) are new-mem slots, the rest new-cmem
    # slots; each output slot reads one source slot (or writes zeros), so one launch writes both tensors
    b = tl.program_id(0)
    blk = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    if blk < mem_blocks:
        j = blk * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) new mem slots
        jmask = j < L
        cut = tl.where(tl.load(done_ptr + b).to(tl.int32) != 0, L - mem_len, 0)  # slots zeroed in front
        live = jmask & (j >= cut)
        src = j + m  # slot of [mem ; x]
        in_mem = src < L
        a = tl.load(mem_ptr + b * s_mb + src[:, None] * s_mn + offs_d[None, :],
                    mask=(live & in_mem)[:, None] & dmask[None, :], other=0.0)
        c = tl.load(x_ptr + b * s_xb + (src - L)[:, None] * s_xn + offs_d[None, :],
                    mask=(live & ~in_mem)[:, None] & dmask[None, :], other=0.0)
        y = tl.where(in_mem[:, None], a, c.to(a.dtype))
        tl.store(nmem_ptr + b * s_ob + j[:, None] * s_on + offs_d[None, :], y, mask=jmask[:, None] & dmask[None, :])
    else:
        j = (blk - mem_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) new cmem slots
        jmask = j < K
        n_new = 0
        if HAS_COMP:
            n_new = tl.load(nnew_ptr + b)
        shift = tl.where(n_new > 0, n, 0)  # cmem moves by the whole window when the row compressed
        src = j + shift  # (BLOCK_S,) slot of [cmem ; comp]
        q = src - K  # slot of comp when >= 0
        in_c = src < K
        a = tl.load(cmem_ptr + b * s_cb + src[:, None] * s_cn + offs_d[None, :],
                    mask=(jmask & in_c)[:, None] & dmask[None, :], other=0.0)
        y = a
        if HAS_COMP:
            real = jmask & ~in_c & (q >= n - n_new)
            c = tl.load(comp_ptr + b * s_pb + q[:, None] * s_pn + offs_d[None, :], mask=real[:, None] & dmask[None, :],
                        other=0.0)
            y = tl.where(in_c[:, None], a, c.to(a.dtype))
        tl.store(ncmem_ptr + b * s_qb + j[:, None] * s_qn + offs_d[None, :], y, mask=jmask[:, None] & dmask[None, :])


@triton_kernel
def _compress_kernel(x_ptr, out_ptr, n_out, D, s_xb, s_xn, s_xd, s_ob, s_on, s_od,
                     RATE: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr):
    # program (b, block of BLOCK_J output slots, d block): BLOCK_J runs of RATE slots -> BLOCK_J output slots, the
    # RATE slots of the runs read as RATE (BLOCK_J, BLOCK_D) tiles (a few KB per program, not one run)
    b = tl.program_id(0)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (offs_j < n_out)[:, None] & (offs_d < D)[None, :]
    base = x_ptr + b * s_xb + (offs_j * RATE)[:, None] * s_xn + offs_d[None, :] * s_xd
    if MODE == 0:
        acc = tl.zeros((BLOCK_J, BLOCK_D), dtype=tl.float32)
        for t in tl.static_range(RATE):
            acc += tl.load(base + t * s_xn, mask=mask, other=0.0).to(tl.float32)
        y = acc / RATE
    else:
        y = tl.load(base, mask=mask, other=0.0)
        for t in tl.static_range(1, RATE):
            y = tl.maximum(y, tl.load(base + t * s_xn, mask=mask, other=0.0))
    tl.store(out_ptr + b * s_ob + offs_j[:, None] * s_on + offs_d[None, :] * s_od, y.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton_kernel
def _memory_update_kernel(buf_ptr, seg_ptr, count_ptr, len_ptr, mem_len, cmem_len, ring_runs, D,
                          s_bb, s_br, s_sb, s_sn,
                          RATE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr):
    # Row b's buffer: rows [0, cmem_len) the compressed ring, [cmem_len, cmem_len + R) the memory ring, R =
    # ring_runs * RATE. Token p (p-th input ever) lives in memory slot p % R; run G (tokens G*c .. G*c + c - 1)
    # is compressed into slot G % cmem_len. Program (b, g, d block) owns memory slots [g*c, g*c + c): it first
    # compresses the runs that sit there and are evicted by this update, then writes the slots' new tokens, so
    # no slot is written before it is read and no two programs touch the same address (no grid-wide sync).
    # MODE 2 (conv) only writes: `_ring_conv_kernel` compressed the evicted runs in the launch before.
    b = tl.program_id(0)
    g = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = offs_c < RATE
    dmask = offs_d < D
    mask = cmask[:, None] & dmask[None, :]
    t_old = tl.load(count_ptr + b)  # int64: inputs appended before this update
    t_new = t_old + tl.load(len_ptr + b)
    z_old = tl.maximum(t_old - mem_len, 0) // RATE  # runs compressed before
    z_new = tl.maximum(t_new - mem_len, 0) // RATE  # runs compressed after
    g_lo = tl.maximum(z_old, z_new - cmem_len)  # older new runs would drop out of cmem at once: skipped
    ring = ring_runs * RATE
    slot = g * RATE + offs_c  # (BLOCK_C,) memory slots of this program
    row = buf_ptr + b * s_bb
    first = g_lo + ((g - g_lo % ring_runs) % ring_runs + ring_runs) % ring_runs  # first run >= g_lo in block g
    if MODE != 2:
        for G in range(first, z_new, ring_runs):
            pos = G * RATE + offs_c  # (BLOCK_C,) its tokens
            old = pos < t_old  # in the ring (all of [z_old * c, t_old) is: t_old - z_old * c < R), else the segment
            x_ring = tl.load(row + (cmem_len + slot)[:, None] * s_br + offs_d[None, :], mask=mask & old[:, None],
                             other=0.0)
            x_seg = tl.load(seg_ptr + b * s_sb + (pos - t_old)[:, None] * s_sn + offs_d[None, :],
                            mask=mask & (~old)[:, None], other=0.0)
            x = tl.where(old[:, None], x_ring, x_seg)  # (BLOCK_C, BLOCK_D)
            if MODE == 0:
                y = tl.sum(x.to(tl.float32), axis=0) / RATE
            else:
                y = tl.max(tl.where(cmask[:, None], x, float("-inf")), axis=0)
            tl.store(row + (G % cmem_len) * s_br + offs_d, y.to(buf_ptr.dtype.element_ty), mask=dmask)
    tl.debug_barrier()  # this program's reads of its slots land before its writes
    p = t_new - 1 - ((t_new - 1 - slot) % ring + ring) % ring  # latest token < t_new in each slot
    new = cmask & (p >= t_old)
    wmask = new[:, None] & dmask[None, :]
    x = tl.load(seg_ptr + b * s_sb + (p - t_old)[:, None] * s_sn + offs_d[None, :], mask=wmask, other=0.0)
    tl.store(row + (cmem_len + slot)[:, None] * s_br + offs_d[None, :], x, mask=wmask)


@triton_kernel
def _ring_conv_kernel(buf_ptr, seg_ptr, w_ptr, bias_ptr, count_ptr, len_ptr, n_rows, max_runs, mem_len, cmem_len,
                      ring, D, s_bb, s_br, s_sb, s_sn, s_wo, s_wi, s_wt,
                      RATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    # The conv ring update as one GEMM read straight from the ring and the segment (no staging copy, no weight
    # relayout): row m = (b, r) is run G = g_lo(b) + r of batch row b, out[m, o] = bias[o] + sum over (t, i) of
    # token(G * c + t)[i] w[o, i, t], stored to cmem slot G % cmem_len when the run is real. Runs before the
    # write kernel of the same update, so the ring still holds the evicted tokens.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = offs_m // max_runs  # (BLOCK_M,)
    r = offs_m % max_runs
    mmask = offs_m < n_rows
    t_old = tl.load(count_ptr + b, mask=mmask, other=0)  # int64
    t_new = t_old + tl.load(len_ptr + b, mask=mmask, other=0)
    z_old = tl.maximum(t_old - mem_len, 0) // RATE
    z_new = tl.maximum(t_new - mem_len, 0) // RATE
    G = tl.maximum(z_old, z_new - cmem_len) + r  # (BLOCK_M,) as `MemoryRing._runs`
    real = mmask & (G < z_new)
    nmask = offs_n < D
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in tl.static_range(RATE):
        pos = G * RATE + t  # (BLOCK_M,) token t of each run
        old = pos < t_old
        ring_row = buf_ptr + b * s_bb + (cmem_len + pos % ring) * s_br  # (BLOCK_M,) pointers
        seg_row = seg_ptr + b * s_sb + (pos - t_old) * s_sn
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < D
            a_ring = tl.load(ring_row[:, None] + offs_k[None, :], mask=(real & old)[:, None] & kmask[None, :],
                             other=0.0)
            a_seg = tl.load(seg_row[:, None] + offs_k[None, :], mask=(real & ~old)[:, None] & kmask[None, :],
                            other=0.0)
            a = tl.where(old[:, None], a_ring, a_seg)  # (BLOCK_M, BLOCK_K)
            w = tl.load(w_ptr + offs_n[None, :] * s_wo + offs_k[:, None] * s_wi + t * s_wt,
                        mask=kmask[:, None] & nmask[None, :], other=0.0).to(a.dtype)  # (BLOCK_K, BLOCK_N) w[o,i,t]^T
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    dst = buf_ptr + b * s_bb + (G % cmem_len) * s_br  # (BLOCK_M,)
    tl.store(dst[:, None] + offs_n[None, :], acc.to(buf_ptr.dtype.element_ty), mask=real[:, None] & nmask[None, :])


def _block_d(D: int) -> int:
    """Units per program of the ring's update kernel: a whole row up to 512 (a program per run of c slots is
    small; splitting D as well made ~8k programs of < 1 KB for the enwik8 layer)."""
    return min(512, max(16, 1 << (D - 1).bit_length()))


def _compress_triton(mem: torch.Tensor, rate: int, mode: str) -> torch.Tensor:
    """Launcher (mean / max): mem (B, N, D) -> (B, N / c, D)."""
    B, N, D = mem.shape
    out = mem.new_empty(B, N // rate, D)
    if out.numel() == 0:
        return out
    block_d = min(256, max(16, 1 << (D - 1).bit_length()))
    block_j = max(1, min(32, 4096 // block_d))  # ~4096 outputs of each slot of the runs per program
    _compress_kernel[(B, cdiv(N // rate, block_j), cdiv(D, block_d))](
        mem, out, N // rate, D, *mem.stride(), *out.stride(), RATE=rate, BLOCK_J=block_j, BLOCK_D=block_d,
        MODE=_MODE_IDS[mode])
    return out


class _Pool(torch.autograd.Function):
    """Mean / max pooling by the Triton kernel, with the backward of the reference (amax splits ties evenly)."""

    @staticmethod
    def forward(ctx: Any, mem: torch.Tensor, rate: int, mode: str) -> torch.Tensor:
        out = _compress_triton(mem, rate, mode)
        ctx.rate, ctx.mode = rate, mode
        if mode == "max":
            ctx.save_for_backward(mem, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        c = ctx.rate
        if ctx.mode == "mean":
            return (grad / c).repeat_interleave(c, dim=1), None, None  # (B, N, D)
        mem, out = ctx.saved_tensors
        B, N, D = mem.shape
        hit = mem.view(B, N // c, c, D) == out.unsqueeze(2)  # (B, N/c, c, D)
        share = hit / hit.sum(2, keepdim=True)
        return (share * grad.unsqueeze(2)).view(B, N, D), None, None


def _conv_as_matmul(runs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """runs (B, M, c * D), slot-major (token t of a run, then unit i) -> (B, M, D): conv with kernel = stride = c
    is one matmul with the weight laid out as W[(t, i), o] = weight[o, i, t]."""
    D_out, D_in, c = weight.shape
    w = weight.permute(2, 1, 0).reshape(c * D_in, D_out)  # (c * D, D)
    out = runs @ w  # (B, M, D)
    return out if bias is None else out + bias


def compress_memory(mem: torch.Tensor, *, rate: int, mode: str, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """Public op. `impl`: "triton" | "reference" (default: the implementation chosen at start). Gradients flow on
    both paths (conv: to mem, weight and bias; mean / max: to mem)."""
    if mem.dim() != 3 or rate < 1 or mem.shape[1] % rate:
        raise ValueError(f"mem {tuple(mem.shape)}: expected (B, N, D) with N a multiple of rate {rate}")
    if mode not in COMPRESS_MODES:
        raise ValueError(f"mode must be one of {', '.join(COMPRESS_MODES)}")
    B, N, D = mem.shape
    if mode == "conv" and (weight is None or weight.shape != (D, D, rate)):
        raise ValueError(f"mode 'conv' needs weight of shape ({D}, {D}, {rate})")
    if resolve_impl(impl, mem) == "reference":
        return compress_memory_ref(mem, rate=rate, mode=mode, weight=weight, bias=bias)
    if mode == "conv":
        assert weight is not None
        return _conv_as_matmul(mem.reshape(B, N // rate, rate * D), weight, bias)  # (B, N/c, D)
    if not (torch.is_grad_enabled() and mem.requires_grad):
        return _compress_triton(mem, rate, mode)  # no autograd node (serving)
    out: torch.Tensor = _Pool.apply(mem, rate, mode)  # type: ignore[no-untyped-call]
    return out


def _fixed_update_triton(mem: torch.Tensor, x: torch.Tensor, done: torch.Tensor, cmem: torch.Tensor,
                         comp: torch.Tensor | None, n_new: torch.Tensor, mem_len: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: one kernel writes the new mem (B, L, D) and the new cmem (B, K, D)."""
    B, L, D = mem.shape
    K = cmem.shape[1]
    x, mem, cmem = (t if t.stride(-1) == 1 else t.contiguous() for t in (x.to(mem.dtype), mem, cmem))
    if comp is not None:
        comp = comp.to(cmem.dtype)
        comp = comp if comp.stride(-1) == 1 else comp.contiguous()
    new_mem, new_cmem = torch.empty_like(mem), torch.empty_like(cmem)
    if B == 0 or D == 0:
        return new_mem, new_cmem
    block_d = min(256, max(16, 1 << (D - 1).bit_length()))
    block_s = max(1, min(32, 4096 // block_d))
    mem_blocks = cdiv(L, block_s)
    cp = cmem if comp is None else comp
    _fixed_update_kernel[(B, mem_blocks + cdiv(K, block_s), cdiv(D, block_d))](
        mem, x, done, cmem, cp, n_new, new_mem, new_cmem, L, x.shape[1], mem_len, K, cp.shape[1], D, mem_blocks,
        mem.stride(0), mem.stride(1), x.stride(0), x.stride(1), cmem.stride(0), cmem.stride(1), cp.stride(0),
        cp.stride(1), new_mem.stride(0), new_mem.stride(1), new_cmem.stride(0), new_cmem.stride(1),
        BLOCK_S=block_s, BLOCK_D=block_d, HAS_COMP=comp is not None)
    return new_mem, new_cmem


def fixed_memory_update(mem: torch.Tensor, x: torch.Tensor, done: torch.Tensor, cmem: torch.Tensor,
                        comp: torch.Tensor | None, n_new: torch.Tensor, *, mem_len: int, impl: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Public op -> (new mem (B, L, D), new cmem (B, K, D)). Layout in the module docstring. The Triton path runs
    when no input needs a gradient (or under no_grad); otherwise, and for `impl="reference"`, the reference."""
    B, L, D = mem.shape
    if (x.dim() != 3 or x.shape[0] != B or x.shape[2] != D or x.shape[1] > L or not 0 <= mem_len <= L
            or done.shape != (B,) or cmem.dim() != 3 or cmem.shape[0] != B or cmem.shape[2] != D
            or n_new.shape != (B,) or (comp is not None and (comp.dim() != 3 or comp.shape[0] != B
                                                              or comp.shape[2] != D))):
        raise ValueError(f"fixed_memory_update: mem {tuple(mem.shape)}, x {tuple(x.shape)}, done {tuple(done.shape)}, "
                         f"cmem {tuple(cmem.shape)}, n_new {tuple(n_new.shape)} do not fit (module docstring)")
    tensors = [t for t in (mem, x, done, cmem, comp, n_new) if t is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if resolve_impl(impl, *tensors) == "reference" or grad:
        return fixed_memory_update_ref(mem, x, done, cmem, comp, n_new, mem_len=mem_len)
    return _fixed_update_triton(mem, x, done, cmem, comp, n_new, mem_len)


class MemoryRing:
    """One layer's memory (the last `mem_len` inputs) and compressed memory (`cmem_len` slots) for `batch` rows, in
    preallocated ring buffers; row b has its own count of inputs appended (its fill level).

        ring = MemoryRing(B, D, mem_len=768, cmem_len=1152, rate=3, mode="conv", device=..., dtype=...)
        kv, lengths = ring.view()        # (B, cmem_len + mem_len, D), (B,): the memory keys' source, left-padded
        # attention over [kv ; segment]: key_lengths = lengths + n_s (kernels.attention: the last valid keys)
        ring.update(h)                   # h (B, n_s, D): this layer's inputs of the segment just run
        ring.reset(rows)                 # a new session in rows: empty memory

    Storage per row: [cmem ring (cmem_len) | memory ring (R) | scratch | zeros], R = mem_len + rate - 1 rounded up
    to a multiple of rate (room for a run evicted but not yet complete, module docstring).
    """

    def __init__(self, batch: int, dim: int, *, mem_len: int, cmem_len: int, rate: int, mode: str,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if mode not in COMPRESS_MODES:
            raise ValueError(f"mode must be one of {', '.join(COMPRESS_MODES)}")
        if rate < 1 or mem_len < 1 or cmem_len < 1:
            raise ValueError("MemoryRing needs rate, mem_len and cmem_len >= 1")
        self.mem_len, self.cmem_len, self.rate, self.mode = mem_len, cmem_len, rate, mode
        self.ring_runs = -(-(mem_len + rate - 1) // rate)
        self.ring = self.ring_runs * rate  # R
        self._scratch = cmem_len + self.ring  # where writes that must not land go (vectorised, no host sync)
        self._zero = self._scratch + 1  # never written: the view's left padding
        self.buf = torch.zeros(batch, self._zero + 1, dim, device=device, dtype=dtype)  # (B, rows, D)
        self.count = torch.zeros(batch, dtype=torch.int64, device=self.buf.device)  # (B,) inputs appended
        self._rows = torch.arange(batch, device=self.buf.device).view(batch, 1)  # (B, 1) for row-wise indexing

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) valid slots of `view()` per row (compressed + memory)."""
        mem = self.count.clamp(max=self.mem_len)
        runs = (self.count - self.mem_len).clamp(min=0) // self.rate
        return runs.clamp(max=self.cmem_len) + mem

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Empty rows (all when None; a bool mask (B,) or indices): their next view is all padding."""
        if rows is None:
            self.count.zero_()
        else:
            self.count[rows] = 0

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[cmem ; mem] in time order, left-padded with zeros -> (B, cmem_len + mem_len, D), lengths (B,)."""
        B, _, D = self.buf.shape
        L = self.cmem_len + self.mem_len
        t = self.count.view(B, 1)
        n_mem = t.clamp(max=self.mem_len)  # (B, 1)
        runs = (t - self.mem_len).clamp(min=0) // self.rate  # (B, 1) runs compressed so far
        n_c = runs.clamp(max=self.cmem_len)
        back = torch.arange(L, 0, -1, device=t.device).view(1, L)  # (1, L) distance from the end: L .. 1
        mem_slot = self.cmem_len + (t - back) % self.ring  # (B, L) token t - back
        c_slot = (runs - (back - n_mem)) % self.cmem_len  # (B, L) run runs - (back - n_mem)
        idx = torch.where(back <= n_mem, mem_slot, torch.where(back <= n_mem + n_c, c_slot, self._zero))
        kv = self.buf[self._rows, idx]  # (B, L, D) whole rows of D: faster than gather on a CPU
        return kv, (n_mem + n_c).view(B)

    @torch.no_grad()
    def update(self, segment: torch.Tensor, lengths: torch.Tensor | None = None, *,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, impl: str | None = None) -> None:
        """Append segment (B, n_s, D) to each row's memory (row b: its first lengths[b] <= n_s slots; all when
        None), compress the evicted runs into the compressed memory. In place, no gradient."""
        B, n_s, D = segment.shape
        if (B, D) != (self.buf.shape[0], self.buf.shape[2]):
            raise ValueError(f"segment {tuple(segment.shape)} does not fit a ring of {B} rows of {D} units")
        if self.mode == "conv" and (weight is None or weight.shape != (D, D, self.rate)):
            raise ValueError(f"mode 'conv' needs weight of shape ({D}, {D}, {self.rate})")
        if lengths is None:
            lens = torch.full((B,), n_s, dtype=torch.int64, device=self.count.device)
        else:
            lens = lengths.to(device=self.count.device, dtype=torch.int64).clamp(0, n_s)  # (B,)
        segment = segment.to(self.buf.dtype)
        c = self.rate
        max_runs = min(self.cmem_len, (n_s + c - 1) // c)  # runs one update can add to cmem
        if resolve_impl(impl, self.buf, segment) == "triton":
            self._update_triton(segment, lens, max_runs, weight, bias)
        else:
            self._update_torch(segment, lens, max_runs, weight, bias)
        self.count += lens

    def _runs(self, lens: torch.Tensor, max_runs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max_runs) run numbers this update compresses and whether each is real (as in the kernel)."""
        t_old, t_new = self.count, self.count + lens
        z_old = (t_old - self.mem_len).clamp(min=0) // self.rate
        z_new = (t_new - self.mem_len).clamp(min=0) // self.rate
        g_lo = torch.maximum(z_old, z_new - self.cmem_len)  # (B,)
        G = g_lo.view(-1, 1) + torch.arange(max_runs, device=lens.device).view(1, -1)  # (B, max_runs)
        return G, G < z_new.view(-1, 1)

    def _store_runs(self, squeezed: torch.Tensor, G: torch.Tensor, real: torch.Tensor) -> None:
        """squeezed (B, max_runs, D) -> their cmem slots (the padding runs to the scratch row)."""
        slot = torch.where(real, G % self.cmem_len, self._scratch)  # (B, max_runs)
        self.buf.index_put_((self._rows, slot), squeezed.to(self.buf.dtype))

    def _update_torch(self, segment: torch.Tensor, lens: torch.Tensor, max_runs: int, weight: torch.Tensor | None,
                      bias: torch.Tensor | None) -> None:
        B, n_s, D = segment.shape
        c, R = self.rate, self.ring
        t_old = self.count.view(B, 1, 1)
        if max_runs > 0:
            G, real = self._runs(lens, max_runs)
            pos = (G.unsqueeze(-1) * c + torch.arange(c, device=G.device)).view(B, -1)  # (B, max_runs * c) tokens
            old = pos < t_old.view(B, 1)
            from_ring = self.buf[self._rows, self.cmem_len + pos % R]  # (B, max_runs * c, D)
            from_seg = segment[self._rows, (pos - t_old.view(B, 1)).clamp(0, n_s - 1)]
            runs = torch.where(old.unsqueeze(-1), from_ring, from_seg)
            squeezed = compress_memory_ref(runs, rate=c, mode=self.mode, weight=weight, bias=bias)  # (B, runs, D)
            self._store_runs(squeezed, G, real)
        # the last R of the new tokens go to their slots (the rest are already compressed or dropped)
        i = torch.arange(n_s, device=segment.device).view(1, n_s)
        p = t_old.view(B, 1) + i  # (B, n_s)
        t_new = (self.count + lens).view(B, 1)
        keep = (i < lens.view(B, 1)) & (p >= t_new - R)
        slot = torch.where(keep, self.cmem_len + p % R, self._scratch)
        self.buf.index_put_((self._rows, slot), segment)

    def _update_triton(self, segment: torch.Tensor, lens: torch.Tensor, max_runs: int, weight: torch.Tensor | None,
                       bias: torch.Tensor | None) -> None:
        B, n_s, D = segment.shape
        if segment.stride(-1) != 1:
            segment = segment.contiguous()
        c = self.rate
        if self.mode == "conv" and max_runs > 0:
            assert weight is not None
            ieee = self.buf.dtype == torch.float32
            blk = 64 if D > 32 else 32 if D > 16 else 16
            _ring_conv_kernel[(cdiv(B * max_runs, 64), cdiv(D, blk))](
                self.buf, segment, weight, self.buf if bias is None else bias, self.count, lens, B * max_runs,
                max_runs, self.mem_len, self.cmem_len, self.ring, D, self.buf.stride(0), self.buf.stride(1),
                segment.stride(0), segment.stride(1), *weight.stride(), RATE=c, BLOCK_M=64, BLOCK_N=blk,
                BLOCK_K=blk, HAS_BIAS=bias is not None, IEEE=ieee)
        block_d = _block_d(D)
        _memory_update_kernel[(B, self.ring_runs, cdiv(D, block_d))](
            self.buf, segment, self.count, lens, self.mem_len, self.cmem_len, self.ring_runs, D,
            self.buf.stride(0), self.buf.stride(1), segment.stride(0), segment.stride(1),
            RATE=c, BLOCK_C=max(2, 1 << (c - 1).bit_length()), BLOCK_D=block_d, MODE=_MODE_IDS[self.mode])
