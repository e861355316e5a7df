"""mLSTM recurrence with the adapter h' = h + M h inside it, differentiated w.r.t. M only (thesis sec. 4.6).

Layout: mx (B, T, H) = W_mx x_t; zx (B, T, 4H) = W_x x_t + b, gate blocks i, f, o, u; h0, c0 (B, H);
w_mh (H, H); w_m (4H, H); m (B, k, k) acting on the first k units of h, k <= H. Returns hs (B, T, H), the
adapted h'_t of every step, and the final h'_T, c_T (B, H).

    m_t = mx_t * (W_mh h'_{t-1})                eq. 3.5
    z_t = zx_t + W_m m_t                        eq. 3.6-3.9 (input and gates)
    c_t = sig(f) * c_{t-1} + sig(i) * tanh(u)   eq. 2.21 (the LSTM's cell update)
    h_t = sig(o) * tanh(c_t)                    eq. 2.22
    h'_t = h_t + M h_t (first k units)          sec. 4.6

Sparse dynamic evaluation needs dL/dM and nothing of the weights. Plain autograd records ~20 nodes per step
and runs them one by one; `_AdaptedMLSTM` runs the T steps under no_grad, keeps the gate activations, and
its backward walks the steps in reverse with two matmuls each (dz_t W_m and (dm_t * mx_t) W_mh: the
gradient through time), forming dL/dM = sum_t g_t^T h_t (row vectors, g_t = dL/dh'_t[:k]) once at the end.
Step 0's matmuls are skipped when the initial state needs no gradient (sparse_step's detached state).

The forward does the same arithmetic, op for op, as `models.mlstm.mlstm_cell` followed by
`kernels.adapter.apply_adapter_ref`, so its outputs are bit-identical to the plain path's.

w_mh and w_m may be in a lower precision than the rest (bf16 inference, models/mlstm.py): the four matmuls of a
step (two forward, two backward) then take their inputs in it and return to the others' dtype; everything else
stays in that dtype.

Known limits: no Triton kernel yet (every device runs this PyTorch code); gradients reach M, h0 and c0 only,
so mx, zx, w_mh and w_m must not require grad (the launcher refuses them: use plain autograd there); no
autocast (pass bf16 weights instead).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.adapter import apply_adapter_ref

__all__ = ["adapted_mlstm", "adapted_mlstm_ref"]


def adapted_mlstm_ref(mx: torch.Tensor, zx: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_mh: torch.Tensor,
                      w_m: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference (plain autograd). Layout as in the module docstring -> hs, h'_T, c_T."""
    h, c, outs = h0, c0, []
    for mx_t, zx_t in zip(mx.unbind(1), zx.unbind(1), strict=True):
        mm = mx_t * (h @ w_mh.t())  # (B, H) eq. 3.5
        i, f, o, u = (zx_t + mm @ w_m.t()).chunk(4, dim=1)  # (B, H) each, eq. 3.6-3.9
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)  # eq. 2.21
        h = apply_adapter_ref(torch.sigmoid(o) * torch.tanh(c), m)  # eq. 2.22, then h' = h + M h
        outs.append(h)
    return torch.stack(outs, dim=1), h, c  # (B, T, H)


def _check(mx: torch.Tensor, zx: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_mh: torch.Tensor,
           w_m: torch.Tensor, m: torch.Tensor) -> None:
    B, T, H = mx.shape
    k = m.shape[-1]
    if (zx.shape != (B, T, 4 * H) or h0.shape != (B, H) or c0.shape != (B, H) or w_mh.shape != (H, H)
            or w_m.shape != (4 * H, H) or m.shape != (B, k, k) or not 0 < k <= H or T == 0):
        raise ValueError(f"shapes do not fit: mx {tuple(mx.shape)}, zx {tuple(zx.shape)}, h0 {tuple(h0.shape)}, "
                         f"c0 {tuple(c0.shape)}, w_mh {tuple(w_mh.shape)}, w_m {tuple(w_m.shape)}, m {tuple(m.shape)}")
    if len({t.dtype for t in (mx, zx, h0, c0, m)}) != 1 or w_mh.dtype != w_m.dtype:
        raise ValueError("adapted_mlstm needs one dtype for mx, zx, h0, c0 and m, and one for w_mh and w_m")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (mx, zx, w_mh, w_m)):
        raise ValueError("adapted_mlstm gives gradients for m, h0 and c0 only: use adapted_mlstm_ref when "
                         "the weights or input projections need them")


