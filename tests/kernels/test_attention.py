"""kernels.attention: the Triton memory_attention against the pure-PyTorch reference and an independent naive
implementation (full score matrix, mask written row by row, r looked up by an explicit distance table), forward and
every gradient. CPU tensors run in the Triton interpreter; the `gpu` test runs the compiled kernels.

Tolerance (flash-attention's rule, tests/kernels/_tolerance.py): the kernel's error against a float64 computation
is at most twice the reference's error when the reference runs in the kernel's dtype, plus a tiny floor.
"""

from __future__ import annotations

import os
import sys

import torch

# The interpreter must be on before Triton is imported (it reads TRITON_INTERPRET then, and kernels.attention imports
# it at the first launch). Only where there is no GPU: the `gpu` tests need the compiled kernels.
_TRITON_IMPORTED_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from kernels import attention  # noqa: E402
from kernels._dispatch import triton_available  # noqa: E402
from kernels.attention import memory_attention, memory_attention_ref  # noqa: E402

B, H = 2, 2


def interpreted(test):  # type: ignore[no-untyped-def]
    """Marks a test that runs the kernels on CPU tensors, in the Triton interpreter."""
    needs = pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1"
                               or _TRITON_IMPORTED_EARLY,
                               reason="needs triton, imported after TRITON_INTERPRET=1 was set")
    return pytest.mark.interpreter(needs(test))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel: tuple[torch.Tensor, ...] | None,
                    scale: float, key_lengths: torch.Tensor | None) -> torch.Tensor:
    """Written from the op's contract, independently of the reference: float64, (B, H, Lq, Lk) scores."""
    q, k, v = q.double(), k.double(), v.double()
    Bq, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    visible = torch.zeros(Bq, 1, Lq, Lk, dtype=torch.bool)
    for b in range(Bq):
        first = Lk - int(key_lengths[b]) if key_lengths is not None else 0
        for i in range(Lq):
            visible[b, 0, i, max(first, 0) : Lk - Lq + i + 1] = True  # keys first .. Lk - Lq + i
    if rel is None:
        scores = torch.einsum("bhid,bhjd->bhij", q, k)
    else:
        r, u, vb = (t.double() for t in rel)
        dist = torch.tensor([[max(Lk - Lq + i - j, 0) for j in range(Lk)] for i in range(Lq)])  # (Lq, Lk)
        r_ij = r[dist]  # (Lq, Lk, H, D): r at each entry's distance
        scores = (torch.einsum("bhid,bhjd->bhij", q + u[None, :, None], k)
                  + torch.einsum("bhid,ijhd->bhij", q + vb[None, :, None], r_ij))
    scores = (scale * scores).masked_fill(~visible, -math.inf)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, Lq, D)


def _inputs(Lq: int, Lk: int, D: int, dtype: torch.dtype, rel: bool, seed: int = 0,
            device: str = "cpu", heads: int = H, batch: int = B) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x = {"q": rnd(batch, heads, Lq, D), "k": rnd(batch, heads, Lk, D), "v": rnd(batch, heads, Lk, D),
         "do": rnd(batch, heads, Lq, D)}
    if rel:
        x.update(r=0.5 * rnd(Lk + 3, heads, D), u=0.5 * rnd(heads, D), vb=0.5 * rnd(heads, D))
    return x


def _run(fn, x: dict[str, torch.Tensor], rel: bool, dtype: torch.dtype, **kw):  # type: ignore[no-untyped-def]
    """-> out and the gradients of (out * do).sum() w.r.t. q, k, v (and r, u, v_bias), leaves cast to `dtype`."""
    names = ["q", "k", "v", *(["r", "u", "vb"] if rel else [])]
    leaves = [x[n].to(dtype).requires_grad_(True) for n in names]
    rel_t = tuple(leaves[3:]) if rel else None
    out = fn(*leaves[:3], rel=rel_t, **kw)
    grads = torch.autograd.grad((out * x["do"].to(dtype)).sum(), leaves)
    return [out, *grads]


