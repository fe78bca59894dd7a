"""Triton device functions shared by the ResidualAttention kernels (decode, its two-pass
score kernel, prefill): where a key tile's residual rows live, the rebuilt residual keys
RoPE(K_res B_k) at the tile's absolute positions (deferred RoPE), and the fused kernels'
score of a query tile against K_base plus those keys."""
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


@triton.jit
def fused_residual_score(q_lo, q_hi, k_lo, k_hi, rot_lo, rot_hi, SPLIT_SCORE: tl.constexpr):
    """Unscaled ``q.(K_base + RoPE(K_res B_k))`` for a key tile, by halves of D: the base
    tile ``k_lo, k_hi`` and the rotated residual keys ``rot_lo, rot_hi`` (float32)."""
    if SPLIT_SCORE:
        # q.(K_base + K_lora) = q.K_base + q.K_lora: the base tile feeds its dot straight
        # from memory, so the compiler's cp.async pipelining keeps it in flight; adding
        # K_lora into it first routes it through registers and exposes the paged-load
        # latency on every tile.
        s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
        s += tl.dot(q_lo, tl.trans(rot_lo.to(q_lo.dtype)))
        s += tl.dot(q_hi, tl.trans(rot_hi.to(q_lo.dtype)))
    else:
        # K = K_base + K_lora rebuilt in registers, one score product (fewer flops).
        k_lo = (k_lo.to(tl.float32) + rot_lo).to(q_lo.dtype)
        k_hi = (k_hi.to(tl.float32) + rot_hi).to(q_lo.dtype)
        s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
    return s
