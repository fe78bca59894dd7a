"""The FRESH route's residual rebuild kernel (kernels/residual_rebuild.py) equals its eager form
(``reference.rebuild_kv_ref``, what fresh_prefill ran before): K = k + RoPE(k_res @ B_k) at
positions 0 .. n - 1 with ``Rope.cos_sin``'s signed sin, V = v + v_res @ B_v.

The eager side runs in float32 on the same (rounded) inputs; the kernel computes in float32
and rounds once, so fp32 agrees to float32 rounding and bf16 to one rounding of the output
(the interpreter truncates fp32 -> bf16: two bf16 ulps).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE, ON_CUDA

from forkserve.backend.torch.rope import Rope, RopeConfig
from forkserve.kernels import rebuild_kv, reference
from forkserve.kernels.residual_rebuild import rebuild_kv_triton

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2)}
PAD = 8


def _strided_kv(gen: torch.Generator, n: int, heads: int, dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v ``[n, heads, dim]`` as views of one NaN-padded kv projection ``[n, pad | k | v |
    pad]`` with a gap between heads: row and head strides above the dense ones, and any read
    outside the views shows as NaN."""
    width = 2 * heads * (dim + PAD)
    buf = torch.full((n, PAD + width + PAD), float("nan"))
    kv = buf[:, PAD:PAD + width].view(n, 2, heads, dim + PAD)[..., :dim]
    kv.copy_(torch.randn(n, 2, heads, dim, generator=gen))
    buf = buf.to(DEVICE, dtype)
    view = buf[:, PAD:PAD + width].view(n, 2, heads, dim + PAD)[..., :dim]
    return view[:, 0], view[:, 1]


def _case(n: int, heads: int, dim: int, rank: int, slots: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k, v = _strided_kv(gen, n, heads, dim, dtype)
    # residual rows as column slices of one NaN-padded [n, pad | k_res | v_res | pad] buffer:
    # the kernel pads the rank to 16 and must not let the columns past r in (0 * NaN)
    res = torch.full((n, PAD + 2 * rank + PAD), float("nan"))
    res[:, PAD:PAD + 2 * rank] = torch.randn(n, 2 * rank, generator=gen)
    res = res.to(DEVICE, dtype)
    k_res, v_res = res[:, PAD:PAD + rank], res[:, PAD + rank:PAD + 2 * rank]
    # B stacks with NaN rows past r (the padded rank's rows must not be read either)
    b = torch.full((2, slots, rank + PAD, heads * dim), float("nan"))
    b[:, :, :rank] = torch.randn(2, slots, rank, heads * dim, generator=gen) * 0.3
    b = b.to(DEVICE, dtype)[:, :, :rank]
    rope = Rope(RopeConfig(theta=500000.0), dim, DEVICE)
    cos, sin = rope.cos_sin(torch.arange(n + 5, device=DEVICE), dtype)  # more rows than n
    return k, v, k_res, v_res, b[0], b[1], cos, sin


def _ref32(k, v, k_res, v_res, b_k, b_v, cos, sin):
    f = [None if x is None else x.float() for x in (k, v, k_res, v_res, b_k, b_v, cos, sin)]
    return reference.rebuild_kv_ref(*f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,heads,dim,rank", [
    (100, 2, 128, 16),   # n not a multiple of the 64-row block
    (37, 3, 64, 8),      # rank 8 padded to the dot's 16; odd head count
    (130, 2, 64, 16),    # three row blocks
])
def test_rebuild_equals_eager(dtype: torch.dtype, n: int, heads: int, dim: int,
                              rank: int) -> None:
    k, v, k_res, v_res, b_k, b_v, cos, sin = _case(n, heads, dim, rank, 3, dtype, n + dim)
    for slot in (0, 2):
        out_k, out_v = rebuild_kv_triton(k, v, k_res, v_res, b_k[slot], b_v[slot], cos, sin)
        ref_k, ref_v = _ref32(k, v, k_res, v_res, b_k[slot], b_v[slot], cos, sin)
        assert out_k.shape == out_v.shape == (n, heads, dim) and out_k.dtype == dtype
        assert out_k.is_contiguous() and out_v.is_contiguous()
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out_k.float(), ref_k, atol=atol, rtol=rtol)
        torch.testing.assert_close(out_v.float(), ref_v, atol=atol, rtol=rtol)
    # a different slot's B gives a different K: the slot's matrices are the ones read
    assert not torch.allclose(out_k.float(), rebuild_kv_triton(
        k, v, k_res, v_res, b_k[0], b_v[0], cos, sin)[0].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_groups(dtype: torch.dtype) -> None:
    """Long prefills rebuild several heads a program: 3 heads in groups of 2 leave the last
    group partial, which must write its one head and nothing past it."""
    k, v, k_res, v_res, b_k, b_v, cos, sin = _case(40, 3, 64, 16, 2, dtype, 5)
    out_k, out_v = rebuild_kv_triton(k, v, k_res, v_res, b_k[1], b_v[1], cos, sin,
                                     heads_per_prog=2)
    ref_k, ref_v = _ref32(k, v, k_res, v_res, b_k[1], b_v[1], cos, sin)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out_k.float(), ref_k, atol=atol, rtol=rtol)
    torch.testing.assert_close(out_v.float(), ref_v, atol=atol, rtol=rtol)


def test_one_side_and_dispatch() -> None:
    """b_k or b_v None: that side comes back as given; ``rebuild_kv`` picks the kernel only
    where asked (CPU tensors: the eager form), and falls back to the eager form for a head dim
    the kernel cannot take (48), even when asked."""
    k, v, k_res, v_res, b_k, b_v, cos, sin = _case(70, 2, 64, 16, 2, torch.float32, 1)
    ref_k, ref_v = _ref32(k, v, k_res, v_res, b_k[1], b_v[1], cos, sin)
    out_k, out_v = rebuild_kv_triton(k, v, k_res, v_res, None, b_v[1], None, None)
    assert out_k is k
    torch.testing.assert_close(out_v, ref_v, atol=1e-4, rtol=1e-4)
    out_k, out_v = rebuild_kv_triton(k, v, k_res, None, b_k[1], None, cos, sin)
    assert out_v is v
    torch.testing.assert_close(out_k, ref_k, atol=1e-4, rtol=1e-4)
    out_k, out_v = rebuild_kv(k, v, k_res, v_res, b_k[1], b_v[1], cos, sin, use_triton=True)
    torch.testing.assert_close(out_k, ref_k, atol=1e-4, rtol=1e-4)
    if not ON_CUDA:  # default: eager off CUDA
        out_k, _ = rebuild_kv(k, v, k_res, v_res, b_k[1], b_v[1], cos, sin)
        torch.testing.assert_close(out_k, ref_k, atol=1e-5, rtol=1e-5)
    k48, v48, kr, vr, bk, bv, c, s = _case(5, 2, 48, 4, 1, torch.float32, 2)
    out_k, _ = rebuild_kv(k48, v48, kr, vr, bk[0], bv[0], c, s, use_triton=True)
    torch.testing.assert_close(out_k, _ref32(k48, v48, kr, vr, bk[0], bv[0], c, s)[0])
    with pytest.raises(ValueError, match="head dim"):
        rebuild_kv_triton(k48, v48, kr, vr, bk[0], bv[0], c, s)
