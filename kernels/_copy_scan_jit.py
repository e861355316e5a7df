"""The numba kernels of kernels/copy_scan.py (its docstring; `compiled()` there gives them, None without numba).

They are module-level functions so that numba's disk cache (`cache=True`) serves them to the next process: a jitted
function that calls others it closes over is cached under its closure cells' pickles, which name each callee's
dispatcher by a per-process id, so such a cache never matches and every process would compile them again (seconds
each).
"""

from __future__ import annotations

import numba
import numpy as np

from kernels.copy_scan import CAP


@numba.njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def _mix_row(w, feat, out_row):
    """out_row[v] = log_softmax(w . feat)[v]."""
    F, V = feat.shape
    top = -np.inf
    for v in range(V):
        z = 0.0
        for f in range(F):
            z += w[f] * feat[f, v]
        out_row[v] = z
        top = max(top, z)
    total = 0.0
    for v in range(V):
        total += np.exp(out_row[v] - top)
    lse = top + np.log(total)
    for v in range(V):
        out_row[v] -= lse


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _features(cand, ell, counts, uni, lp_row, alpha, logtab, run, feat):
    """logtab[c] = log(c + alpha) for the whole counts c <= W (a table: 7 x 256 logs a byte were half the
    time of a step)."""
    K1, V = counts.shape[0], lp_row.shape[0]
    for v in range(V):
        feat[0, v] = lp_row[v]
        feat[1, v] = np.log(uni[v] + alpha)
        run[v] = 0
    for k in range(K1 - 1, 0, -1):  # n_k = occurrences of order >= k
        for v in range(V):
            run[v] += counts[k, v]
            feat[1 + k, v] = logtab[run[v]]
    for v in range(V):
        feat[K1 + 1, v] = 0.0
    if ell > 0:
        feat[K1 + 1, cand] = 1.0


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _place(row, occ, vals, n, cand, orders, counts):
    """Write the new match lengths vals[i] at slots occ[i] of `row`, count each slot's byte cand[j] at its order
    (capped at K), and return the longest match's key, m * W + j of the most recent (-1: none)."""
    W = row.shape[0]
    counts[:, :] = 0
    top = -1
    for i in range(n):
        j = occ[i]
        m = vals[i]
        row[j] = m
        counts[m if m < orders else orders, cand[j]] += 1
        key = np.int64(m) * W + j
        if key > top:
            top = key
    return top


@numba.njit(cache=True, nogil=True, boundscheck=False)
def learn_segment(ext, lengths, match, fill, uni, weights, feat, bucket, lp, out, hist_out, orders, alpha, lr,
                  lut, uni_limit, logtab):
    B, W = match.shape
    V = lp.shape[2]
    F = feat.shape[1]
    counts = np.zeros((orders + 1, 256), dtype=np.int64)
    run = np.zeros(256, dtype=np.int64)
    z = np.empty(V, dtype=np.float32)
    p = np.empty(V, dtype=np.float64)
    occ = np.empty(W, dtype=np.int32)  # this step's matching slots
    prev = np.empty(W, dtype=np.int32)  # the last step's (the only nonzero slots of match)
    vals = np.empty(W, dtype=np.uint8)
    for b in range(B):
        row = match[b]
        n_prev = 0
        for j in range(W):  # branch-free: every slot is written, the count moves on a nonzero one
            prev[n_prev] = j
            n_prev += row[j] != 0
        for t in range(lengths[b]):
            x = ext[b, W + t]
            # 1. the mixer learns from its pending prediction
            bk = bucket[b]
            if bk >= 0:
                _mix_row(weights[b, bk], feat[b], z)
                for v in range(V):
                    p[v] = np.exp(z[v])
                for f in range(F):
                    e = 0.0
                    for v in range(V):
                        e += feat[b, f, v] * p[v]
                    weights[b, bk, f] -= lr * (e - feat[b, f, x])
            # 2. the scan: the slots whose byte is x (one branch-free pass), then only those: the recurrence,
            # the counts and the longest match; the last step's nonzero slots are cleared by their list
            start = max(W - fill[b], 0)
            old = ext[b, t : t + W]
            hits = np.flatnonzero(old[start:] == x)  # a vectorised compare
            n = hits.shape[0]
            for i in range(n):
                j = hits[i] + start
                occ[i] = j
                m = row[j]
                vals[i] = (m if m < CAP else CAP) + 1
            for i in range(n_prev):
                row[prev[i]] = 0
            top = _place(row, occ, vals, n, ext[b, t + 1 : t + 1 + W], orders, counts)
            occ, prev = prev, occ
            n_prev = n
            if fill[b] >= W:
                uni[b, ext[b, t]] -= 1.0
            uni[b, x] += 1.0
            fill[b] = min(fill[b] + 1, W)
            # 3. predict the next byte
            ell = top // W if top >= 0 else 0
            cand = ext[b, t + 1 + (top % W)] if top >= 0 else 0
            _features(cand, ell, counts, uni[b], lp[b, t], alpha, logtab, run, feat[b])
            bucket[b] = lut[min(ell, 255)]
            _mix_row(weights[b, bucket[b]], feat[b], out[b, t])
        total = 0.0
        for v in range(V):
            total += uni[b, v]
        if total > uni_limit:
            for v in range(V):
                uni[b, v] /= 2
        for j in range(W):
            hist_out[b, j] = ext[b, lengths[b] + j]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def build_index(hist, fill, off, pos):
    """Each history's slots p >= 1 holding a byte, grouped by the pair (hist[p-1], hist[p]): the slots of pair
    key k = 256 a + c are pos[s, off[s, k] : off[s, k + 1]], oldest first (a counting sort)."""
    S, W = hist.shape
    cursor = np.empty(off.shape[1] - 1, dtype=np.int32)
    for s in range(S):
        o = off[s]
        o[:] = 0
        h = hist[s]
        for p in range(W - fill[s] + 1, W):
            o[np.int32(h[p - 1]) * 256 + h[p] + 1] += 1
        for k in range(1, o.shape[0]):
            o[k] += o[k - 1]
        cursor[:] = o[:-1]
        for p in range(W - fill[s] + 1, W):
            k = np.int32(h[p - 1]) * 256 + h[p]
            pos[s, cursor[k]] = p
            cursor[k] += 1