def _mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w in w's precision, returned in a's."""
    return a @ w if a.dtype == w.dtype else (a.to(w.dtype) @ w).to(a.dtype)


class _AdaptedMLSTM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mx: torch.Tensor, zx: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                w_mh: torch.Tensor, w_m: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k = m.shape[-1]
        h, c = h0, c0
        outs, kept = [], []
        for mx_t, zx_t in zip(mx.unbind(1), zx.unbind(1), strict=True):
            mm = mx_t * (h.to(w_mh.dtype) @ w_mh.t())  # (B, H) eq. 3.5
            i, f, o, u = (zx_t + mm.to(w_m.dtype) @ w_m.t()).chunk(4, dim=1)  # eq. 3.6-3.9
            si, sf, so, tu = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o), torch.tanh(u)
            c = sf * c + si * tu  # (B, H) eq. 2.21
            tc = torch.tanh(c)
            h_pre = so * tc  # (B, H) eq. 2.22
            h = apply_adapter_ref(h_pre, m)  # (B, H) h' = h + M h
            outs.append(h)
            kept.append((h_pre[:, :k], c, tc, si, sf, so, tu))
        hs = torch.stack(outs, dim=1)  # (B, T, H)
        heads, *rest = zip(*kept, strict=True)
        saved = [torch.stack(x) for x in rest]  # c, tanh(c), sig(i), sig(f), sig(o), tanh(u): (T, B, H) each
        ctx.save_for_backward(mx, c0, w_mh, w_m, m, torch.stack(heads, dim=1), *saved)  # heads (B, T, k)
        ctx.set_materialize_grads(False)
        return hs, h, c

    @staticmethod
    def backward(ctx: Any, d_hs: torch.Tensor | None, d_hT: torch.Tensor | None,
                 d_cT: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        mx, c0, w_mh, w_m, m, heads, cs, tcs, si, sf, so, tu = ctx.saved_tensors
        T, B, H = cs.shape
        k = m.shape[-1]
        lowp = w_m.dtype if w_m.dtype != cs.dtype else None
        # every step's local derivatives at once (eq. 2.21-2.22): dc_t += dh_t * p_t; dz_t = [dc, dc, dh, dc] * s_t,
        # with the fused sigmoid'/tanh' ops autograd itself uses (y' = g y (1 - y), g (1 - y^2)), written in place
        sig_bwd, tanh_bwd = torch.ops.aten.sigmoid_backward.grad_input, torch.ops.aten.tanh_backward.grad_input
        p = torch.ops.aten.tanh_backward(so, tcs)  # (T, B, H) dh_t/dc_t = sig(o) tanh'(c)
        s = cs.new_empty(T, B, 4 * H)  # (T, B, 4H)
        sig_bwd(tu, si, grad_input=s[..., :H])  # tanh(u) sig'(i)
        sig_bwd(c0.unsqueeze(0), sf[:1], grad_input=s[:1, :, H : 2 * H])  # c_{t-1} sig'(f)
        sig_bwd(cs[:-1], sf[1:], grad_input=s[1:, :, H : 2 * H])
        sig_bwd(tcs, so, grad_input=s[..., 2 * H : 3 * H])  # tanh(c) sig'(o)
        tanh_bwd(si, tu, grad_input=s[..., 3 * H :])  # sig(i) tanh'(u)
        d_out = d_hs.transpose(0, 1) if d_hs is not None else cs.new_zeros(T, B, H)  # (T, B, H) dL/dh'_t direct
        outs, ps, ss, sfs, mxs = d_out.unbind(0), p.unbind(0), s.unbind(0), sf.unbind(0), mx.unbind(1)
        need_h0, need_c0 = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dh = outs[T - 1] if d_hT is None else outs[T - 1] + d_hT  # (B, H) dL/dh'_{T-1}
        dc, d_h0, d_c0 = d_cT, None, None
        gs: list[torch.Tensor] = [dh] * T
        for t in range(T - 1, -1, -1):
            g = dh[:, :k]  # (B, k) dL/dh'_t on the adapted units
            gs[t] = g
            if t == 0 and not (need_h0 or need_c0):
                break  # dL/dM needs g_0 only: step 0's two matmuls are saved (the usual case, a detached state)
            # through h' = h + M h: dL/dh_t = (I + M)^T g on the first k units
            head = torch.baddbmm(g.unsqueeze(1), g.unsqueeze(1), m).squeeze(1)  # (B, k)
            d_pre = head if k == H else torch.cat([head, dh[:, k:]], dim=1)  # (B, H)
            dc = d_pre * ps[t] if dc is None else torch.addcmul(dc, d_pre, ps[t])  # (B, H) dL/dc_t
            if t > 0 or need_h0:
                dz = torch.stack((dc, dc, d_pre, dc), dim=1).view(B, 4 * H).mul_(ss[t])  # (B, 4H) dL/dz_t
                dmm = _mm(dz, w_m) * mxs[t]  # (B, H) dL/d(W_mh h'_{t-1}), eq. 3.6 then 3.5
                if t > 0:  # (B, H) dL/dh'_{t-1}
                    dh = torch.addmm(outs[t - 1], dmm, w_mh) if lowp is None else outs[t - 1] + _mm(dmm, w_mh)
                else:
                    d_h0 = _mm(dmm, w_mh)
            dc = dc * sfs[t]  # dL/dc_{t-1} through eq. 2.21
        if need_c0:
            d_c0 = dc
        d_m = torch.bmm(torch.stack(gs, dim=2), heads) if ctx.needs_input_grad[6] else None  # (B, k, k) sum_t g_t h_t^T
        return None, None, d_h0, d_c0, None, None, d_m


def adapted_mlstm(mx: torch.Tensor, zx: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_mh: torch.Tensor,
                  w_m: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Public op -> hs (B, T, H), h'_T, c_T (B, H); gradients w.r.t. m, h0, c0 equal `adapted_mlstm_ref`'s."""
    _check(mx, zx, h0, c0, w_mh, w_m, m)
    hs, h, c = _AdaptedMLSTM.apply(mx, zx, h0, c0, w_mh, w_m, m)  # type: ignore[no-untyped-call]
    return hs, h, c
