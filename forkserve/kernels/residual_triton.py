"""Triton device functions shared by the ResidualAttention kernels (decode, its two-pass
score kernel, prefill): where a key tile's residual rows live, and the rebuilt residual
keys RoPE(K_res B_k) at the tile's absolute positions (deferred RoPE)."""
from __future__ import annotations

import triton
import triton.language as tl

from forkserve.kernels.rope_triton import rope_rotate, rope_row


@triton.jit
def residual_offsets(ResBlockTables, table_row, offs_n, mask, stride_rp, stride_rs,
                     PAGE_SIZE: tl.constexpr):
    """Flat offsets (int64, before the rank column) of keys ``offs_n`` in the residual pools,
    through the sequence's residual block table starting at ``ResBlockTables + table_row``."""
    rpage = tl.load(ResBlockTables + table_row + offs_n // PAGE_SIZE, mask=mask, other=0)
    return rpage.to(tl.int64) * stride_rp + (offs_n % PAGE_SIZE) * stride_rs


@triton.jit
def rotated_residual_keys(kr, bk_lo, bk_hi, RopeTable, start, cos_j, sin_j, HALF: tl.constexpr):
    """RoPE(K_res B_k) for a key tile at positions ``start + j``: its rank-r rows ``kr``
    up-projected by the two halves of B_k, then rotated. Float32 halves (lo, hi)."""
    up_lo = tl.dot(kr, bk_lo)
    up_hi = tl.dot(kr, bk_hi)
    cos_b, sin_b = rope_row(RopeTable, start, HALF)
    return rope_rotate(up_lo, up_hi, cos_b, sin_b, cos_j, sin_j)
