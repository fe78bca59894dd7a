"""The glue kernels (kernels/glue.py) equal the eager functions they replace: in Fusions,
``fused.rope_qk`` over strided fused-qkv rows and ``fused.silu_mul``; in KernelAttention's
``write_kv``, the two ``index_copy_`` of K and V into their pages.

The eager side runs in float32 on the same (rounded) inputs; the kernels compute in float32
and round once, so fp32 agrees to ~1 ulp and bf16/fp16 to one rounding of the output (the
interpreter truncates fp32 -> bf16 instead of rounding: two bf16 ulps, ~1e-2 relative).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE, ON_CUDA

from forkserve.backend.torch import fused
from forkserve.backend.torch.rope import Rope, RopeConfig
from forkserve.kernels import reference, write_kv_pages
from forkserve.kernels.glue import rope_qk_triton, silu_mul_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) against the float32 eager result of the same inputs.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}


def _cos_sin(n: int, head_dim: int, dtype: torch.dtype, start: int = 0,
             rope: RopeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r = Rope(rope or RopeConfig(theta=500000.0), head_dim, DEVICE)
    return r.cos_sin(torch.arange(start, start + n, device=DEVICE) * 7, dtype)


def _strided_qkv(gen: torch.Generator, n: int, width: int, dtype: torch.dtype,
                 pad: int = 24) -> torch.Tensor:
    """[n, width] as a column slice of a wider NaN-padded buffer: a row stride above the width
    (like qkv[:, :q+k] of the fused projection), and any read outside the slice shows."""
    buf = torch.full((n, pad + width + pad), float("nan"))
    buf[:, pad:pad + width] = torch.randn(n, width, generator=gen)
    return buf.to(device=DEVICE, dtype=dtype)[:, pad:pad + width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,q_heads,kv_heads,head_dim", [
    (37, 4, 2, 64),    # T not a multiple of the token block (16)
    (5, 3, 1, 32),     # fewer tokens than a block
    (1, 8, 2, 128),    # decode batch 1
    (19, 2, 2, 48),    # head_dim / 2 = 24 is not a power of two
])
def test_rope_qk_equals_eager(dtype: torch.dtype, n: int, q_heads: int, kv_heads: int,
                              head_dim: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + head_dim)
    # q | k | v columns: the kernel rotates the first q + k heads and must not touch v's.
    qkv = _strided_qkv(gen, n, (q_heads + 2 * kv_heads) * head_dim, dtype)
    cos, sin = _cos_sin(n, head_dim, dtype, start=1000)
    out = rope_qk_triton(qkv, cos, sin, q_heads, kv_heads, head_dim)
    ref = fused.rope_qk(qkv.float(), cos.float(), sin.float(), q_heads, kv_heads, head_dim)
    assert out.shape == (n, q_heads + kv_heads, head_dim) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qk_kv_only_rows(dtype: torch.dtype) -> None:
    """The compact K path: ``rope_qk(kv, cos_rows, sin_rows, kv_heads, 0, dim)`` on a k | v
    projection of some rows, with cos/sin rows gathered by index_select; yarn's scale on cos/sin."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, head_dim, n = 2, 32, 21
    kv = torch.randn(n, 2 * kv_heads * head_dim, generator=gen).to(DEVICE, dtype)
    yarn = RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position=32)
    cos, sin = _cos_sin(40, head_dim, dtype, rope=yarn)
    rows = torch.randperm(40, generator=gen)[:n].to(DEVICE)
    cos_r, sin_r = cos.index_select(0, rows), sin.index_select(0, rows)
    out = rope_qk_triton(kv, cos_r, sin_r, kv_heads, 0, head_dim)
    ref = fused.rope_qk(kv.float(), cos_r.float(), sin_r.float(), kv_heads, 0, head_dim)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_rope_qk_long_prefill_head_groups() -> None:
    """At >= 1024 tokens a program rotates 8 heads: a head count that leaves the last group
    partial (10 = 8 + 2) must write every head once and nothing past them."""
    gen = torch.Generator().manual_seed(4)
    n, q_heads, kv_heads, head_dim = 1030, 8, 2, 32
    qkv = _strided_qkv(gen, n, (q_heads + 2 * kv_heads) * head_dim, torch.float32)
    cos, sin = _cos_sin(n, head_dim, torch.float32)
    out = rope_qk_triton(qkv, cos, sin, q_heads, kv_heads, head_dim)
    ref = fused.rope_qk(qkv, cos, sin, q_heads, kv_heads, head_dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rope_qk_empty() -> None:
    qkv = torch.empty(0, 6 * 32, device=DEVICE)
    cos, sin = _cos_sin(0, 32, torch.float32)
    assert rope_qk_triton(qkv, cos, sin, 4, 2, 32).shape == (0, 6, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,cols", [(37, 300), (1, 96), (300, 100)])
def test_silu_mul_equals_eager(dtype: torch.dtype, n: int, cols: int) -> None:
    """Odd column counts (a partial block), T not a multiple of anything, a strided input;
    300 rows take the long-prefill block size."""
    gen = torch.Generator().manual_seed(n + cols)
    gate_up = _strided_qkv(gen, n, 2 * cols, dtype) * 3  # |x| up to ~12: both tails of silu
    out = silu_mul_triton(gate_up)
    ref = fused.silu_mul(gate_up.float())
    assert out.shape == (n, cols) and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol * 3, rtol=rtol)


@pytest.mark.skipif(not ON_CUDA, reason="the Fusions dispatch picks Triton on CUDA only")
def test_fusions_pick_the_triton_glue_on_cuda() -> None:
    fx = fused.Fusions(compile=True)
    assert fx.triton and fx.rope_qk is rope_qk_triton and fx.silu_mul is silu_mul_triton
    assert fused.Fusions(compile=False).rope_qk is fused.rope_qk


def test_fusions_stay_eager_without_compile() -> None:
    fx = fused.Fusions(compile=False)
    assert not fx.triton and fx.rope_qk is fused.rope_qk and fx.silu_mul is fused.silu_mul
    fx = fused.Fusions(compile=False, triton=True)
    assert fx.rope_qk is rope_qk_triton and fx.silu_mul is silu_mul_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(2, 32), (3, 48)])
def test_write_kv_pages_equals_index_copy(dtype: torch.dtype, heads: int, head_dim: int) -> None:
    """Strided K and V rows (views into a q | k | v projection, as the model passes them) land
    bitwise in their slots of both pools; every other slot keeps its NaN."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    n, pages, page = 11, 5, 4
    qkv = torch.randn(n, (2 + 2 * heads) * head_dim, generator=gen).to(DEVICE, dtype)
    qkv = qkv.view(n, 2 + 2 * heads, head_dim)
    k, v = qkv[:, 2:2 + heads], qkv[:, 2 + heads:]
    slots = torch.randperm(pages * page, generator=gen)[:n].to(DEVICE)  # int64, like the model
    pools = [torch.full((pages, page, heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
             for _ in range(4)]
    write_kv_pages(k, v, pools[0], pools[1], slots, use_triton=True)
    reference.write_kv_pages_ref(k, v, pools[2], pools[3], slots)
    for out, ref in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    write_kv_pages(k[:0], v[:0], pools[0], pools[1], slots[:0], use_triton=True)  # no launch
