"""Triton device functions for RoPE on key tiles (contract: rope.py).

Used inside the attention kernels to rotate ``K_res @ B_k`` after the up-projection, at
the keys' absolute positions (the deferred RoPE of ResidualAttention).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_offset_table(inv_freq, BLOCK_N: tl.constexpr):
    """cos/sin of ``j * inv_freq`` for ``j < BLOCK_N``: float32 ``[BLOCK_N, HALF]``.

    Computed once per program; each key block then needs only HALF transcendentals for
    its start angle (angle addition), not BLOCK_N * HALF, which keeps the residual
    decode memory-bound instead of bound on special-function throughput.
    inv_freq: float32 ``[HALF]``.
    """
    j = tl.arange(0, BLOCK_N).to(tl.float64)
    angle = j[:, None] * inv_freq.to(tl.float64)[None, :]
    return tl.cos(angle).to(tl.float32), tl.sin(angle).to(tl.float32)


@triton.jit
def rope_rotate(lo, hi, start, cos_j, sin_j, inv_freq):
    """Rotate a key tile at positions ``start + j`` given as its two halves.

    lo, hi: float32 ``[BLOCK_N, HALF]``; start: scalar int (absolute position of row 0);
    cos_j, sin_j: from ``rope_offset_table``; inv_freq: float32 ``[HALF]``.
    Returns the rotated (lo, hi). Keeping the halves apart avoids a register shuffle
    for rotate-half: the caller dots each half with its half of q.
    """
    base = inv_freq.to(tl.float64) * start
    cos_b = tl.cos(base).to(tl.float32)[None, :]
    sin_b = tl.sin(base).to(tl.float32)[None, :]
    cos = cos_b * cos_j - sin_b * sin_j
    sin = sin_b * cos_j + cos_b * sin_j
    return lo * cos - hi * sin, hi * cos + lo * sin