@numba.njit(cache=True, nogil=True, boundscheck=False)
def frozen_segment(hist, fill, off, pos, index, ctx, ctxlen, inputs, lp, out, uni, weights, orders, alpha, lut,
                   logtab):
    """The frozen step through the pair index (`build_index`): a slot j whose byte is x has a match of 1 or
    more; its successor's byte c is counted by the pair (x, c) in one lookup, so order 1 and up costs 256
    reads, not a pass over the window. A match of 2 or more needs hist[j-1] == the byte read before x: those
    slots are the pair (that byte, x), the only ones measured backwards. The counts by exact level are then
    level 1 = pairs (x, c) - the longer matches that predict c."""
    B, T = inputs.shape
    W = hist.shape[1]
    C = ctx.shape[1]
    F = weights.shape[2]
    V = lp.shape[2]
    counts = np.zeros((orders + 1, 256), dtype=np.int64)
    run = np.zeros(256, dtype=np.int64)
    feat = np.empty((F, V), dtype=np.float32)
    for b in range(B):
        row = index[b]
        if row < 0:  # no copy model: the network alone
            for t in range(T):
                for v in range(V):
                    out[b, t, v] = lp[b, t, v]
            continue
        hrow = hist[row]
        o = off[row]
        lo = max(W - fill[row], 0)
        c = ctx[b]
        for t in range(T):
            x = inputs[b, t]
            for i in range(C - 1):
                c[i] = c[i + 1]
            c[C - 1] = x
            ctxlen[b] = min(ctxlen[b] + 1, C)
            n_ctx = ctxlen[b]
            if fill[row] == 0:  # an empty history has no evidence: the network alone
                for v in range(V):
                    out[b, t, v] = lp[b, t, v]
                continue
            counts[:, :] = 0
            top = -1
            last = -1  # the most recent slot after an x (a match of 1)
            base = np.int32(x) * 256
            for cc in range(256):  # slots j with hist[j] = x and hist[j + 1] = cc, as successors p = j + 1
                a, z = o[base + cc], o[base + cc + 1]
                counts[1, cc] = z - a
                if z > a and pos[row, z - 1] > last:
                    last = pos[row, z - 1]
            if n_ctx >= 2:  # the slots j with hist[j - 1] = the byte before x and hist[j] = x, j <= W - 2
                k = np.int32(c[C - 2]) * 256 + x
                for i in range(o[k], o[k + 1]):
                    j = pos[row, i]
                    if j > W - 2:
                        continue
                    m = 2
                    while m < n_ctx and j - m >= lo and hrow[j - m] == c[C - 1 - m]:
                        m += 1
                    cand = hrow[j + 1]
                    counts[1, cand] -= 1
                    counts[m if m < orders else orders, cand] += 1
                    key = np.int64(m) * W + j + 1
                    if key > top:
                        top = key
            if top < 0 and last >= 0:
                top = W + last
            ell = top // W if top >= 0 else 0
            cand = hrow[top % W] if top >= 0 else 0
            _features(cand, ell, counts, uni[row], lp[b, t], alpha, logtab, run, feat)
            _mix_row(weights[row, lut[min(ell, 255)]], feat, out[b, t])
