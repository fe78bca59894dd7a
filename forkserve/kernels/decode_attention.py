"""Paged decode attention (unified) and ResidualAttention decode, in Triton.

One kernel serves both layouts: with ``HAS_RES`` the key tile is rebuilt in SRAM as
``K = K_base + RoPE(K_res @ B_k)`` (RoPE deferred to after the up-projection, at the
keys' absolute positions) and the value path keeps a rank-r accumulator ``acc_r`` over
``V_res`` that is rescaled by the same online-softmax factor as ``acc``; ``B_v`` is applied
once per split after the key loop (matrix associativity, seed 001 section 7).

Work split (flash-decoding): grid ``(seq_groups, n_kv_heads, num_splits)``. A program
owns one KV head, a contiguous range of keys and a tile of query rows that all read
those keys: the GQA group of one sequence (``SEQS = 1``) or the GQA groups of several
sequences that share the pages (``SEQS > 1``, used by shared-prefix decode). Each program
writes a partial (normalised output, log2-sum-exp); ``merge_partials`` combines them.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from forkserve.kernels.rope import cached_rope_table
from forkserve.kernels.rope_triton import rope_rotate, rope_row, rope_rows

LOG2E = 1.4426950408889634
# A key range of at most this many positions is not split further (the merge costs more).
MIN_SPLIT_TOKENS = 256
NO_LIMIT = 2 ** 30


@triton.jit
def _decode_partial_kernel(
    Q, K, V, KR, VR, BK, BV, RopeTable,
    BlockTables, ResBlockTables, SeqLens, AdapterIdx,
    PartOut, PartLse,
    batch, qk_scale, rank, kv_start, kv_limit, split_len, split_offset,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_rp, stride_rs,
    stride_ba, stride_br,
    stride_bt, stride_rbt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, SEQS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_SCORE: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_g = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, BLOCK_H)
    row_seq = pid_g * SEQS + rows // GROUP
    row_head = kvh * GROUP + rows % GROUP
    row_ok = (rows < SEQS * GROUP) & (row_seq < batch)
    lead = pid_g * SEQS  # every row of the tile reads this sequence's pages

    seq_len = tl.load(SeqLens + lead)
    kv_end = tl.minimum(seq_len, kv_limit)
    start = kv_start + split * split_len
    stop = tl.minimum(start + split_len, kv_end)

    d_lo = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    q_ptr = Q + row_seq[:, None] * stride_qb + row_head[:, None] * stride_qh
    q_lo = tl.load(q_ptr + d_lo[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF + d_lo[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    if HAS_RES:
        adapter = tl.load(AdapterIdx + lead)
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
        acc_r = tl.zeros([BLOCK_H, RANK], tl.float32)

    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        page = tl.load(BlockTables + lead * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        kv_off = page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks + kvh * stride_kh
        k_lo = tl.load(K + kv_off[:, None] + d_lo[None, :], mask=n_ok[:, None], other=0.0)
        k_hi = tl.load(K + kv_off[:, None] + HALF + d_lo[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if HAS_RES:
            rn_ok = n_ok & has_ad
            rpage = tl.load(ResBlockTables + lead * stride_rbt + offs_n // PAGE_SIZE, mask=rn_ok, other=0)
            r_off = rpage.to(tl.int64) * stride_rp + (offs_n % PAGE_SIZE) * stride_rs
            res_mask = rn_ok[:, None] & r_ok[None, :]
            kr = tl.load(KR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
            vr = tl.load(VR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
            # Deferred RoPE: up-project the rank-r residual keys, then rotate them at their
            # absolute positions start_n + j.
            up_lo = tl.dot(kr, bk_lo)
            up_hi = tl.dot(kr, bk_hi)
            cos_b, sin_b = rope_row(RopeTable, start_n, HALF)
            rot_lo, rot_hi = rope_rotate(up_lo, up_hi, cos_b, sin_b, cos_j, sin_j)
            if SPLIT_SCORE:
                # q.(K_base + K_lora) = q.K_base + q.K_lora: the base tile feeds its dot
                # straight from memory, so the compiler's cp.async pipelining keeps it in
                # flight; adding K_lora into it first routes it through registers and
                # exposes the paged-load latency on every tile.
                s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
                s += tl.dot(q_lo, tl.trans(rot_lo.to(q_lo.dtype)))
                s += tl.dot(q_hi, tl.trans(rot_hi.to(q_lo.dtype)))
            else:
                # K = K_base + K_lora rebuilt in registers, one score product (fewer flops).
                k_lo = (k_lo.to(tl.float32) + rot_lo).to(q_lo.dtype)
                k_hi = (k_hi.to(tl.float32) + rot_hi).to(q_lo.dtype)
                s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
        else:
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if HAS_RES:
            # Same rescale as acc: acc_r is the softmax-weighted sum of V_res rows.
            acc_r = acc_r * alpha[:, None] + tl.dot(p.to(vr.dtype), vr)
        m_i = m_new

    if HAS_RES:
        acc += tl.dot(acc_r, bv.to(tl.float32))
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    slot = split_offset + split
    o_ptr = PartOut + row_seq[:, None] * stride_ob + row_head[:, None] * stride_oh + slot * stride_os
    tl.store(o_ptr + d[None, :], out, mask=row_ok[:, None])
    tl.store(PartLse + row_seq * stride_lb + row_head * stride_lh + slot, lse, mask=row_ok)


@triton.jit
def _merge_kernel(PartOut, PartLse, Out, Lse, num_splits,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  stride_fb, stride_fh,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_ok = s < num_splits
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
    part = tl.load(PartOut + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                   mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / total
    tl.store(Out + b * stride_fb + h * stride_fh + d, out.to(Out.dtype.element_ty))
    tl.store(Lse + b * tl.num_programs(1) + h, m + tl.log2(total))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_splits(n_programs: int, span: int, device: torch.device, block_n: int,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len) for a key span of ``span`` positions.

    Enough splits for ~2 waves of programs on the device, never splits shorter than
    MIN_SPLIT_TOKENS; ``split_len`` is a multiple of ``block_n`` so RoPE block starts stay
    aligned. ``num_splits`` forces a count (tests use it to exercise the merge).
    """
    span = max(span, 1)
    if num_splits is None:
        want = max(1, -(-2 * _sm_count(device) // max(n_programs, 1)))
        num_splits = max(1, min(want, span // MIN_SPLIT_TOKENS))
    split_len = -(-span // num_splits)
    split_len = -(-split_len // block_n) * block_n
    return -(-span // split_len), split_len


def decode_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor, *,
                    scale: float, kv_start: int, kv_limit: int, num_splits: int, split_len: int,
                    split_offset: int, seqs_per_program: int = 1,
                    residual: tuple | None = None, block_n: int = 64, num_warps: int = 4,
                    num_stages: int = 2, split_score: bool = False) -> None:
    """Launch the partial kernel over keys ``[kv_start, min(seq_len, kv_limit))``.

    q ``[batch, H, D]``; k, v pools ``[pages, P, Hkv, D]``; part_out ``[batch, H, S, D]``
    float32 and part_lse ``[batch, H, S]`` float32, written at split slots
    ``split_offset .. split_offset + num_splits``. ``residual`` is
    ``(k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, rope_table)`` or None
    (``rope_table`` from ``rope.cached_rope_table``, covering every key position).
    With ``seqs_per_program > 1`` consecutive sequences share one program and must have
    the same pages over the key range (they read the pages of the group's first one).
    ``split_score`` (residual only) scores ``q.K_base + q.K_lora`` with two products
    instead of rebuilding ``K`` in registers first: same math, see the kernel.
    """
    batch, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    assert k.stride() == v.stride() and k.stride(-1) == 1 and q.stride(-1) == 1
    block_h = max(16, triton.next_power_of_2(group * seqs_per_program))
    if residual is not None:
        assert seqs_per_program == 1, "residual rows need their own adapter"
        k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, rope_tab = residual
        assert k_res.stride() == v_res.stride() and b_k_all.stride() == b_v_all.stride()
        rank = b_k_all.shape[1]
        assert k_res.shape[-1] == rank, "residual pools and B matrices disagree on rank"
        rank_pad = max(16, triton.next_power_of_2(rank))
        res_strides = (k_res.stride(0), k_res.stride(1), b_k_all.stride(0), b_k_all.stride(1))
        rbt_stride = res_bt.stride(0)
    else:
        k_res = v_res = res_bt = b_k_all = b_v_all = adapter_idx = rope_tab = None
        rank, rank_pad, res_strides, rbt_stride = 0, 16, (0, 0, 0, 0), 0
    grid = (-(-batch // seqs_per_program), n_kv, num_splits)
    _decode_partial_kernel[grid](
        q, k, v, k_res, v_res, b_k_all, b_v_all, rope_tab,
        block_tables, res_bt, seq_lens, adapter_idx, part_out, part_lse,
        batch, scale * LOG2E, rank, kv_start, kv_limit, split_len, split_offset,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        *res_strides, block_tables.stride(0), rbt_stride,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, SEQS=seqs_per_program, BLOCK_H=block_h, HEAD_DIM=head_dim,
        PAGE_SIZE=k.shape[1], BLOCK_N=block_n, RANK=rank_pad, HAS_RES=residual is not None,
        SPLIT_SCORE=split_score,
        num_warps=num_warps, num_stages=num_stages,
    )


def merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   num_splits: int) -> torch.Tensor:
    """Combine split partials by log-sum-exp into ``out [batch, H, D]``; returns the
    per-row log2-sum-exp ``[batch, H]`` (float32)."""
    batch, n_heads, _, head_dim = part_out.shape
    lse = torch.empty(batch, n_heads, dtype=torch.float32, device=out.device)
    _merge_kernel[(batch, n_heads)](
        part_out, part_lse, out, lse, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return lse


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float | None, max_seq_len: int | None,
            num_splits: int | None, residual: tuple | None, block_n: int, num_warps: int,
            num_stages: int, split_score: bool = False) -> torch.Tensor:
    batch, n_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # one host sync; callers that know it pass it
    splits, split_len = plan_splits(batch * k.shape[2], max_seq_len, q.device, block_n, num_splits)
    if residual is not None:  # swap inv_freq for its cos/sin table
        residual = (*residual[:-1], cached_rope_table(residual[-1], max_seq_len))
    part_out = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, n_heads, splits, dtype=torch.float32, device=q.device)
    decode_partials(q, k, v, block_tables, seq_lens, part_out, part_lse, scale=scale,
                    kv_start=0, kv_limit=NO_LIMIT, num_splits=splits, split_len=split_len,
                    split_offset=0, residual=residual, block_n=block_n, num_warps=num_warps,
                    num_stages=num_stages, split_score=split_score)
    out = torch.empty_like(q)
    merge_partials(part_out, part_lse, out, splits)
    return out


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float | None = None, max_seq_len: int | None = None,
                        num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                        num_stages: int = 2) -> torch.Tensor:
    """Decode over the unified paged cache. q ``[batch, H, D]`` -> ``[batch, H, D]``."""
    return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, num_splits,
                   None, block_n, num_warps, num_stages)


def residual_decode_triton(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                           k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                           res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                           inv_freq: torch.Tensor, scale: float | None = None,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
                           split_score: bool = False) -> torch.Tensor:
    """ResidualAttention decode over the disaggregated cache (see module docstring).
    Defaults are the H200 tuning of benchmarks/results/kernel_bench.json."""
    residual = (k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, inv_freq)
    return _decode(q, k_base, v_base, block_tables, seq_lens, scale, max_seq_len, num_splits,
                   residual, block_n, num_warps, num_stages, split_score)
