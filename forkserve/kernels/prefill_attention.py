"""Varlen causal prefill over paged caches (unified) and ResidualAttention prefill, in Triton.

The new tokens of sequence b are its last ``q_len`` positions; their K/V (or base and
residual rows) are already in the pools, so one kernel covers a cold prefill, a prefill
after a cached prefix and a chunk of a chunked prefill.

Grid ``(ceil(max_q_len / BLOCK_M), batch, n_kv_heads)``. A program's query tile holds
BLOCK_M tokens times the (power-of-two padded) GQA group of one KV head, so each key tile
is loaded, and in the residual layout rebuilt as ``K_base + RoPE(K_res @ B_k)``, once per
KV head rather than once per query head.

Three options serve cascade prefill (shared_prefix_prefill.py), each a constexpr, so the plain
callers compile the kernel they always did: ``kv_range`` (each sequence attends only keys
``[lo, hi)`` of its table), ``q_rows`` (sequence b's token t is row ``q_rows[cu[b] + t]`` of
q and of the output: a group's members stacked without a copy) and ``lse`` (write each row's
partial, normalised by its own sum, and its log2-sum-exp for ``split_kv.merge_partials``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from forkserve.kernels.prefix_groups import gqa_pad
from forkserve.kernels.residual_triton import (
    fused_residual_score,
    residual_offsets,
    rotated_residual_keys,
)
from forkserve.kernels.rope import cached_rope_table
from forkserve.kernels.rope_triton import rope_rows
from forkserve.kernels.split_kv import store_partial

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    Q, K, V, KR, VR, BK, BV, RopeTable, Out, Lse,
    BlockTables, ResBlockTables, SeqLens, CuSeqlensQ, AdapterIdx, KvRange, QRows,
    qk_scale, rank,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kp, stride_ks, stride_kh,
    stride_rp, stride_rs,
    stride_ba, stride_br,
    stride_bt, stride_rbt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_SCORE: tl.constexpr,
    HAS_RANGE: tl.constexpr = False, HAS_ROWS: tl.constexpr = False,
    STORE_LSE: tl.constexpr = False,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    m_blk = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)

    q_begin = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_begin
    seq_len = tl.load(SeqLens + b)
    ctx = seq_len - q_len  # keys before the first new token

    rows = tl.arange(0, ROWS)
    tok = m_blk * BLOCK_M + rows // GROUP_PAD
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = ctx + tok

    d_lo = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    if HAS_ROWS:
        q_row = tl.load(QRows + q_begin + tok, mask=row_ok, other=0)
    else:
        q_row = q_begin + tok
    q_ptr = Q + q_row[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
    q_lo = tl.load(q_ptr + d_lo[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF + d_lo[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)

    if HAS_RES:
        adapter = tl.load(AdapterIdx + b)
        has_ad = adapter >= 0
        a_safe = tl.maximum(adapter, 0)
        r = tl.arange(0, RANK)
        r_ok = (r < rank) & has_ad
        b_row = BK + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM
        bk_lo = tl.load(b_row + d_lo[None, :], mask=r_ok[:, None], other=0.0)
        bk_hi = tl.load(b_row + HALF + d_lo[None, :], mask=r_ok[:, None], other=0.0)
        bv = tl.load(BV + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM + d[None, :],
                     mask=r_ok[:, None], other=0.0)
        cos_j, sin_j = rope_rows(RopeTable, BLOCK_N, HALF)
        acc_r = tl.zeros([ROWS, RANK], tl.float32)

    # Causal: the last query of this tile sits at ctx + min(q_len, (m_blk+1)*BLOCK_M) - 1.
    kv_stop = tl.minimum(seq_len, ctx + (m_blk + 1) * BLOCK_M)
    kv_stop = tl.where(m_blk * BLOCK_M < q_len, kv_stop, 0)
    kv_lo = 0
    if HAS_RANGE:
        kv_lo = tl.load(KvRange + 2 * b)
        kv_stop = tl.minimum(kv_stop, tl.load(KvRange + 2 * b + 1))
    for start_n in range(kv_lo, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_stop
        page = tl.load(BlockTables + b * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        kv_off = page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks + kvh * stride_kh
        k_lo = tl.load(K + kv_off[:, None] + d_lo[None, :], mask=n_ok[:, None], other=0.0)
        k_hi = tl.load(K + kv_off[:, None] + HALF + d_lo[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if HAS_RES:
            rn_ok = n_ok & has_ad
            r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, rn_ok, stride_rp,
                                     stride_rs, PAGE_SIZE)
            res_mask = rn_ok[:, None] & r_ok[None, :]
            kr = tl.load(KR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
            vr = tl.load(VR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
            rot_lo, rot_hi = rotated_residual_keys(kr, bk_lo, bk_hi, RopeTable, start_n, cos_j,
                                                   sin_j, HALF)
            s = fused_residual_score(q_lo, q_hi, k_lo, k_hi, rot_lo, rot_hi, SPLIT_SCORE)
        else:
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        # Rows with no visible key yet (padding rows) keep m = -inf; guard the exp2.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if HAS_RES:
            # Same rescale as acc: acc_r is the softmax-weighted sum of V_res rows.
            acc_r = acc_r * alpha[:, None] + tl.dot(p.to(vr.dtype), vr)
        m_i = m_new

    if HAS_RES:
        acc += tl.dot(acc_r, bv.to(tl.float32))
    o_ptr = Out + q_row[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
    if STORE_LSE:
        store_partial(acc, l_i, m_i, o_ptr, Lse + q_row.to(tl.int64) * stride_lt
                      + head * stride_lh, row_ok, d)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def prefill_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, scale: float | None, max_q_len: int | None,
                   max_seq_len: int | None, residual: tuple | None, block_m: int | None,
                   block_n: int, num_warps: int, num_stages: int, split_score: bool = False,
                   kv_range: torch.Tensor | None = None, q_rows: torch.Tensor | None = None,
                   partial: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The kernel's one launch (every public entry point's, shared_prefix_prefill.py's two);
    ``kv_range`` ``[batch, 2]`` and ``q_rows`` int32 as in the module docstring;
    ``partial``: (out ``[T, H, D]``, lse ``[T, H]``) float32 views the kernel writes
    (``STORE_LSE``), returned as out."""
    total, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    group_pad = triton.next_power_of_2(group)
    assert k.stride() == v.stride() and k.stride(-1) == 1 and q.stride(-1) == 1
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one host sync
    if block_m is None:  # 64 query rows a program, H200-tuned (the residual kernel's caller
        block_m = max(1, 64 // group_pad)  # names its own: residual_launch)
    out, lse = (torch.empty_like(q), None) if partial is None else partial
    batch = seq_lens.numel()
    if residual is not None:
        k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, inv_freq = residual
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # one host sync
        rope_tab = cached_rope_table(inv_freq, max_seq_len)
        assert k_res.stride() == v_res.stride() and b_k_all.stride() == b_v_all.stride()
        rank = b_k_all.shape[1]
        assert k_res.shape[-1] == rank, "residual pools and B matrices disagree on rank"
        rank_pad = max(16, triton.next_power_of_2(rank))
        res_strides = (k_res.stride(0), k_res.stride(1), b_k_all.stride(0), b_k_all.stride(1))
        rbt_stride = res_bt.stride(0)
    else:
        k_res = v_res = res_bt = b_k_all = b_v_all = adapter_idx = rope_tab = None
        rank, rank_pad, res_strides, rbt_stride = 0, 16, (0, 0, 0, 0), 0
    grid = (max(1, -(-max_q_len // block_m)), batch, n_kv)
    _prefill_kernel[grid](
        q, k, v, k_res, v_res, b_k_all, b_v_all, rope_tab, out, lse,
        block_tables, res_bt, seq_lens, cu_seqlens_q, adapter_idx, kv_range, q_rows,
        scale * LOG2E, rank,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *((0, 0) if lse is None else lse.stride()),
        k.stride(0), k.stride(1), k.stride(2), *res_strides,
        block_tables.stride(0), rbt_stride,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim,
        PAGE_SIZE=k.shape[1], BLOCK_N=block_n, RANK=rank_pad, HAS_RES=residual is not None,
        SPLIT_SCORE=split_score, HAS_RANGE=kv_range is not None, HAS_ROWS=q_rows is not None,
        STORE_LSE=lse is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, scale: float | None = None,
                         max_q_len: int | None = None, max_seq_len: int | None = None,
                         block_m: int | None = None, block_n: int = 64, num_warps: int = 4,
                         num_stages: int = 2) -> torch.Tensor:
    """Varlen causal prefill over the unified paged cache. q ``[total_new, H, D]``."""
    return prefill_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                          max_q_len, max_seq_len, None, block_m, block_n, num_warps, num_stages)


# The fused residual prefill's launch when the caller names none, by the batch's longest
# chunk (H200, Llama-3-8B heads, GQA 4, rank 16; ``benchmarks/prefill_tiles_bench.py``,
# prefill_tiles.json, measured at GQA 4 only): 32 tokens a program (128 query rows) on 8
# warps was the fastest or within 7% of it on 1K / 4K cold prefills and 8 x 64 / 8 x 512
# chunks over 8K (0.36-0.59x the 4-warp launch it replaced); chunks of at most 16 tokens
# (32 x 16 over 8K) ran fastest at 16 tokens on 4 warps (0.78 ms against 1.20).
SHORT_CHUNK_TOKENS = 16


def residual_launch(max_q_len: int | None) -> tuple[int, int]:
    """(query rows per program, warps) of the fused residual prefill for a batch whose
    longest chunk is ``max_q_len`` (None: unknown, the long-chunk launch); a program holds
    rows // (padded GQA group) tokens."""
    if max_q_len is not None and max_q_len <= SHORT_CHUNK_TOKENS:
        return 64, 4
    return 128, 8


def residual_prefill_triton(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                            k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                            res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, b_k_all: torch.Tensor,
                            b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                            inv_freq: torch.Tensor, scale: float | None = None,
                            max_q_len: int | None = None, max_seq_len: int | None = None,
                            block_m: int | None = None, block_n: int = 64,
                            num_warps: int | None = None, num_stages: int = 2,
                            split_score: bool = False) -> torch.Tensor:
    """ResidualAttention varlen causal prefill over the disaggregated cache.
    ``max_q_len`` / ``max_seq_len`` spare a host sync each when the caller knows them;
    ``block_m`` (tokens per program) / ``num_warps`` left None take ``residual_launch``'s."""
    rows, warps = residual_launch(max_q_len)
    if block_m is None:
        block_m = max(1, rows // gqa_pad(q.shape[1], k_base.shape[2]))
    residual = (k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, inv_freq)
    return prefill_launch(q, k_base, v_base, block_tables, seq_lens, cu_seqlens_q, scale,
                          max_q_len, max_seq_len, residual, block_m, block_n,
                          warps if num_warps is None else num_warps, num_stages, split_score)