def _compare(Lq: int, Lk: int, D: int, rel: bool, key_lengths: list[int] | None, dtype: torch.dtype,
             device: str = "cpu") -> None:
    x = _inputs(Lq, Lk, D, dtype, rel, seed=Lq * 1000 + Lk + D, device=device)
    kl = torch.tensor(key_lengths, device=device) if key_lengths is not None else None
    scale = D**-0.5
    got = _run(memory_attention, x, rel, dtype, key_lengths=kl, impl="triton")
    lowp = _run(memory_attention_ref, x, rel, dtype, key_lengths=kl)  # the reference in the kernel's dtype
    exact = _run(lambda q, k, v, rel: naive_attention(q, k, v, rel, scale, kl.cpu() if kl is not None else None),
                 {n: t.cpu() for n, t in x.items()}, rel, torch.float64)
    ref64 = _run(memory_attention_ref, {n: t.cpu() for n, t in x.items()}, rel, torch.float64, key_lengths=kl)
    names = ["out", "dq", "dk", "dv", "dr", "du", "dv_bias"]
    floor = {torch.float32: 1e-6, torch.float16: 1e-4}[dtype]  # relative to the largest value
    for name, a, b, want, w_ref in zip(names, got, lowp, exact, ref64, strict=False):
        torch.testing.assert_close(w_ref, want, rtol=1e-5, atol=1e-5)  # reference == naive (its softmax is fp32)
        assert a.dtype == dtype and a.shape == want.shape, name
        err = (a.double().cpu() - want).abs().max().item()
        base = (b.double().cpu() - want).abs().max().item()
        assert err <= 2 * base + floor * max(1.0, want.abs().max().item()), f"{name}: {err:.3g} vs ref {base:.3g}"


# -- CUDA, compiled (first in the file: an interpreted launch patches triton.language while it runs) -------------


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: not compiled")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("rel", [True, False], ids=["rel", "plain"])
@pytest.mark.parametrize("D", [64, 128], ids=["d64", "d128"])  # d128: the shipped tiles' only 8-warp configuration
def test_cuda_realistic_shape(dtype: torch.dtype, rel: bool, D: int) -> None:
    Lq, Lk, heads = 128, 384, 4
    x = _inputs(Lq, Lk, D, dtype, rel, seed=11, device="cuda", heads=heads)
    kl = torch.tensor([Lk, 200], device="cuda")
    got = _run(memory_attention, x, rel, dtype, key_lengths=kl, impl="triton")
    lowp = _run(memory_attention_ref, x, rel, dtype, key_lengths=kl)
    exact = _run(memory_attention_ref, x, rel, torch.float32, key_lengths=kl)  # fp32 reference (IEEE matmuls)
    floor = {torch.float16: 1e-4, torch.bfloat16: 1e-3}[dtype]  # relative to the largest value
    for name, a, b, want in zip(["out", "dq", "dk", "dv", "dr", "du", "dv_bias"], got, lowp, exact, strict=False):
        assert a.dtype == dtype and bool(torch.isfinite(a).all()), name
        err = (a.float() - want).abs().max().item()
        base = (b.float() - want).abs().max().item()
        assert err <= 2 * base + floor * max(1.0, want.abs().max().item()), f"{name}: {err:.3g} vs ref {base:.3g}"


