"""Paged decode attention (unified) and ResidualAttention decode, in Triton.

One kernel serves both layouts: with ``HAS_RES`` the key tile is rebuilt in SRAM as
``K = K_base + RoPE(K_res @ B_k)`` (RoPE deferred to after the up-projection, at the
keys' absolute positions) and the value path keeps a rank-r accumulator ``acc_r`` over
``V_res`` that is rescaled by the same online-softmax factor as ``acc``; ``B_v`` is applied
once per split after the key loop (matrix associativity, seed 001 section 7).

ResidualAttention decode has three variants (``residual_decode_triton(variant=...)``, same
math): ``"fused"`` is the per-tile rebuild above; ``"two_pass"`` (default) first writes the
residual score ``q.RoPE(K_res B_k)`` of every key and head (``residual_scores``), then runs
the unified loop with that score added (``RES_BIAS``) plus ``acc_r``, so neither pass holds
the rebuild's registers; ``"chunked"`` alternates the two passes per chunk in one launch.
H200 numbers and register counts: docs/KERNELS.md.

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
from forkserve.kernels.residual_triton import residual_offsets, rotated_residual_keys
from forkserve.kernels.rope_triton import rope_rows

LOG2E = 1.4426950408889634
# A key range of at most this many positions is not split further (the merge costs more).
MIN_SPLIT_TOKENS = 256
NO_LIMIT = 2 ** 30


@triton.jit
def _decode_partial_kernel(
    Q, K, V, KR, VR, BK, BV, RopeTable, Bias,
    BlockTables, ResBlockTables, SeqLens, AdapterIdx,
    PartOut, PartLse, TileSeqs, TileLens, KvStarts,
    batch, qk_scale, rank, kv_start, kv_limit, split_len, split_offset,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_rp, stride_rs,
    stride_ba, stride_br,
    stride_bt, stride_rbt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_sb, stride_sh,
    GROUP: tl.constexpr, SEQS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_SCORE: tl.constexpr,
    RES_BIAS: tl.constexpr, TILED: tl.constexpr = False, SEQ_START: tl.constexpr = False,
    DYN_SPLIT: tl.constexpr = False,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_g = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, BLOCK_H)
    row_head = kvh * GROUP + rows % GROUP
    if TILED:
        # Cascade prefix: the rows are the GQA groups of the sequences tile pid_g lists (-1:
        # none); all of them read the same pages up to the tile's prefix length.
        row_seq = tl.load(TileSeqs + pid_g * SEQS + rows // GROUP, mask=rows < SEQS * GROUP, other=-1)
        row_ok = row_seq >= 0
        row_seq = tl.maximum(row_seq, 0)
        first = tl.load(TileSeqs + pid_g * SEQS)
        lead = tl.maximum(first, 0)
        kv_end = tl.where(first >= 0, tl.minimum(tl.load(SeqLens + lead), tl.load(TileLens + pid_g)), 0)
    else:
        row_seq = pid_g * SEQS + rows // GROUP
        row_ok = (rows < SEQS * GROUP) & (row_seq < batch)
        lead = pid_g * SEQS  # every row of the tile reads this sequence's pages
        kv_end = tl.minimum(tl.load(SeqLens + lead), kv_limit)
    if SEQ_START:
        key_start = tl.load(KvStarts + lead)  # cascade suffix: after the group's shared prefix
    else:
        key_start = kv_start
    if DYN_SPLIT:
        # Split this sequence's own key range (graph-safe: no host bound on its length).
        span = tl.maximum(kv_end - key_start, 0)
        key_split = tl.cdiv(tl.cdiv(span, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    else:
        key_split = split_len
    start = key_start + split * key_split
    stop = tl.minimum(start + key_split, kv_end)

    d_lo = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    q_ptr = Q + row_seq[:, None] * stride_qb + row_head[:, None] * stride_qh
    q_lo = tl.load(q_ptr + d_lo[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF + d_lo[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    if HAS_RES and TILED:
        # Split-form cascade: rows of several adapters share the tile's base keys. A row's
        # residual score comes from the score pass; the full score is written back for the
        # value pass (``residual_values``), which adds the row's own V residual.
        s_ptr = Bias + row_seq[:, None] * stride_sb + row_head[:, None] * stride_sh
        s_rows = row_ok & (tl.load(AdapterIdx + row_seq, mask=row_ok, other=-1) >= 0)
    elif HAS_RES:
        adapter = tl.load(AdapterIdx + lead)
        has_ad = adapter >= 0
        a_safe = tl.maximum(adapter, 0)
        r = tl.arange(0, RANK)
        r_ok = (r < rank) & has_ad
        if not RES_BIAS:
            b_row = BK + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM
            bk_lo = tl.load(b_row + d_lo[None, :], mask=r_ok[:, None], other=0.0)
            bk_hi = tl.load(b_row + HALF + d_lo[None, :], mask=r_ok[:, None], other=0.0)
            cos_j, sin_j = rope_rows(RopeTable, BLOCK_N, HALF)
        else:
            s_ptr = Bias + row_seq[:, None] * stride_sb + row_head[:, None] * stride_sh
            s_rows = row_ok & has_ad
        acc_r = tl.zeros([BLOCK_H, RANK], tl.float32)

    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        page = tl.load(BlockTables + lead * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        kv_off = page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks + kvh * stride_kh
        k_lo = tl.load(K + kv_off[:, None] + d_lo[None, :], mask=n_ok[:, None], other=0.0)
        k_hi = tl.load(K + kv_off[:, None] + HALF + d_lo[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if HAS_RES and not TILED:
            rn_ok = n_ok & has_ad
            r_off = residual_offsets(ResBlockTables, lead * stride_rbt, offs_n, rn_ok, stride_rp, stride_rs,
                                     PAGE_SIZE)
            res_mask = rn_ok[:, None] & r_ok[None, :]
            vr = tl.load(VR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
        if HAS_RES and RES_BIAS:
            # Two-pass: q.RoPE(K_res B_k) for these keys was written by the score kernel.
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
            s += tl.load(s_ptr + offs_n[None, :], mask=s_rows[:, None] & n_ok[None, :],
                         other=0.0).to(tl.float32)
        elif HAS_RES:
            kr = tl.load(KR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
            rot_lo, rot_hi = rotated_residual_keys(kr, bk_lo, bk_hi, RopeTable, start_n, cos_j, sin_j, HALF)
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
        if HAS_RES and TILED:
            tl.store(s_ptr + offs_n[None, :], s, mask=s_rows[:, None] & n_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if HAS_RES and not TILED:
            # Same rescale as acc: acc_r is the softmax-weighted sum of V_res rows.
            acc_r = acc_r * alpha[:, None] + tl.dot(p.to(vr.dtype), vr)
        m_i = m_new

    if HAS_RES and not TILED:
        bv = tl.load(BV + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM + d[None, :],
                     mask=r_ok[:, None], other=0.0)
        acc += tl.dot(acc_r, bv.to(tl.float32))
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    slot = split_offset + split
    o_ptr = PartOut + row_seq[:, None] * stride_ob + row_head[:, None] * stride_oh + slot * stride_os
    tl.store(o_ptr + d[None, :], out, mask=row_ok[:, None])
    tl.store(PartLse + row_seq * stride_lb + row_head * stride_lh + slot, lse, mask=row_ok)


@triton.jit
def _residual_decode_chunked_kernel(
    Q, K, V, KR, VR, BK, BV, RopeTable, Bias,
    BlockTables, ResBlockTables, SeqLens, AdapterIdx,
    PartOut, PartLse,
    batch, qk_scale, rank, split_len,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_rp, stride_rs,
    stride_ba, stride_br,
    stride_bt, stride_rbt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_sb, stride_sh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, RANK_K: tl.constexpr, CHUNK: tl.constexpr,
):
    """ResidualAttention decode in one launch, chunk by chunk: for each ``CHUNK`` keys of
    the program's split, first the residual scores ``q.RoPE(K_res B_k)`` of the chunk are
    computed and written to the ``Bias`` scratch (phase A, tensor-core work), then the
    unified loop streams the chunk's base K/V, adds the scores and accumulates ``acc_r``
    (phase B, memory-bound). The two phases are separate loops, so their registers are
    not live together (the fused rebuild holds both); the programs resident on an SM drift
    apart, so one's phase A overlaps another's phase B. Same math as two-pass.
    Grid ``(batch, n_kv, splits)``.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, BLOCK_H)
    row_head = kvh * GROUP + rows
    row_ok = rows < GROUP
    seq_len = tl.load(SeqLens + b)
    start = split * split_len
    stop = tl.minimum(start + split_len, seq_len)

    d_lo = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    q_ptr = Q + b * stride_qb + row_head[:, None] * stride_qh
    q_lo = tl.load(q_ptr + d_lo[None, :], mask=row_ok[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF + d_lo[None, :], mask=row_ok[:, None], other=0.0)

    adapter = tl.load(AdapterIdx + b)
    has_ad = adapter >= 0
    a_safe = tl.maximum(adapter, 0)
    r = tl.arange(0, RANK)
    r_ok = (r < rank) & has_ad
    rk = tl.arange(0, RANK_K)
    rk_ok = (rk < rank) & has_ad
    b_row = BK + a_safe * stride_ba + rk[:, None] * stride_br + kvh * HEAD_DIM
    s_ptr = Bias + b * stride_sb + row_head[:, None] * stride_sh
    s_rows = row_ok & has_ad

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    acc_r = tl.zeros([BLOCK_H, RANK], tl.float32)

    for c0 in range(start, stop, CHUNK):
        c1 = tl.minimum(c0 + CHUNK, stop)
        # Phase A: residual scores of keys [c0, c1); no work without an adapter.
        a_stop = tl.where(has_ad, c1, c0)
        for sn in range(c0, a_stop, BLOCK_N):
            offs_n = sn + tl.arange(0, BLOCK_N)
            n_ok = offs_n < c1
            r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, n_ok, stride_rp, stride_rs, PAGE_SIZE)
            kr = tl.load(KR + r_off[:, None] + rk[None, :], mask=n_ok[:, None] & rk_ok[None, :], other=0.0)
            bk_lo = tl.load(b_row + d_lo[None, :], mask=rk_ok[:, None], other=0.0)
            bk_hi = tl.load(b_row + HALF + d_lo[None, :], mask=rk_ok[:, None], other=0.0)
            # cos/sin rows at positions 0..BLOCK_N (the same rows for every tile: L1) and
            # at sn, combined by angle addition (rope_triton.py).
            cos_j, sin_j = rope_rows(RopeTable, BLOCK_N, HALF)
            rot_lo, rot_hi = rotated_residual_keys(kr, bk_lo, bk_hi, RopeTable, sn, cos_j, sin_j, HALF)
            sc = tl.dot(q_lo, tl.trans(rot_lo.to(q_lo.dtype)))
            sc += tl.dot(q_hi, tl.trans(rot_hi.to(q_lo.dtype)))
            tl.store(s_ptr + offs_n[None, :], sc.to(Bias.dtype.element_ty),
                     mask=s_rows[:, None] & n_ok[None, :])
        # Phase A's scores are read back by other threads of this program.
        tl.debug_barrier()
        # Phase B: the unified loop over [c0, c1) plus the score bias and acc_r.
        for start_n in range(c0, c1, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < c1
            page = tl.load(BlockTables + b * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
            kv_off = page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks + kvh * stride_kh
            k_lo = tl.load(K + kv_off[:, None] + d_lo[None, :], mask=n_ok[:, None], other=0.0)
            k_hi = tl.load(K + kv_off[:, None] + HALF + d_lo[None, :], mask=n_ok[:, None], other=0.0)
            v = tl.load(V + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            rn_ok = n_ok & has_ad
            r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, rn_ok, stride_rp, stride_rs, PAGE_SIZE)
            vr = tl.load(VR + r_off[:, None] + r[None, :], mask=rn_ok[:, None] & r_ok[None, :], other=0.0)
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
            s += tl.load(s_ptr + offs_n[None, :], mask=s_rows[:, None] & n_ok[None, :],
                         other=0.0).to(tl.float32)
            s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            acc_r = acc_r * alpha[:, None] + tl.dot(p.to(vr.dtype), vr)
            m_i = m_new

    bv = tl.load(BV + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM + d[None, :],
                 mask=r_ok[:, None], other=0.0)
    acc += tl.dot(acc_r, bv.to(tl.float32))
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    o_ptr = PartOut + b * stride_ob + row_head[:, None] * stride_oh + split * stride_os
    tl.store(o_ptr + d[None, :], out, mask=row_ok[:, None])
    tl.store(PartLse + b * stride_lb + row_head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _residual_score_kernel(
    Q, KR, BK, RopeTable, ResBlockTables, SeqLens, AdapterIdx, Bias,
    rank, chunk_len, n_kv,
    stride_qb, stride_qh, stride_rp, stride_rs, stride_ba, stride_br, stride_rbt,
    stride_sb, stride_sh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr,
    KEYS_M: tl.constexpr = False,
):
    """Pass 1 of two-pass ResidualAttention decode: ``Bias[b, h, n] = q[b, h] . RoPE_n(K_res[n] B_k)``
    for every key ``n`` of a chunk of sequence ``b``, all heads (unscaled scores).

    Grid ``(batch, chunks)``. A key tile's residual rows and cos/sin rows (read straight
    from the table at the keys' absolute positions) are loaded once and reused by every KV
    head; per head the tile is up-projected (``K_res @ B_k``, two rank-r products), rotated,
    and multiplied by the head's GQA group of queries. Sequences without an adapter skip
    the work (pass 2 never reads their bias).
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    adapter = tl.load(AdapterIdx + b)
    a_safe = tl.maximum(adapter, 0)
    seq_len = tl.load(SeqLens + b)
    start = chunk * chunk_len
    stop = tl.minimum(start + chunk_len, seq_len)
    stop = tl.where(adapter >= 0, stop, start)

    rows = tl.arange(0, BLOCK_H)
    g_ok = rows < GROUP
    r = tl.arange(0, RANK)
    r_ok = r < rank
    d_lo = tl.arange(0, HALF)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, n_ok, stride_rp, stride_rs, PAGE_SIZE)
        kr = tl.load(KR + r_off[:, None] + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        t_row = RopeTable + offs_n[:, None] * (2 * HALF) + d_lo[None, :]
        cos = tl.load(t_row, mask=n_ok[:, None], other=0.0)
        sin = tl.load(t_row + HALF, mask=n_ok[:, None], other=0.0)
        for kvh in range(n_kv):
            b_row = BK + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM
            bk_lo = tl.load(b_row + d_lo[None, :], mask=r_ok[:, None], other=0.0)
            bk_hi = tl.load(b_row + HALF + d_lo[None, :], mask=r_ok[:, None], other=0.0)
            up_lo = tl.dot(kr, bk_lo)
            up_hi = tl.dot(kr, bk_hi)
            rot_lo = up_lo * cos - up_hi * sin
            rot_hi = up_hi * cos + up_lo * sin
            heads = kvh * GROUP + rows
            if KEYS_M:
                # Keys as M: the rotated tile is the A operand straight from the up-product's
                # accumulator (no transpose through shared memory); q^T is [HALF, BLOCK_H].
                qt_ptr = Q + b * stride_qb + heads[None, :] * stride_qh
                qt_lo = tl.load(qt_ptr + d_lo[:, None], mask=g_ok[None, :], other=0.0)
                qt_hi = tl.load(qt_ptr + HALF + d_lo[:, None], mask=g_ok[None, :], other=0.0)
                sct = tl.dot(rot_lo.to(qt_lo.dtype), qt_lo)
                sct += tl.dot(rot_hi.to(qt_lo.dtype), qt_hi)
                o_ptr = Bias + b * stride_sb + heads[None, :] * stride_sh + offs_n[:, None]
                tl.store(o_ptr, sct.to(Bias.dtype.element_ty), mask=n_ok[:, None] & g_ok[None, :])
            else:
                q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
                q_lo = tl.load(q_ptr + d_lo[None, :], mask=g_ok[:, None], other=0.0)
                q_hi = tl.load(q_ptr + HALF + d_lo[None, :], mask=g_ok[:, None], other=0.0)
                sc = tl.dot(q_lo, tl.trans(rot_lo.to(q_lo.dtype)))
                sc += tl.dot(q_hi, tl.trans(rot_hi.to(q_lo.dtype)))
                o_ptr = Bias + b * stride_sb + heads[:, None] * stride_sh + offs_n[None, :]
                tl.store(o_ptr, sc.to(Bias.dtype.element_ty), mask=g_ok[:, None] & n_ok[None, :])


@triton.jit
def _residual_value_kernel(
    Scores, VR, BV, ResBlockTables, AdapterIdx, KvStarts, PartOut, PartLse,
    rank, stride_sb, stride_sh, stride_rp, stride_rs, stride_ba, stride_br, stride_rbt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, RANK: tl.constexpr,
):
    """Split-form cascade, after the tiled prefix launch: adds a row's V residual to each of
    its prefix partials, ``(sum_n exp2(s_n - lse) V_res[n]) B_v``, from the scores ``s`` and
    the partial's log2-sum-exp ``lse`` that launch wrote (so already normalised like the
    partial). Grid ``(batch, n_kv, prefix splits)``, the splits laid out as the prefix
    launch's (``BLOCK_N``, ``KvStarts`` = the row's prefix length)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    adapter = tl.load(AdapterIdx + b)
    span = tl.where(adapter >= 0, tl.load(KvStarts + b), 0)
    key_split = tl.cdiv(tl.cdiv(span, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * key_split
    stop = tl.minimum(start + key_split, span)
    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    row_ok = (rows < GROUP) & (start < stop)
    lse = tl.load(PartLse + b * stride_lb + heads * stride_lh + split, mask=row_ok, other=0.0)
    r = tl.arange(0, RANK)
    r_ok = r < rank
    d = tl.arange(0, HEAD_DIM)
    acc_r = tl.zeros([BLOCK_H, RANK], tl.float32)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        ok = row_ok[:, None] & n_ok[None, :]
        s = tl.load(Scores + b * stride_sb + heads[:, None] * stride_sh + offs_n[None, :], mask=ok, other=0.0)
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, n_ok, stride_rp, stride_rs, PAGE_SIZE)
        vr = tl.load(VR + r_off[:, None] + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc_r += tl.dot(p.to(vr.dtype), vr)
    bv = tl.load(BV + tl.maximum(adapter, 0) * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM + d[None, :],
                 mask=r_ok[:, None], other=0.0)
    o_ptr = PartOut + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    part = tl.load(o_ptr, mask=row_ok[:, None], other=0.0)
    tl.store(o_ptr, part + tl.dot(acc_r, bv.to(tl.float32)), mask=row_ok[:, None])


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
    # A slot with no keys may never have been written (cascade: rows of no tile): skip its read.
    live = s_ok & (lse > float("-inf"))
    part = tl.load(PartOut + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                   mask=live[:, None], other=0.0)
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
                    num_stages: int = 2, split_score: bool = False,
                    res_bias: torch.Tensor | None = None,
                    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                    kv_starts: torch.Tensor | None = None) -> None:
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
    ``res_bias`` (residual only): ``[batch, H, >= max key]`` residual scores written by
    ``residual_scores``; the kernel adds them to ``q.K_base`` instead of rebuilding keys
    (two-pass ResidualAttention), so ``B_k`` and the RoPE table are not read.
    ``tiles`` (cascade prefix): ``(tile_seqs [n_tiles, seqs] int32, tile_lens [n_tiles] int32)``;
    program ``g`` serves the sequences ``tile_seqs[g]`` lists (-1: none) over keys
    ``[kv_start, tile_lens[g])`` of the first one's pages; rows of no tile are not written.
    ``kv_starts`` (cascade suffix): ``[batch]`` int32, each sequence's first key instead of
    ``kv_start``. With either, ``split_len`` is ignored: each program splits its own
    sequence's range in ``num_splits`` (graph-safe, no host bound needed).
    """
    batch, n_heads, head_dim = q.shape
    if tiles is not None:
        seqs_per_program = tiles[0].shape[1]
    n_kv = k.shape[2]
    group = n_heads // n_kv
    assert k.stride() == v.stride() and k.stride(-1) == 1 and q.stride(-1) == 1
    block_h = max(16, triton.next_power_of_2(group * seqs_per_program))
    if residual is not None:
        # Rows of several sequences share a program only as a cascade tile (score pass required).
        assert seqs_per_program == 1 or (tiles is not None and res_bias is not None)
        k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, rope_tab = residual
        assert k_res.stride() == v_res.stride() and b_k_all.stride() == b_v_all.stride()
        rank = b_k_all.shape[1]
        assert k_res.shape[-1] == rank, "residual pools and B matrices disagree on rank"
        # Two-pass: acc_r and V_res padded to 32 columns. A 16-wide p @ V_res product
        # compiles to 255 registers with spills on sm_90 (112-126 at 32; --regs).
        rank_pad = max(32 if res_bias is not None else 16, triton.next_power_of_2(rank))
        res_strides = (k_res.stride(0), k_res.stride(1), b_k_all.stride(0), b_k_all.stride(1))
        rbt_stride = res_bt.stride(0)
    else:
        k_res = v_res = res_bt = b_k_all = b_v_all = adapter_idx = rope_tab = None
        rank, rank_pad, res_strides, rbt_stride = 0, 16, (0, 0, 0, 0), 0
    if res_bias is not None:
        assert residual is not None and res_bias.stride(-1) == 1
        bias_strides = (res_bias.stride(0), res_bias.stride(1))
    else:
        bias_strides = (0, 0)
    programs = tiles[0].shape[0] if tiles is not None else -(-batch // seqs_per_program)
    tile_seqs, tile_lens = tiles if tiles is not None else (None, None)
    _decode_partial_kernel[(programs, n_kv, num_splits)](
        q, k, v, k_res, v_res, b_k_all, b_v_all, rope_tab, res_bias,
        block_tables, res_bt, seq_lens, adapter_idx, part_out, part_lse,
        tile_seqs, tile_lens, kv_starts,
        batch, scale * LOG2E, rank, kv_start, kv_limit, split_len, split_offset,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        *res_strides, block_tables.stride(0), rbt_stride,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), *bias_strides,
        GROUP=group, SEQS=seqs_per_program, BLOCK_H=block_h, HEAD_DIM=head_dim,
        PAGE_SIZE=k.shape[1], BLOCK_N=block_n, RANK=rank_pad, HAS_RES=residual is not None,
        SPLIT_SCORE=split_score, RES_BIAS=res_bias is not None, TILED=tiles is not None,
        SEQ_START=kv_starts is not None, DYN_SPLIT=tiles is not None or kv_starts is not None,
        num_warps=num_warps, num_stages=num_stages,
    )


def residual_scores(q: torch.Tensor, k_res: torch.Tensor, res_block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, b_k_all: torch.Tensor, adapter_idx: torch.Tensor,
                    rope_table: torch.Tensor, n_kv: int, max_seq_len: int, *,
                    dtype: torch.dtype | None = None, block_n: int = 32, num_warps: int = 4,
                    num_stages: int = 2, chunk: int | None = None,
                    keys_m: bool = False) -> torch.Tensor:
    """Pass 1 of two-pass ResidualAttention decode: ``[batch, H, max_seq_len]`` with
    ``q[b, h] . RoPE_n(K_res[b, n] B_k[adapter_b])`` (unscaled) at every key ``n < seq_len``
    of a sequence with an adapter; other entries are left unwritten.

    ``dtype``: float32 for float32 queries, else float16 (10-bit mantissa on a score term
    of a few units: ~1e-3 absolute, below the bf16 rounding of K itself; half the bytes).
    ``chunk``: keys per program (default: enough programs for ~2 waves). ``block_n=32``:
    128 registers, no spills on sm_90 (64: 240; see ``kernel_bench.py --regs``).
    ``keys_m``: score the rotated tile as ``rot @ q^T`` (keys as M). At ``block_n=64`` the
    compiler then uses wgmma with the rotated tile as a register operand (no shared-memory
    transpose, no replicated warps) at 217 registers; two-pass decode's default
    (``SCORE_TUNING``), faster on the H200 at batch >= 8 (docs/KERNELS.md).
    """
    batch, n_heads, head_dim = q.shape
    group = n_heads // n_kv
    if dtype is None:
        dtype = torch.float32 if q.dtype == torch.float32 else torch.float16
    span = max(max_seq_len, 1)
    bias = torch.empty(batch, n_heads, span, dtype=dtype, device=q.device)
    if chunk is None:
        want = max(1, -(-2 * _sm_count(q.device) // max(batch, 1)))
        chunk = -(-span // want)
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    rank = b_k_all.shape[1]
    grid = (batch, -(-span // chunk))
    _residual_score_kernel[grid](
        q, k_res, b_k_all, rope_table, res_block_tables, seq_lens, adapter_idx, bias,
        rank, chunk, n_kv,
        q.stride(0), q.stride(1), k_res.stride(0), k_res.stride(1),
        b_k_all.stride(0), b_k_all.stride(1), res_block_tables.stride(0),
        bias.stride(0), bias.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=k_res.shape[1], BLOCK_N=block_n, RANK=max(16, triton.next_power_of_2(rank)),
        KEYS_M=keys_m, num_warps=num_warps, num_stages=num_stages,
    )
    return bias


def residual_values(scores: torch.Tensor, v_res: torch.Tensor, b_v_all: torch.Tensor,
                    res_block_tables: torch.Tensor, adapter_idx: torch.Tensor, kv_starts: torch.Tensor,
                    part_out: torch.Tensor, part_lse: torch.Tensor, n_kv: int, num_splits: int,
                    block_n: int) -> None:
    """The split-form cascade's value pass (see its kernel): ``scores`` as the tiled prefix
    launch left them, its partials at slots ``0 .. num_splits``, its ``block_n``."""
    batch, n_heads, _, head_dim = part_out.shape
    group = n_heads // n_kv
    rank = b_v_all.shape[1]
    _residual_value_kernel[(batch, n_kv, num_splits)](
        scores, v_res, b_v_all, res_block_tables, adapter_idx, kv_starts, part_out, part_lse,
        rank, scores.stride(0), scores.stride(1), v_res.stride(0), v_res.stride(1),
        b_v_all.stride(0), b_v_all.stride(1), res_block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=v_res.shape[1], BLOCK_N=block_n, RANK=max(16, triton.next_power_of_2(rank)),
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


def residual_chunked_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              residual: tuple, part_out: torch.Tensor, part_lse: torch.Tensor, *,
                              scale: float, max_seq_len: int, num_splits: int, split_len: int,
                              block_n: int = 16, chunk: int = 256, num_warps: int = 4,
                              num_stages: int = 2) -> None:
    """Launch the one-launch chunked ResidualAttention decode (see its kernel) over
    splits ``0 .. num_splits``; ``residual`` as in ``decode_partials`` (with the table)."""
    batch, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    group = n_heads // n_kv
    k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, rope_tab = residual
    assert k.stride() == v.stride() and k_res.stride() == v_res.stride()
    assert b_k_all.stride() == b_v_all.stride()
    rank = b_k_all.shape[1]
    assert k_res.shape[-1] == rank, "residual pools and B matrices disagree on rank"
    bias = torch.empty(batch, n_heads, max(max_seq_len, 1), device=q.device,
                       dtype=torch.float32 if q.dtype == torch.float32 else torch.float16)
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    _residual_decode_chunked_kernel[(batch, n_kv, num_splits)](
        q, k, v, k_res, v_res, b_k_all, b_v_all, rope_tab, bias,
        block_tables, res_bt, seq_lens, adapter_idx, part_out, part_lse,
        batch, scale * LOG2E, rank, split_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        k_res.stride(0), k_res.stride(1), b_k_all.stride(0), b_k_all.stride(1),
        block_tables.stride(0), res_bt.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), bias.stride(0), bias.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=k.shape[1], BLOCK_N=block_n, RANK=max(32, triton.next_power_of_2(rank)),
        RANK_K=max(16, triton.next_power_of_2(rank)), CHUNK=chunk,
        num_warps=num_warps, num_stages=num_stages,
    )


RESIDUAL_VARIANTS = ("two_pass", "chunked", "fused")
# Two-pass score kernel: keys as M at 64-key tiles (wgmma with the rotated tile as a register
# operand). On the H200 (kernel_bench_issue15.json) 1.67-2.26x unified against 1.89-2.40x for
# the 32-key default at batch >= 8, 4K-32K; 2-3% slower at batch 1 below 32K.
SCORE_TUNING = {"block_n": 64, "keys_m": True}


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float | None, max_seq_len: int | None,
            num_splits: int | None, residual: tuple | None, block_n: int, num_warps: int,
            num_stages: int, split_score: bool = False, variant: str = "fused",
            score_tuning: dict | None = None, chunk: int = 256) -> torch.Tensor:
    batch, n_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # one host sync; callers that know it pass it
    splits, split_len = plan_splits(batch * k.shape[2], max_seq_len, q.device, block_n, num_splits)
    part_out = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, n_heads, splits, dtype=torch.float32, device=q.device)
    res_bias = None
    if residual is not None:  # swap inv_freq for its cos/sin table
        assert variant in RESIDUAL_VARIANTS, f"unknown ResidualAttention variant {variant!r}"
        residual = (*residual[:-1], cached_rope_table(residual[-1], max_seq_len))
        if variant == "two_pass":
            k_res, _, res_bt, b_k_all, _, adapter_idx, rope_tab = residual
            res_bias = residual_scores(q, k_res, res_bt, seq_lens, b_k_all, adapter_idx, rope_tab,
                                       k.shape[2], max_seq_len, **(SCORE_TUNING if score_tuning is None
                                                                   else score_tuning))
    if residual is not None and variant == "chunked":
        residual_chunked_partials(q, k, v, block_tables, seq_lens, residual, part_out, part_lse,
                                  scale=scale, max_seq_len=max_seq_len, num_splits=splits,
                                  split_len=split_len, block_n=block_n, chunk=chunk,
                                  num_warps=num_warps, num_stages=num_stages)
    else:
        decode_partials(q, k, v, block_tables, seq_lens, part_out, part_lse, scale=scale,
                        kv_start=0, kv_limit=NO_LIMIT, num_splits=splits, split_len=split_len,
                        split_offset=0, residual=residual, block_n=block_n, num_warps=num_warps,
                        num_stages=num_stages, split_score=split_score, res_bias=res_bias)
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
                           block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           split_score: bool = False, variant: str = "two_pass",
                           score_tuning: dict | None = None, chunk: int = 256) -> torch.Tensor:
    """ResidualAttention decode over the disaggregated cache (see module docstring).

    ``variant`` (same math, see docs/KERNELS.md):

    * ``"two_pass"`` (default): ``residual_scores`` writes ``q.RoPE(K_res B_k)`` per key and
      head, then the unified kernel adds it to ``q.K_base`` and keeps the rank-r ``acc_r``
      (the score is additive, so the softmax is unchanged); ``score_tuning`` goes to
      ``residual_scores``.
    * ``"chunked"``: one launch that alternates the two passes per ``chunk`` keys.
    * ``"fused"``: the original kernel that rebuilds ``K`` per tile (``split_score`` picks
      its score variant).

    ``block_n`` defaults per variant (64, 16, 32).
    """
    if block_n is None:
        block_n = {"two_pass": 64, "chunked": 16, "fused": 32}.get(variant, 32)
    residual = (k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, inv_freq)
    return _decode(q, k_base, v_base, block_tables, seq_lens, scale, max_seq_len, num_splits,
                   residual, block_n, num_warps, num_stages, split_score, variant, score_tuning,
                   chunk)
