"""kernels.compress: compress_memory, MemoryRing, memory_update_ref and fixed_memory_update against the reference
and against naive implementations written here (a loop over runs; a per-row list of every input ever appended)."""

from __future__ import annotations

import pytest
import torch

from kernels.compress import (
    MemoryRing,
    compress_memory,
    compress_memory_ref,
    fixed_memory_update,
    fixed_memory_update_ref,
    memory_update_ref,
)
from tests.kernels._tolerance import assert_kernel_close

DTYPES = [torch.float32, torch.float16]


def _naive_compress(mem: torch.Tensor, rate: int, mode: str, weight: torch.Tensor | None,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """One run at a time; conv written as the sum over the run's slots t and input units i of W[o, i, t] x[t, i]."""
    outs = []
    for j in range(mem.shape[1] // rate):
        run = mem[:, j * rate:(j + 1) * rate]  # (B, c, D)
        if mode == "mean":
            outs.append(run.sum(1) / rate)
        elif mode == "max":
            outs.append(run.max(1).values)
        else:
            assert weight is not None
            y = torch.einsum("oit,bti->bo", weight, run)
            outs.append(y if bias is None else y + bias)
    return torch.stack(outs, 1)  # (B, N/c, D)


def _conv_params(D: int, rate: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(D, D, rate, generator=g) / (D * rate) ** 0.5, torch.randn(D, generator=g)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate", [2, 3, 4])
@pytest.mark.parametrize("mode", ["mean", "max", "conv"])
def test_compress_modes(mode: str, rate: int, dtype: torch.dtype, kdev: torch.device) -> None:
    g = torch.Generator().manual_seed(rate)
    B, D = 2, 13  # odd D: a partial block of units
    x = torch.randn(B, 5 * rate, D, generator=g)
    w, b = _conv_params(D, rate, g) if mode == "conv" else (None, None)
    x_lo = x.to(dtype)
    w_lo = None if w is None else w.to(dtype)
    b_lo = None if b is None else b.to(dtype)
    x64 = x_lo.double()
    w64 = None if w_lo is None else w_lo.double()
    b64 = None if b_lo is None else b_lo.double()
    truth = compress_memory_ref(x64, rate=rate, mode=mode, weight=w64, bias=b64)
    torch.testing.assert_close(_naive_compress(x64, rate, mode, w64, b64), truth, rtol=1e-12, atol=1e-12)
    out = compress_memory(x_lo.to(kdev), rate=rate, mode=mode, impl="triton",
                          weight=None if w_lo is None else w_lo.to(kdev), bias=None if b_lo is None else b_lo.to(kdev))
    assert out.dtype == dtype and out.shape == (B, 5, D)
    torch_lo = compress_memory_ref(x_lo.to(kdev), rate=rate, mode=mode, weight=None if w_lo is None else w_lo.to(kdev),
                                   bias=None if b_lo is None else b_lo.to(kdev))
    assert_kernel_close(out, truth, torch_lo, f"{mode} rate {rate} {dtype}")


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["mean", "max", "conv"])
def test_compress_gradients(mode: str, kdev: torch.device) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 9, 5, generator=g, dtype=torch.float64)
    x[0, 1] = x[0, 0]  # a tie in max mode: both slots share the gradient, as amax's backward does
    w, b = _conv_params(5, 3, g) if mode == "conv" else (None, None)
    params = [t.double().clone().requires_grad_(True) for t in (x, *(() if w is None else (w, b)))]
    up = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)

    def grads(impl: str) -> list[torch.Tensor]:
        leaves = [p.detach().float().to(kdev).requires_grad_(True) for p in params]
        weight, bias = (leaves[1], leaves[2]) if mode == "conv" else (None, None)
        out = compress_memory(leaves[0], rate=3, mode=mode, weight=weight, bias=bias, impl=impl)
        (out * up.float().to(kdev)).sum().backward()
        return [p.grad.cpu() for p in leaves]

    for got, want in zip(grads("triton"), grads("reference"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compress_refuses_bad_shapes() -> None:
    x = torch.zeros(2, 7, 4)
    with pytest.raises(ValueError, match="multiple of rate"):
        compress_memory(x, rate=3, mode="mean")
    with pytest.raises(ValueError, match="mode"):
        compress_memory(x[:, :6], rate=3, mode="median")
    with pytest.raises(ValueError, match="weight"):
        compress_memory(x[:, :6], rate=3, mode="conv", weight=torch.zeros(4, 4, 2))


class _NaiveMemory:
    """Every input each row was ever given, in order; the memory and compressed memory derived from the list:
    mem = the last n_m inputs; the evicted inputs (all before those) in complete runs of c, compressed, of which
    the last n_cm are kept."""

    def __init__(self, batch: int, dim: int, mem_len: int, cmem_len: int, rate: int, mode: str) -> None:
        self.rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.dim = dim
        self.mem_len, self.cmem_len, self.rate, self.mode = mem_len, cmem_len, rate, mode

    def append(self, segment: torch.Tensor, lengths: list[int]) -> None:
        for row, x, n in zip(self.rows, segment, lengths, strict=True):
            row.extend(x[:n])

    def reset(self, b: int) -> None:
        self.rows[b] = []

    def row(self, b: int, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """[cmem ; mem] of row b, oldest first, (valid slots, D), in float64."""
        toks = self.rows[b]
        evicted = max(0, len(toks) - self.mem_len) // self.rate * self.rate
        runs = [torch.stack(toks[i:i + self.rate]).double()[None] for i in range(0, evicted, self.rate)]
        cmem = [_naive_compress(r, self.rate, self.mode, weight, bias)[0, 0] for r in runs][-self.cmem_len:]
        mem = [t.double() for t in toks[max(0, len(toks) - self.mem_len):]]
        return torch.stack(cmem + mem) if cmem + mem else torch.zeros(0, self.dim, dtype=torch.float64)


def _check_view(ring: MemoryRing, naive: _NaiveMemory, weight: torch.Tensor | None, bias: torch.Tensor | None,
                atol: float) -> None:
    kv, lengths = ring.view()
    assert kv.shape[1] == ring.cmem_len + ring.mem_len
    for b in range(kv.shape[0]):
        want = naive.row(b, *(None if t is None else t.double().cpu() for t in (weight, bias)))
        n = want.shape[0]
        assert int(lengths[b]) == n, f"row {b}: {int(lengths[b])} valid slots, expected {n}"
        assert torch.all(kv[b, : kv.shape[1] - n] == 0), "left padding is zeros"
        if n:
            torch.testing.assert_close(kv[b, kv.shape[1] - n:].double().cpu(), want, rtol=0, atol=atol)


# (mem_len, cmem_len, rate): mem_len not a multiple of the rate; a cmem shorter than one update's runs
RING_CASES = [(7, 4, 3), (6, 2, 2), (5, 3, 4)]


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["mean", "max", "conv"])
def test_ring_fifo_over_many_segments(mode: str, impl: str, kdev: torch.device) -> None:
    """Per-row fill (random lengths, 0 included), segments longer than the ring, a row reset midway."""
    g = torch.Generator().manual_seed(3)
    B, D = 3, 5
    dev = kdev if impl == "triton" else torch.device("cpu")
    for mem_len, cmem_len, rate in RING_CASES:
        w, b = (t.to(dev) for t in _conv_params(D, rate, g)) if mode == "conv" else (None, None)
        ring = MemoryRing(B, D, mem_len=mem_len, cmem_len=cmem_len, rate=rate, mode=mode, device=dev)
        naive = _NaiveMemory(B, D, mem_len, cmem_len, rate, mode)
        _check_view(ring, naive, w, b, atol=0)  # empty: all padding
        for step in range(8):  # a segment longer than the ring before the reset (step 5) and one after it
            n_s = [2, 5, 13, 1][step % 4]  # 13 > the ring's slots
            seg = torch.randn(B, n_s, D, generator=g)
            lengths = torch.randint(0, n_s + 1, (B,), generator=g)
            lengths[step % B] = n_s
            ring.update(seg.to(dev), lengths.to(dev), weight=w, bias=b, impl=impl)
            naive.append(seg, lengths.tolist())
            if step == 5:
                ring.reset(torch.tensor([1], device=dev))
                naive.reset(1)
            _check_view(ring, naive, w, b, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["mean", "max", "conv"])
def test_ring_float16(mode: str, kdev: torch.device) -> None:
    """The fused kernel in float16 against the ring's PyTorch path in float16 and float64 (tolerance rule)."""
    g = torch.Generator().manual_seed(5)
    B, D, rate = 2, 7, 3
    w, b = _conv_params(D, rate, g) if mode == "conv" else (None, None)
    rings = {(impl, dt): MemoryRing(B, D, mem_len=6, cmem_len=3, rate=rate, mode=mode, dtype=dt,
                                    device=kdev if impl == "triton" else "cpu")
             for impl, dt in [("triton", torch.float16), ("reference", torch.float16), ("reference", torch.float64)]}
    for _ in range(5):
        seg = torch.randn(B, 6, D, generator=g).half()
        for (impl, dt), ring in rings.items():
            dev = ring.buf.device
            ring.update(seg.to(dev), weight=None if w is None else w.to(dev, dt),
                        bias=None if b is None else b.to(dev, dt), impl=impl)
        views = {key: ring.view() for key, ring in rings.items()}
        for key in views:
            assert torch.equal(views[key][1].cpu(), views["reference", torch.float64][1].cpu())
        assert_kernel_close(views["triton", torch.float16][0], views["reference", torch.float64][0],
                            views["reference", torch.float16][0], f"ring {mode}")


@pytest.mark.parametrize("mode", ["mean", "max", "conv"])
def test_ring_matches_cat_semantics(mode: str) -> None:
    """Whole segments (n_m and n_s multiples of the rate): the ring's view is memory_update_ref's [cmem ; mem]."""
    g = torch.Generator().manual_seed(11)
    B, D, rate, mem_len, cmem_len, n_s = 2, 4, 2, 6, 5, 4
    w, b = _conv_params(D, rate, g) if mode == "conv" else (None, None)
    ring = MemoryRing(B, D, mem_len=mem_len, cmem_len=cmem_len, rate=rate, mode=mode)
    mem, cmem = torch.zeros(B, 0, D), torch.zeros(B, 0, D)
    for _ in range(6):
        seg = torch.randn(B, n_s, D, generator=g)
        ring.update(seg, weight=w, bias=b, impl="reference")
        mem, cmem = memory_update_ref(mem, cmem, seg, mem_len=mem_len, cmem_len=cmem_len, rate=rate, mode=mode,
                                      weight=w, bias=b)
        kv, lengths = ring.view()
        want = torch.cat([cmem, mem], 1)  # (B, n, D)
        assert lengths.tolist() == [want.shape[1]] * B
        torch.testing.assert_close(kv[:, kv.shape[1] - want.shape[1]:], want, rtol=1e-6, atol=1e-6)


def test_memory_update_ref_semantics() -> None:
    g = torch.Generator().manual_seed(2)
    B, D = 2, 3
    mem, cmem = torch.randn(B, 2, D, generator=g), torch.randn(B, 2, D, generator=g)
    seg = torch.randn(B, 7, D, generator=g, requires_grad=True)
    w = torch.randn(D, D, 3, generator=g, requires_grad=True)
    new_mem, new_cmem = memory_update_ref(mem, cmem, seg, mem_len=6, cmem_len=2, rate=3, mode="conv", weight=w)
    x = torch.cat([mem, seg], 1)  # (B, 9, D): the run evicted is mem's 2 slots and the segment's first
    assert torch.equal(new_mem, x[:, 3:])  # exactly the last n_m inputs
    torch.testing.assert_close(new_cmem, torch.cat([cmem[:, 1:], _naive_compress(x[:, :3], 3, "conv", w, None)], 1))
    new_cmem.sum().backward()  # gradients reach the segment and the compression weights
    assert w.grad is not None and seg.grad is not None
    assert seg.grad[:, 0].abs().sum() > 0 and seg.grad[:, 1:].abs().sum() == 0
    partial, same = memory_update_ref(mem[:, :1], cmem, seg[:, :2], mem_len=6, cmem_len=2, rate=3, mode="max")
    assert partial.shape[1] == 3 and same is cmem  # not full yet: nothing evicted
    with pytest.raises(ValueError, match="multiple of rate"):
        memory_update_ref(mem, cmem, seg[:, :5], mem_len=6, cmem_len=2, rate=3, mode="max")


def test_ring_update_keeps_no_graph() -> None:
    ring = MemoryRing(2, 3, mem_len=4, cmem_len=2, rate=2, mode="conv")
    seg = torch.randn(2, 6, 3, requires_grad=True)
    ring.update(seg, weight=torch.randn(3, 3, 2, requires_grad=True))
    kv, _ = ring.view()
    assert not ring.buf.requires_grad and not kv.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["mean", "max", "conv"])
def test_compress_and_ring_on_cuda(mode: str, dtype: torch.dtype) -> None:
    """Realistic shapes (the paper's enwik8 layer: D 512, n_m 768, n_cm 1152, c 3)."""
    g = torch.Generator().manual_seed(0)
    B, N, D, rate = 8, 1536, 512, 3
    x = torch.randn(B, N, D, generator=g).to("cuda", dtype)
    w, b = _conv_params(D, rate, g) if mode == "conv" else (None, None)
    wd = None if w is None else w.to("cuda", dtype)
    bd = None if b is None else b.to("cuda", dtype)
    truth = compress_memory_ref(x.double(), rate=rate, mode=mode, weight=None if wd is None else wd.double(),
                                bias=None if bd is None else bd.double())
    out = compress_memory(x, rate=rate, mode=mode, weight=wd, bias=bd, impl="triton")
    assert_kernel_close(out, truth, compress_memory_ref(x, rate=rate, mode=mode, weight=wd, bias=bd), "compress")
    rings = {(impl, dt): MemoryRing(B, D, mem_len=768, cmem_len=1152, rate=rate, mode=mode, device="cuda", dtype=dt)
             for impl, dt in [("triton", dtype), ("reference", dtype), ("reference", torch.float64)]}
    for step in range(4):
        seg = x[:, (step % 2) * 768:(step % 2 + 1) * 768]
        for (impl, dt), ring in rings.items():
            ring.update(seg, weight=None if wd is None else wd.to(dt), bias=None if bd is None else bd.to(dt),
                        impl=impl)
    views = {key: ring.view()[0] for key, ring in rings.items()}
    assert_kernel_close(views["triton", dtype], views["reference", torch.float64], views["reference", dtype], "ring")


def _naive_fixed_update(mem: torch.Tensor, x: torch.Tensor, done: list[bool], cmem: torch.Tensor,
                        comp: torch.Tensor | None, n_new: list[int], mem_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row with Python lists of slots: append x, drop the oldest m; a done row keeps its newest mem_len (zeros
    before); a row with n_new > 0 appends the window's n slots (the first n - n_new zeroed) to cmem, keeps K."""
    L, K = mem.shape[1], cmem.shape[1]
    mems, cmems = [], []
    for b in range(mem.shape[0]):
        slots = (list(mem[b]) + list(x[b]))[x.shape[1]:]
        if done[b]:
            slots = [torch.zeros_like(s) if j < L - mem_len else s for j, s in enumerate(slots)]
        mems.append(torch.stack(slots))
        c = list(cmem[b])
        if comp is not None and n_new[b] > 0:
            n = comp.shape[1]
            c = (c + [torch.zeros_like(s) if q < n - n_new[b] else s for q, s in enumerate(comp[b])])[-K:]
        cmems.append(torch.stack(c))
    return torch.stack(mems), torch.stack(cmems)


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("L", "m", "mem_len", "K", "n"), [(9, 4, 6, 5, 3), (9, 9, 9, 2, 4), (17, 1, 12, 7, 7)])
def test_fixed_memory_update(L: int, m: int, mem_len: int, K: int, n: int, dtype: torch.dtype, impl: str,
                             kdev: torch.device) -> None:
    """The model's fixed-shape update (cmem shorter than the window included) against the per-row naive update."""
    g = torch.Generator().manual_seed(L + m)
    B, D = 4, 37
    mem, x, cmem = (torch.randn(B, k, D, generator=g).to(dtype) for k in (L, m, K))
    comp = torch.randn(B, n, D, generator=g).to(dtype)
    done, n_new = [True, False, True, False], [n, 0, 1, 2]
    dev = kdev if impl == "triton" else torch.device("cpu")
    args = [t.to(dev) for t in (mem, x, torch.tensor(done), cmem)]
    for c in (comp, None):
        got = fixed_memory_update(*args, None if c is None else c.to(dev), torch.tensor(n_new).to(dev),
                                  mem_len=mem_len, impl=impl)
        want = _naive_fixed_update(mem, x, done, cmem, c, n_new, mem_len)
        for a, w in zip(got, want, strict=True):
            assert a.dtype == dtype
            assert torch.equal(a.cpu(), w), "a copy: exact"


def test_fixed_memory_update_keeps_gradients_on_the_reference() -> None:
    mem, x = torch.randn(2, 5, 3), torch.randn(2, 2, 3, requires_grad=True)
    new_mem, _ = fixed_memory_update(mem, x, torch.tensor([True, False]), torch.zeros(2, 4, 3), None,
                                     torch.zeros(2, dtype=torch.long), mem_len=4)
    new_mem.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(2, 2, 3))
    torch.testing.assert_close(fixed_memory_update_ref(mem, x.detach(), torch.tensor([True, False]),
                                                       torch.zeros(2, 4, 3), None, torch.zeros(2, dtype=torch.long),
                                                       mem_len=4)[0], new_mem.detach())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fixed_memory_update_on_cuda(dtype: torch.dtype) -> None:
    """The model's update at a realistic size (n_m 512 + S - 1 slots, D 512) equals the reference exactly."""
    g = torch.Generator().manual_seed(0)
    B, L, m, K, n, D = 8, 767, 256, 384, 85, 512
    mem, x, cmem, comp = (torch.randn(B, k, D, generator=g).to("cuda", dtype) for k in (L, m, K, n))
    done = torch.arange(B, device="cuda") % 2 == 0
    n_new = torch.randint(0, n + 1, (B,), generator=g).cuda()
    got = fixed_memory_update(mem, x, done, cmem, comp, n_new, mem_len=512, impl="triton")
    want = fixed_memory_update_ref(mem, x, done, cmem, comp, n_new, mem_len=512)
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a, w)