@pytest.mark.gpu
def test_cuda_decoding_in_key_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    # one query row per (session, head): the automatic splits (two programs per SM) and their merge, forward and
    # gradients (the merged log-sum-exp feeds the backward)
    monkeypatch.setattr(attention, "TUNING", attention.Tuning(splits=0))
    programs = B * 4
    assert attention._key_splits(0, programs, 2048, 64, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    x = _inputs(1, 2048, 64, torch.float16, True, seed=5, device="cuda", heads=4)
    kl = torch.tensor([2048, 700], device="cuda")
    got = _run(memory_attention, x, True, torch.float16, key_lengths=kl, impl="triton")
    lowp = _run(memory_attention_ref, x, True, torch.float16, key_lengths=kl)
    exact = _run(memory_attention_ref, x, True, torch.float32, key_lengths=kl)
    for name, a, b, want in zip(["out", "dq", "dk", "dv", "dr", "du", "dv_bias"], got, lowp, exact, strict=False):
        assert bool(torch.isfinite(a).all()), name
        err = (a.float() - want).abs().max().item()
        base = (b.float() - want).abs().max().item()
        assert err <= 2 * base + 1e-4 * max(1.0, want.abs().max().item()), f"{name}: {err:.3g} vs ref {base:.3g}"


@pytest.mark.gpu
def test_cuda_default_falls_back_for_other_head_dims() -> None:
    x = _inputs(9, 20, 24, torch.float16, rel=False, device="cuda")  # D = 24: no kernel, so the reference
    assert torch.equal(memory_attention(x["q"], x["k"], x["v"]), memory_attention_ref(x["q"], x["k"], x["v"]))


# -- CPU, interpreter ------------------------------------------------------------------------------------------------

# The interpreter's tiles are 16 x 16 and its cost grows with the tiles run: the odd shapes are 2 query tiles by 5 key
# tiles, both last ones partial, the causal edge off the tiles' grid, and distances past the 64 rows of r one tile
# pair reads
CASES = [  # Lq, Lk, D, rel, key_lengths (B,), dtype
    pytest.param(21, 70, 16, True, [40, 70], torch.float32, id="odd-rel-padded-f32"),
    pytest.param(21, 70, 32, False, [21, 61], torch.float16, id="odd-padded-f16"),
    pytest.param(21, 70, 64, True, None, torch.float16, id="odd-rel-d64-f16"),
    pytest.param(1, 29, 32, True, [1, 20], torch.float16, id="decode-rel-padded-f16"),
    pytest.param(1, 1, 16, False, None, torch.float32, id="single-key-f32"),
    pytest.param(24, 24, 16, True, [24, 24], torch.float16, id="no-memory-rel-f16"),
    pytest.param(19, 19, 64, False, None, torch.float32, id="no-memory-f32"),
    pytest.param(5, 70, 16, True, [9, 70], torch.float32, id="short-segment-rel-f32"),
]


@interpreted
@pytest.mark.parametrize(("Lq", "Lk", "D", "rel", "key_lengths", "dtype"), CASES)
def test_forward_and_gradients_match(Lq: int, Lk: int, D: int, rel: bool, key_lengths: list[int] | None,
                                     dtype: torch.dtype) -> None:
    _compare(Lq, Lk, D, rel, key_lengths, dtype)


@interpreted
@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)], ids=["tall-tiles", "wide-tiles"])
def test_unequal_tiles(blocks: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    # BLOCK_M != BLOCK_N: the distance range (BLOCK_M + BLOCK_N - 1 rows, padded to 64) and the tile-skip bounds
    monkeypatch.setattr(attention, "_block_sizes", lambda *a, **kw: (*blocks, 4, 1))
    _compare(37, 70, 16, True, [40, 70], torch.float32)  # 2 tiles of 32 queries, 3 of 32 keys: the last ones partial


@interpreted
def test_masking_boundary() -> None:
    # v = identity: out row i is query i's attention distribution over the keys, so visibility is read off exactly
    Lq, Lk, D = 5, 16, 16
    x = _inputs(Lq, Lk, D, torch.float32, rel=True, seed=3)
    v = torch.eye(Lk).expand(B, H, Lk, D).clone().requires_grad_(True)
    k = x["k"].clone().requires_grad_(True)
    kl = torch.tensor([Lk, 7])
    p = memory_attention(x["q"], k, v, rel=(x["r"], x["u"], x["vb"]), key_lengths=kl, impl="triton")  # (B, H, Lq, Lk)
    for i in range(Lq):
        edge = Lk - Lq + i
        assert bool((p[:, :, i, edge] > 0).all())  # key Lk - Lq + i is visible
        assert bool((p[:, :, i, edge + 1 :] == 0).all())  # key Lk - Lq + i + 1 is not
    assert bool((p[1, :, :, : Lk - 7] == 0).all()) and bool((p[1, :, :, Lk - 7] > 0).all())  # left padding
    torch.testing.assert_close(p.sum(-1), torch.ones(B, H, Lq))
    dk, dv = torch.autograd.grad((p * x["do"][..., :Lk]).sum(), [k, v])
    assert bool((dk[1, :, : Lk - 7] == 0).all()) and bool((dv[1, :, : Lk - 7] == 0).all())  # padding: no gradient
    assert bool((dk[1, :, Lk - 7 :] != 0).any())


@interpreted
def test_empty_segment() -> None:
    # Lq = 0 (nothing to attend from): empty output, zero gradients everywhere (dr too: no kernel runs)
    x = _inputs(0, 7, 16, torch.float32, rel=True)
    got = _run(memory_attention, x, True, torch.float32, impl="triton")
    assert got[0].shape == (B, H, 0, 16)
    assert all(g is not None and not bool(g.any()) for g in got[1:])


@interpreted
def test_non_contiguous_inputs() -> None:
    # the model's layout: q, k, v are (B, L, H, D) views transposed to (B, H, L, D); r is a transposed view; one tensor
    # has a strided last dimension (copied by the launcher)
    Lq, Lk, D = 13, 40, 32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Lq, H, D, generator=g).transpose(1, 2)
    k = torch.randn(B, Lk, H, D, generator=g).transpose(1, 2)
    v = torch.randn(B, H, D, Lk, generator=g).transpose(2, 3)  # stride(-1) != 1
    r = torch.randn(H, Lk, D, generator=g).transpose(0, 1)
    u, vb = torch.randn(H, D, generator=g), torch.randn(H, D, generator=g)
    kl = torch.tensor([20, 40])
    got = memory_attention(q, k, v, rel=(r, u, vb), key_lengths=kl, impl="triton")
    want = memory_attention_ref(q, k, v, rel=(r, u, vb), key_lengths=kl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@interpreted
def test_serving_forward_is_the_training_forward() -> None:
    # without gradients (serving) the launcher skips the autograd node; it must still fix the layouts the kernel
    # reads (a strided last dimension) and return the same output
    Lq, Lk, D = 7, 29, 16
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, Lq, H, D, generator=g).transpose(1, 2).requires_grad_(True)
    k = torch.randn(B, H, D, Lk, generator=g).transpose(2, 3).requires_grad_(True)  # stride(-1) != 1
    v = torch.randn(B, H, Lk, D, generator=g).requires_grad_(True)
    r = torch.randn(H, Lk, D, generator=g).transpose(0, 1).requires_grad_(True)
    u, vb = torch.randn(H, D, generator=g), torch.randn(H, D, generator=g)
    kl = torch.tensor([Lk, 20])
    trained = memory_attention(q, k, v, rel=(r, u, vb), key_lengths=kl, impl="triton")
    with torch.no_grad():
        served = memory_attention(q, k, v, rel=(r, u, vb), key_lengths=kl, impl="triton")
    assert trained.grad_fn is not None and not served.requires_grad
    assert torch.equal(served, trained.detach())
    torch.testing.assert_close(served, memory_attention_ref(q, k, v, rel=(r, u, vb), key_lengths=kl).detach(),
                               rtol=1e-5, atol=1e-5)


