"""Triton device functions for RoPE on key tiles (contract: rope.py).

Used inside the attention kernels to rotate ``K_res @ B_k`` after the up-projection, at
the keys' absolute positions (the deferred RoPE of ResidualAttention).

No transcendental is evaluated in a kernel: cos/sin come from the float32 table of
``rope.rope_table`` (exact to float32 rounding, built in float64 once per model). A key
block at positions ``start + j`` needs two table rows per tile (``start``) plus the
``j < BLOCK_N`` rows loaded once per program, and angle addition; an earlier version that
evaluated float64 cos/sin per tile ran ResidualAttention decode 5x slower than unified.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_rows(Table, N: tl.constexpr, HALF: tl.constexpr):
    """cos, sin at positions ``0 .. N-1``: float32 ``[N, HALF]`` each.

    Table: float32 ``[n_positions, 2, HALF]`` (cos then sin), contiguous.
    """
    j = tl.arange(0, N)
    d = tl.arange(0, HALF)
    row = Table + j[:, None] * (2 * HALF) + d[None, :]
    return tl.load(row), tl.load(row + HALF)


@triton.jit
def rope_rows_at(Table, offs_n, mask, HALF: tl.constexpr):
    """cos, sin at the positions ``offs_n [N]`` (zero where not ``mask``): float32
    ``[N, HALF]`` each, straight from the table (no angle addition)."""
    d = tl.arange(0, HALF)
    row = Table + offs_n[:, None] * (2 * HALF) + d[None, :]
    return (tl.load(row, mask=mask[:, None], other=0.0),
            tl.load(row + HALF, mask=mask[:, None], other=0.0))


@triton.jit
def rope_row(Table, pos, HALF: tl.constexpr):
    """cos, sin at the scalar position ``pos``: float32 ``[HALF]`` each."""
    d = tl.arange(0, HALF)
    row = Table + pos * (2 * HALF) + d
    return tl.load(row), tl.load(row + HALF)


@triton.jit
def rope_rotate(lo, hi, cos_b, sin_b, cos_j, sin_j):
    """Rotate a key tile at positions ``start + j`` given as its two halves.

    lo, hi: float32 ``[BLOCK_N, HALF]``; cos_b, sin_b: float32 ``[HALF]`` at ``start``;
    cos_j, sin_j: float32 ``[BLOCK_N, HALF]`` at ``j``. Returns the rotated (lo, hi).
    Keeping the halves apart avoids a register shuffle for rotate-half: the caller dots
    each half with its half of q.
    """
    cos = cos_b[None, :] * cos_j - sin_b[None, :] * sin_j
    sin = sin_b[None, :] * cos_j + cos_b[None, :] * sin_j
    return lo * cos - hi * sin, hi * cos + lo * sin
