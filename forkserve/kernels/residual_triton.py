"""Triton device functions shared by the ResidualAttention kernels (decode, its two-pass
score kernel, prefill): where a key tile's residual rows live, the rebuilt residual keys
RoPE(K_res B_k) at the tile's absolute positions (deferred RoPE), the fused kernels'
score of a query tile against K_base plus those keys, and the base logits of a GQA group
with keys as M (the materialized-scores pass 1s: residual_score_qfold.py's ``LOGITS``
mode and residual_msc2s.py's base-logits kernel), and the q-folded ``B_k`` of the q-folded
score forms (``fold_queries``: residual_score_qfold.py's pass, the tiled one, and the
partial kernel's ``RES_FOLD``)."""
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
def residual_tile(KR, ResBlockTables, table_row, offs_n, mask, r, rank, stride_rp, stride_rs,
                  PAGE_SIZE: tl.constexpr):
    """The residual rows ``K_res[offs_n] [N, RANK]`` through the residual block table at
    ``ResBlockTables + table_row`` (zero where not ``mask`` or past ``rank``)."""
    r_off = residual_offsets(ResBlockTables, table_row, offs_n, mask, stride_rp, stride_rs,
                             PAGE_SIZE)
    return tl.load(KR + r_off[:, None] + r[None, :], mask=mask[:, None] & (r < rank)[None, :],
                   other=0.0)


@triton.jit
def residual_rows_ahead(KR, ResBlockTables, table_row, start, stop, live, r, rank, stride_rp,
                        stride_rs, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Before a tile loop that holds its residual rows a tile ahead (a score pass's
    ``PREFETCH``): the rows of the tile at ``start`` and the offsets of the one after (keys
    below ``stop``, none unless ``live``). The loop then calls ``residual_rows_step``."""
    offs = start + tl.arange(0, BLOCK_N)
    rows = residual_tile(KR, ResBlockTables, table_row, offs, (offs < stop) & live, r, rank,
                         stride_rp, stride_rs, PAGE_SIZE)
    offs += BLOCK_N
    return rows, residual_offsets(ResBlockTables, table_row, offs, (offs < stop) & live,
                                  stride_rp, stride_rs, PAGE_SIZE)


@triton.jit
def residual_rows_step(KR, ResBlockTables, table_row, start_n, stop, live, r_off_next, r, rank,
                       stride_rp, stride_rs, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """In that loop at the tile ``start_n``: the next tile's rows, from the offsets it holds
    (``r_off_next``), and the offsets of the tile after. Each load's address is in registers
    a tile before it issues, and its data a tile before its use."""
    offs = start_n + BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(KR + r_off_next[:, None] + r[None, :],
                   mask=((offs < stop) & live)[:, None] & (r < rank)[None, :], other=0.0)
    offs += BLOCK_N
    return rows, residual_offsets(ResBlockTables, table_row, offs, (offs < stop) & live,
                                  stride_rp, stride_rs, PAGE_SIZE)


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


@triton.jit
def group_queries_t(Q, q_row, kvh, stride_qh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BASE_N: tl.constexpr):
    """The GQA group of KV head ``kvh`` (sequence at ``Q + q_row``) as the N operand
    ``q^T [HEAD_DIM, BASE_N]`` of a keys-as-M product, zero past the group. At N >= 16 the
    product is a wgmma with both operands in shared memory; at N = 4 an mma with the K tile
    in registers (162 instead of 133 registers in msc's pass 1 at 64-key tiles)."""
    d = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BASE_N)
    return tl.load(Q + q_row + (kvh * GROUP + cols)[None, :] * stride_qh + d[:, None],
                   mask=(cols < GROUP)[None, :], other=0.0)


@triton.jit
def base_key_tile(K, BlockTables, table_row, offs_n, n_ok, kvh, stride_kp, stride_ks, stride_kh,
                  PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``K_base`` rows of keys ``offs_n`` of KV head ``kvh``, ``[keys, HEAD_DIM]``, through
    the sequence's block table at ``BlockTables + table_row`` (zero where not ``n_ok``)."""
    page = tl.load(BlockTables + table_row + offs_n // PAGE_SIZE, mask=n_ok, other=0)
    k_off = page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks + kvh * stride_kh
    d = tl.arange(0, HEAD_DIM)
    return tl.load(K + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)


@triton.jit
def group_base_scores(k_tile, q_t, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                      BASE_N: tl.constexpr):
    """Unscaled ``K_base @ q^T`` of a key tile against ``group_queries_t``: float32
    ``[BLOCK_N, BLOCK_G]``, column g the group's query row g."""
    base = tl.dot(k_tile, q_t)
    if BASE_N > BLOCK_G:
        # Columns past the group are zero: fold them onto the group's.
        base = tl.sum(tl.reshape(base, [BLOCK_N, BASE_N // BLOCK_G, BLOCK_G]), 1)
    return base


@triton.jit
def fold_queries(Q, BK, q_col, q_ok, b_col, b_ok, HALF: tl.constexpr):
    """The folded matrices ``Fc, Fs`` (residual_score_qfold.py's docstring), float32
    ``[HALF, columns]``: column ``c`` folds the query at ``Q + q_col[c]`` (zero where not
    ``q_ok``) into the ``B_k`` row at ``BK + b_col[c]`` (zero where not ``b_ok``); both
    offsets point at the row's first element."""
    i = tl.arange(0, HALF)[:, None]
    q_ptr = Q + q_col[None, :] + i
    q_lo = tl.load(q_ptr, mask=q_ok[None, :], other=0.0).to(tl.float32)
    q_hi = tl.load(q_ptr + HALF, mask=q_ok[None, :], other=0.0).to(tl.float32)
    b_ptr = BK + b_col[None, :] + i
    b_lo = tl.load(b_ptr, mask=b_ok[None, :], other=0.0).to(tl.float32)
    b_hi = tl.load(b_ptr + HALF, mask=b_ok[None, :], other=0.0).to(tl.float32)
    return q_lo * b_lo + q_hi * b_hi, q_hi * b_lo - q_lo * b_hi