def test_default_on_cpu_is_the_reference() -> None:
    x = _inputs(6, 11, 24, torch.float32, rel=True)  # D = 24: the kernel could not run it
    rel = (x["r"], x["u"], x["vb"])
    assert torch.equal(memory_attention(x["q"], x["k"], x["v"], rel=rel),
                       memory_attention_ref(x["q"], x["k"], x["v"], rel=rel))


@interpreted
def test_launcher_refuses_what_the_kernel_cannot_run() -> None:
    x = _inputs(6, 11, 24, torch.float32, rel=False)
    with pytest.raises(ValueError, match="head dims"):
        memory_attention(x["q"], x["k"], x["v"], impl="triton")
    x = _inputs(6, 11, 16, torch.float32, rel=False)
    with pytest.raises(ValueError, match="dtype|float"):
        memory_attention(x["q"], x["k"].half(), x["v"], impl="triton")


SPLIT_CASES = [  # key splits: decoding, splits starting on tiles some rows cannot see, padding (empty splits)
    pytest.param("splits=3", 1, 29, 32, True, [1, 20], torch.float16, id="decode-rel-padded-f16"),
    pytest.param("splits=3", 21, 70, 16, True, [40, 70], torch.float32, id="odd-rel-padded-f32"),
    pytest.param("splits=5", 5, 70, 16, False, [5, 33], torch.float32, id="no-rel"),
    pytest.param("splits=64", 24, 24, 16, True, None, torch.float16, id="more-than-key-tiles"),
]


@interpreted
@pytest.mark.parametrize(("setting", "Lq", "Lk", "D", "rel", "key_lengths", "dtype"), SPLIT_CASES)
def test_key_splits_compute_the_same_op(setting: str, Lq: int, Lk: int, D: int, rel: bool,
                                        key_lengths: list[int] | None, dtype: torch.dtype,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the forward in key splits merged by the combine kernel; the backward reads the merged log-sum-exp
    monkeypatch.setattr(attention, "TUNING", attention.Tuning.parse(setting))
    _compare(Lq, Lk, D, rel, key_lengths, dtype)


def test_key_splits_by_sm_count() -> None:
    s = attention._key_splits
    assert s(1, 8, 4096, 64, 132) == 1  # the shipped setting: never
    assert s(0, 8, 4096, 64, 132) == 32  # 8 programs (B1 H8 decoding): capped by two key tiles a split
    assert s(0, 64, 4096, 64, 132) == 4  # B8 H8 decoding: two programs per SM
    assert s(0, 512, 4096, 64, 132) == 1  # training shapes fill the GPU
    assert s(0, 8, 100, 64, 132) == 1 and s(0, 8, 4096, 64, 0) == 1  # one key tile; off CUDA
    assert s(7, 8, 200, 64, 132) == 4  # never more splits than key tiles


def test_tuning_settings_parse_and_refuse() -> None:
    # the server validates ADAPTLM_ATTENTION_TUNING at start with parse: a removed setting is refused with the valid
    # ones named
    T = attention.Tuning
    assert T.parse("") == T() == T.parse("shipped") == T(splits=1)
    assert T.parse("splits=0") == T(splits=0) == T.parse(" shipped , splits = 0 ")
    for bad in ["fast", "rewrite", "gather16=1", "skew=smem", "tiles=v1", "half_range=1", "dr=atomic", "warps=8",
                "splits=", "splits=-1", "splits=a", "splits=0,shipped"]:
        with pytest.raises(ValueError, match="attention tuning") as info:
            T.parse(bad)
        assert "splits" in str(info.value), bad  # names the valid key
