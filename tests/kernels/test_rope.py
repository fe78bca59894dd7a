"""RoPE: the Triton tile rotation equals the plain complex rotation (plain_oracle.py), far
past 4K positions; the cos/sin table; relative positions."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
import triton
import triton.language as tl
from kernel_testlib import DEVICE

from forkserve.kernels import rope as rope_mod
from forkserve.kernels.rope import (
    apply_rope,
    cached_rope_table,
    default_inv_freq,
    rope_table,
    rope_table_in,
)
from forkserve.kernels.rope_triton import rope_rotate, rope_row, rope_rows


@triton.jit
def _rotate_kernel(X, Out, Table, start, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HALF)
    lo = tl.load(X + n[:, None] * 2 * HALF + d[None, :])
    hi = tl.load(X + n[:, None] * 2 * HALF + HALF + d[None, :])
    cos_j, sin_j = rope_rows(Table, BLOCK_N, HALF)
    cos_b, sin_b = rope_row(Table, start, HALF)
    r_lo, r_hi = rope_rotate(lo, hi, cos_b, sin_b, cos_j, sin_j)
    tl.store(Out + n[:, None] * 2 * HALF + d[None, :], r_lo)
    tl.store(Out + n[:, None] * 2 * HALF + HALF + d[None, :], r_hi)


@pytest.mark.parametrize("start", [0, 4096 + 37, 131072 + 5])
def test_triton_rotation_matches_plain_rotation(start: int) -> None:
    """Angle addition over table rows equals direct rotation, far past 4K positions."""
    gen = torch.Generator().manual_seed(start)
    head_dim, block_n = 32, 16
    inv_freq = default_inv_freq(head_dim, base=500000.0).to(DEVICE)
    table = cached_rope_table(inv_freq, start + block_n)
    x = torch.randn(block_n, head_dim, generator=gen).to(DEVICE)
    out = torch.full_like(x, float("nan"))
    _rotate_kernel[(1,)](x, out, table, start, HALF=head_dim // 2, BLOCK_N=block_n)
    pos = torch.arange(start, start + block_n, device=DEVICE)
    ref = plain.rope(x.double().cpu(), pos.cpu(), inv_freq)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=1e-5)


def test_table_is_memoised_and_grows() -> None:
    inv_freq = default_inv_freq(16).to(DEVICE)
    small = cached_rope_table(inv_freq, 10)
    assert cached_rope_table(inv_freq, 100) is small
    big = cached_rope_table(inv_freq, small.shape[0] + 1)
    assert big.shape[0] >= 2 * small.shape[0]
    torch.testing.assert_close(big[: small.shape[0]], small)


def test_table_copies_are_made_once_and_go_with_their_table() -> None:
    """A table's copy in another dtype is the table rounded to it, made once; the same
    dtype is the table itself; growing the table drops the old one's copies (nothing kept
    alive) and the next call copies the grown one."""
    inv_freq = default_inv_freq(16, base=1234.0).to(DEVICE)
    small = cached_rope_table(inv_freq, 10)
    half = rope_table_in(small, torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, small.to(torch.float16))
    assert rope_table_in(small, torch.float16) is half
    assert rope_table_in(small, torch.float32) is small
    big = cached_rope_table(inv_freq, small.shape[0] + 1)
    assert not any(src is small for src, _ in rope_mod._COPIES.values())
    grown = rope_table_in(big, torch.float16)
    assert grown.shape == big.shape and torch.equal(grown, big.to(torch.float16))
    # The engine serves under inference mode, whose tensors keep no version counter.
    with torch.inference_mode():
        served = rope_table(default_inv_freq(16, base=4321.0).to(DEVICE), 8)
        assert torch.equal(rope_table_in(served, torch.float16), served.to(torch.float16))


def test_rope_scores_depend_on_distance_only() -> None:
    gen = torch.Generator().manual_seed(1)
    inv_freq = default_inv_freq(64)
    q, k = torch.randn(2, 1, 1, 64, generator=gen).unbind(0)  # [T=1, H=1, D]

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        rq = apply_rope(q, torch.tensor([q_pos]), inv_freq)
        rk = apply_rope(k, torch.tensor([k_pos]), inv_freq)
        return (rq * rk).sum()

    near, far = score(12, 5), score(9007, 9000)
    torch.testing.assert_close(near, far, atol=1e-4, rtol=1e-4)
