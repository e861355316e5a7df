"""kernels.adapter: batched_adapter (Triton and reference), apply_adapter and AdapterSteps on the kernel, against a
naive per-row loop written here; forward, grad h and grad m."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kernels.adapter as adapter_module
from kernels.adapter import (
    AdapterSteps,
    apply_adapter,
    apply_adapter_positions,
    apply_adapter_ref,
    batched_adapter,
    batched_adapter_ref,
)
from tests.kernels._tolerance import assert_kernel_close


def _naive(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One row at a time: out[n, :A] = h[n, :A] + M[index[n]] @ h[n, :A]."""
    A = m.shape[-1]
    rows = [torch.cat([h[n, :A] + m[int(index[n])] @ h[n, :A], h[n, A:]]) for n in range(h.shape[0])]
    return torch.stack(rows)


def _naive_grads(h: torch.Tensor, m: torch.Tensor, index: torch.Tensor, up: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """d(sum(out * up))/dh and /dm by hand: dh = up + M^T up (first A units); dM[s] = sum over s's rows up h^T."""
    A = m.shape[-1]
    dh, dm = up.clone(), torch.zeros_like(m)
    for n in range(h.shape[0]):
        s = int(index[n])
        dh[n, :A] += m[s].T @ up[n, :A]
        dm[s] += torch.outer(up[n, :A], h[n, :A])
    return dh, dm


def _index(g: torch.Generator) -> torch.Tensor:
    """37 rows over 9 sessions: unsorted, repeated, sessions 2 and 7 unused, session 4 with 20 rows (two tiles)."""
    idx = torch.tensor([4] * 20 + [0, 1, 1, 3, 3, 3, 5, 6, 6, 8, 8, 8, 8, 0, 5, 6, 1])
    return idx[torch.randperm(idx.numel(), generator=g)]


def _run(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], h: torch.Tensor, m: torch.Tensor,
         up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fn(h, m), then d(sum(out * up)) w.r.t. h and m -> (out, grad h, grad m)."""
    h, m = h.detach().requires_grad_(True), m.detach().requires_grad_(True)
    out = fn(h, m)
    (out * up).sum().backward()
    assert h.grad is not None and m.grad is not None
    return out.detach(), h.grad, m.grad


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["scan", "sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("H", "A"), [(21, 13), (19, 19)])
def test_batched_adapter_forward_backward(H: int, A: int, dtype: torch.dtype, path: str, kdev: torch.device,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kernel paths: the index scan, and rows sorted by session (forced by a zero scan limit)."""
    if path == "sorted":
        monkeypatch.setattr(adapter_module, "_SCAN_LIMIT", 0)
    g = torch.Generator().manual_seed(A)
    S = 9
    index = _index(g)
    N = index.numel()
    h = torch.randn(N, H, generator=g).to(dtype)
    m = (0.3 * torch.randn(S, A, A, generator=g)).to(dtype)
    up = torch.randn(N, H, generator=g).to(dtype)
    h64, m64, up64 = h.double(), m.double(), up.double()
    out64 = _naive(h64, m64, index)
    dh64, dm64 = _naive_grads(h64, m64, index, up64)
    truth = _run(lambda a, b: batched_adapter_ref(a, b, index), h64, m64, up64)
    for got, want in zip(truth, (out64, dh64, dm64), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    idx = index.to(kdev)
    kernel = _run(lambda a, b: batched_adapter(a, b, idx, impl="triton"), h.to(kdev), m.to(kdev), up.to(kdev))
    torch_lo = _run(lambda a, b: _naive(a, b, index), h, m, up)  # PyTorch in the kernel's dtype
    for name, k, t, lo in zip(("out", "grad h", "grad m"), kernel, truth, torch_lo, strict=True):
        assert k.dtype == dtype
        assert_kernel_close(k, t, lo, f"{name} {dtype}")
    assert torch.all(kernel[2][[2, 7]] == 0), "unused sessions get zero gradients"


@pytest.mark.parametrize("case", ["balanced", "skewed", "identity", "few_used"])
def test_batched_adapter_ref_forms(case: str) -> None:
    """Both of the reference's tilings (one tile per session; tiles of gathered adapters) against the loop."""
    g = torch.Generator().manual_seed(1)
    S, A, H = {"balanced": (6, 5, 7), "skewed": (6, 5, 5), "identity": (12, 4, 9), "few_used": (40, 3, 4)}[case]
    index = {"balanced": torch.randint(0, S, (24,), generator=g),
             "skewed": torch.tensor([2] * 17 + [0, 5]),
             "identity": torch.arange(S),
             "few_used": torch.tensor([7, 30, 7, 7, 1])}[case]
    h = torch.randn(index.numel(), H, generator=g, dtype=torch.float64)
    m = torch.randn(S, A, A, generator=g, dtype=torch.float64)
    up = torch.randn(index.numel(), H, generator=g, dtype=torch.float64)
    got = _run(lambda a, b: batched_adapter_ref(a, b, index), h, m, up)
    want = _run(lambda a, b: _naive(a, b, index), h, m, up)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    assert batched_adapter_ref(h[:0], m, index[:0]).shape == (0, H)


@pytest.mark.interpreter
def test_apply_adapter_and_steps_on_the_kernel(kdev: torch.device) -> None:
    """AdapterSteps over a small recurrence h_{t+1} = tanh(W (h_t + M h_t)): the kernel path gives the reference's
    outputs and gradients (M, h0)."""
    g = torch.Generator().manual_seed(4)
    B, H, k, T = 5, 11, 7, 4
    w = torch.randn(H, H, generator=g) / H**0.5
    h0 = torch.randn(B, H, generator=g)
    m = 0.2 * torch.randn(B, k, k, generator=g)

    def unroll(impl: str) -> tuple[torch.Tensor, ...]:
        hh, mm = h0.to(kdev).requires_grad_(True), m.to(kdev).requires_grad_(True)
        op = AdapterSteps(mm, impl=impl)
        h, total = hh, torch.zeros((), device=kdev)
        for _ in range(T):
            h = torch.tanh(op(h) @ w.to(kdev).T)
            total = total + (h * h).sum()
        total.backward()
        assert hh.grad is not None and mm.grad is not None
        return h.detach().cpu(), hh.grad.cpu(), mm.grad.cpu()

    for got, want in zip(unroll("triton"), unroll("reference"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hd, md = h0.to(kdev), m.to(kdev)
    torch.testing.assert_close(apply_adapter(hd, md, impl="triton").cpu(), apply_adapter_ref(h0, m), rtol=1e-5,
                               atol=1e-5)
    with torch.no_grad():  # the untracked path
        torch.testing.assert_close(AdapterSteps(md, impl="triton")(hd).cpu(), apply_adapter_ref(h0, m), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.interpreter
def test_batched_adapter_long_sessions(kdev: torch.device) -> None:
    """Many rows per session (chunks of 64 rows, rows split over programs): two sessions, 150 rows, H > A."""
    g = torch.Generator().manual_seed(5)
    N, H, A, S = 150, 40, 17, 2
    index = torch.randint(0, S, (N,), generator=g)
    h, m, up = torch.randn(N, H, generator=g), 0.3 * torch.randn(S, A, A, generator=g), torch.randn(N, H, generator=g)
    kernel = _run(lambda a, b: batched_adapter(a, b, index.to(kdev), impl="triton"), h.to(kdev), m.to(kdev),
                  up.to(kdev))
    want = (_naive(h, m, index), *_naive_grads(h, m, index, up))
    for got, w in zip(kernel, want, strict=True):
        torch.testing.assert_close(got.cpu(), w, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the launch without an autograd node
        torch.testing.assert_close(batched_adapter(h.to(kdev), m.to(kdev), index.to(kdev), impl="triton").cpu(),
                                   want[0], rtol=1e-4, atol=1e-4)


def test_adapter_steps_default_is_bmm() -> None:
    """One row per session takes the bmm form by default (the grouped kernel only when forced)."""
    assert AdapterSteps(torch.zeros(3, 2, 2)).impl == "reference"


def test_batched_adapter_refuses_bad_shapes() -> None:
    h, m = torch.zeros(4, 6), torch.zeros(3, 5, 5)
    with pytest.raises(ValueError, match="does not fit"):
        batched_adapter(h, torch.zeros(3, 7, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="does not fit"):
        batched_adapter(h, m, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="int32 or int64"):
        batched_adapter(h, m, torch.zeros(4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batched_adapter_on_cuda(dtype: torch.dtype) -> None:
    """256 sessions, 1024 rows, A = 256 of H = 768; forward, grad h, grad m against float64."""
    g = torch.Generator().manual_seed(0)
    N, H, A, S = 1024, 768, 256, 256
    index = torch.randint(0, S, (N,), generator=g).cuda()
    h = torch.randn(N, H, generator=g).to("cuda", dtype)
    m = (0.05 * torch.randn(S, A, A, generator=g)).to("cuda", dtype)
    up = torch.randn(N, H, generator=g).to("cuda", dtype)
    truth = _run(lambda a, b: batched_adapter_ref(a, b, index), h.double(), m.double(), up.double())
    kernel = _run(lambda a, b: batched_adapter(a, b, index, impl="triton"), h, m, up)
    torch_lo = _run(lambda a, b: batched_adapter_ref(a, b, index), h, m, up)
    for name, k, t, lo in zip(("out", "grad h", "grad m"), kernel, truth, torch_lo, strict=True):
        assert_kernel_close(k, t, lo, f"{name} {dtype}")
    steps = AdapterSteps(m[:64].float().requires_grad_(True), impl="triton")
    ref = apply_adapter_ref(h[:64].float(), m[:64].float())
    torch.testing.assert_close(steps(h[:64].float()), ref, rtol=1e-4, atol=1e-4)


def test_apply_adapter_positions_equals_a_loop_over_positions() -> None:
    """The transformers' site (one bmm over all positions) against AdapterSteps position by position: values, grad M
    and grad x."""
    g = torch.Generator().manual_seed(6)
    B, T, H, k = 3, 5, 9, 6
    x0, up = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    m0 = 0.3 * torch.randn(B, k, k, generator=g)

    def run(positions: bool) -> tuple[torch.Tensor, ...]:
        x, m = x0.clone().requires_grad_(True), m0.clone().requires_grad_(True)
        if positions:
            out = apply_adapter_positions(x, m)
        else:
            op = AdapterSteps(m)
            out = torch.stack([op(x_t) for x_t in x.unbind(1)], dim=1)
        (out * up).sum().backward()
        assert x.grad is not None and m.grad is not None
        return out.detach(), x.grad, m.grad

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
