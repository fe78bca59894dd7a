"""ResidualAttention decode over the disaggregated cache, in Triton: its variants and the
kernels only the residual path uses.

Same math in every variant (``residual_decode_triton(variant=...)``); the score is
additive, ``q.K = q.K_base + q.RoPE(K_res B_k)``:

* ``"two_pass"`` (default): ``residual_scores`` writes the residual score of every key and
  head, then decode_attention.py's partial kernel adds it to ``q.K_base`` (``RES_BIAS``)
  and keeps the rank-r ``acc_r`` over ``V_res``, so neither pass holds the rebuild's
  registers; by default on unified decode's dynamic split plan, with each tile's bias and
  residual table entries loaded a tile ahead (``plan``, ``prefetch``);
* ``"three_pass"``: two-pass without ``acc_r`` in the partial kernel, which writes every
  score back (``VALUE_PASS``); ``residual_values`` then adds each split's
  ``(sum_n exp2(s_n - lse) V_res[n]) B_v`` to its partial before the merge, as the
  split-form cascade does after its prefix launch;
* ``"chunked"``: both passes in one launch, alternating per chunk of keys;
* ``"fused"``: the partial kernel rebuilds each key tile ``K_base + RoPE(K_res B_k)``;
* ``"folded"``: one launch on the dynamic plan whose key loop scores each tile's residual as
  the q-folded pass 1 does (``RES_FOLD``: two products against the tile's cos/sin rows, a
  rank contraction), beside the K/V stream instead of before it (1.46-1.93x unified on the
  H200 against two-pass's 1.32-1.42x: the products run in series with the stream of the same
  warps; docs/KERNELS.md "Round 17");
* ``"msc"`` (materialized scores, residual_msc.py): pass 1 reads K_base and K_res and writes
  every head's whole logits, pass 2 reads only them, V_base and V_res;
* ``"msc2s"`` (residual_msc2s.py): msc with pass 1's halves as two kernels on two streams
  (base logits from K_base; the q-folded residual score), pass 2 summing both;
* ``"ws"`` (residual_decode_gluon.py, Gluon on sm_90, the shapes of its ``supports``): one
  warp-specialized launch, a loader warp gathering each tile by TMA while a warp group runs
  the q-folded products, the softmax and the value products.

``residual_values`` is the split-form cascade's value pass (shared_prefix.py). Score
scratch buffers are temporaries of one call. H200 numbers: docs/KERNELS.md.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from forkserve.kernels.decode_attention import PLANS, decode_partials
from forkserve.kernels.residual_msc import MSC_TUNING, residual_logits
from forkserve.kernels.residual_msc2s import MSC2S_TUNING, split_logits
from forkserve.kernels.residual_score_qfold import qfold_scores, score_chunk, whole_tiles
from forkserve.kernels.residual_triton import (
    residual_offsets,
    residual_rows_ahead,
    residual_rows_step,
    residual_tile,
    rotated_residual_keys,
)
from forkserve.kernels.rope import cached_rope_table, rope_table_in
from forkserve.kernels.rope_triton import rope_rows
from forkserve.kernels.score_progress import ScoreProgress, score_progress
from forkserve.kernels.split_kv import (
    LOG2E,
    NO_LIMIT,
    dynamic_split_decode,
    dynamic_splits,
    empty_partials,
    key_bound,
    merge_partials,
    sm_count,
    split_decode,
    store_partial,
)
from forkserve.kernels.streams import row_pipeline

RESIDUAL_VARIANTS = ("two_pass", "three_pass", "chunked", "fused", "folded", "msc", "msc2s",
                     "ws")
# The split plans each variant runs on, its default first (any other: "static" alone), and
# the variants whose partial kernel can load each tile's bias / residual table entries ahead
# (``prefetch``, on by default for them).
VARIANT_PLANS = {"two_pass": ("dynamic", "static"), "folded": ("dynamic",)}
PREFETCHING = ("two_pass", "folded")
# Pass 1's forms (``residual_scores(form=...)``).
SCORE_FORMS = ("rotate", "qfold")
# The value pass's grids (``residual_values(grid=...)``, ``value_launch_grid``); the default,
# "row", reads each row's V_res once for all heads (H200, 8K x 32: 3.5x faster than one
# program per KV head with float16 scores; docs/KERNELS.md "H200, round 11").
VALUE_GRIDS = ("kv_head", "row")
DEFAULT_VALUE_GRID = "row"
# Two-pass score kernel per batch size, from the H200's round-15 runs
# (kernel_bench_decode_round15_kv_heads.json, 4K-32K; docs/KERNELS.md "Round 15"): the
# q-folded pass reading cos/sin rows from the table in the queries' dtype (table16: the bf16
# rows it rounded to before its dots anyway; pass 1 0.50 -> 0.37x unified at batch >= 32)
# with two KV heads per program sharing each tile's rows (one product N = 128). At batch 1
# and above 32, 128-key tiles over 8 warps (1.35-1.42x unified); at batch 2-32 64-key tiles
# over 4 warps (1.34-1.47x); each tile's residual rows loaded a tile ahead (prefetch: no
# change measured, kept for the gather it takes off each tile's path). Rows: (largest
# batch, tuning). The rotate form (keys_m, the batch 2-16 pick of decode v4) and the fp32
# table stay options.
_QFOLD16 = {"form": "qfold", "angle_add": False, "table16": True, "prefetch": True,
            "kv_heads": 2}
SCORE_TUNING_BY_BATCH: tuple[tuple[int, dict], ...] = (
    (1, {**_QFOLD16, "block_n": 128, "num_warps": 8}),
    (32, {**_QFOLD16, "block_n": 64}),
    (2**31, {**_QFOLD16, "block_n": 128, "num_warps": 8}),
)


# ``follow``'s defaults: pass 1's programs for about ``waves`` waves (pass 2 starts once
# the last has started), each publishing after every ``segment`` keys.
FOLLOW_TUNING = {"waves": 2, "segment": 512}


def score_dtype_for(q: torch.Tensor) -> torch.dtype:
    """A residual score buffer's dtype for queries ``q``: float32 for float32 queries, else
    float16 (10-bit mantissa on a score term of a few units: ~1e-3 absolute, below the bf16
    rounding of K itself; half the bytes)."""
    return torch.float32 if q.dtype == torch.float32 else torch.float16


def score_buffer(q: torch.Tensor, max_seq_len: int,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """An unwritten residual score buffer ``[batch, H, max(max_seq_len, 1)]`` for queries
    ``q`` (``dtype``: default ``score_dtype_for(q)``)."""
    return torch.empty(q.shape[0], q.shape[1], max(max_seq_len, 1),
                       dtype=score_dtype_for(q) if dtype is None else dtype, device=q.device)


def block_maxima(scores: torch.Tensor, block_n: int) -> torch.Tensor | None:
    """Where a write-back of ``scores`` keeps each float16 score relative to its
    ``block_n``-key block's row max, those maxima: an unwritten float32 ``[batch, H, key
    blocks]``; None for float32 scores (kept whole)."""
    if scores.dtype == torch.float32:
        return None
    batch, n_heads, span = scores.shape
    return torch.empty(batch, n_heads, -(-span // block_n), dtype=torch.float32,
                       device=scores.device)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s compute capability (None off CUDA). Cached: the decode calls ask on every
    eager layer call."""
    if device.type != "cuda":
        return None
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


def programmatic_launches(device: torch.device) -> bool:
    """Whether ``device`` launches a kernel programmatically after another (``pdl``):
    CUDA, sm_90 or later."""
    capability = cuda_capability(device)
    return capability is not None and capability >= (9, 0)


def score_tuning_for(batch: int) -> dict:
    """The score pass's tuning for ``batch`` rows (``SCORE_TUNING_BY_BATCH``). A CUDA graph
    captures one batch bucket, so the choice is fixed per captured graph."""
    return next(t for bound, t in SCORE_TUNING_BY_BATCH if batch <= bound)


# Key tile per variant (H200-tuned).
DEFAULT_BLOCK_N = {"two_pass": 64, "three_pass": 64, "chunked": 16, "fused": 32, "folded": 64,
                   "msc": 64, "msc2s": 64}


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
            r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, n_ok, stride_rp,
                                     stride_rs, PAGE_SIZE)
            kr = tl.load(KR + r_off[:, None] + rk[None, :], mask=n_ok[:, None] & rk_ok[None, :],
                         other=0.0)
            bk_lo = tl.load(b_row + d_lo[None, :], mask=rk_ok[:, None], other=0.0)
            bk_hi = tl.load(b_row + HALF + d_lo[None, :], mask=rk_ok[:, None], other=0.0)
            # cos/sin rows at positions 0..BLOCK_N (the same rows for every tile: L1) and
            # at sn, combined by angle addition (rope_triton.py).
            cos_j, sin_j = rope_rows(RopeTable, BLOCK_N, HALF)
            rot_lo, rot_hi = rotated_residual_keys(kr, bk_lo, bk_hi, RopeTable, sn, cos_j, sin_j,
                                                   HALF)
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
            kv_off = (page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks
                      + kvh * stride_kh)
            k_lo = tl.load(K + kv_off[:, None] + d_lo[None, :], mask=n_ok[:, None], other=0.0)
            k_hi = tl.load(K + kv_off[:, None] + HALF + d_lo[None, :], mask=n_ok[:, None],
                           other=0.0)
            v = tl.load(V + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
            rn_ok = n_ok & has_ad
            r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, rn_ok, stride_rp,
                                     stride_rs, PAGE_SIZE)
            vr = tl.load(VR + r_off[:, None] + r[None, :], mask=rn_ok[:, None] & r_ok[None, :],
                         other=0.0)
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
    store_partial(acc, l_i, m_i,
                  PartOut + b * stride_ob + row_head[:, None] * stride_oh + split * stride_os,
                  PartLse + b * stride_lb + row_head * stride_lh + split, row_ok, d)



@triton.jit
def _residual_score_kernel(
    Q, KR, BK, RopeTable, ResBlockTables, SeqLens, AdapterIdx, Bias,
    rank, chunk_len, n_kv,
    stride_qb, stride_qh, stride_rp, stride_rs, stride_ba, stride_br, stride_rbt,
    stride_sb, stride_sh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr,
    KEYS_M: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """Pass 1 of two-pass ResidualAttention decode:
    ``Bias[b, h, n] = q[b, h] . RoPE_n(K_res[n] B_k)`` for every key ``n`` of a chunk of
    sequence ``b``, all heads (unscaled scores).

    Grid ``(batch, chunks)``. A key tile's residual rows and cos/sin rows (read straight
    from the table at the keys' absolute positions) are loaded once and reused by every KV
    head; per head the tile is up-projected (``K_res @ B_k``, two rank-r products), rotated,
    and multiplied by the head's GQA group of queries. Sequences without an adapter skip
    the work (pass 2 never reads their bias). ``PREFETCH``: the tile loop holds the next
    tile's residual rows and the one after's offsets (residual_score_qfold.py says why).
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
    table_row = b * stride_rbt
    if PREFETCH:  # (stop is start without an adapter: nothing loads then)
        kr_next, r_off_next = residual_rows_ahead(KR, ResBlockTables, table_row, start, stop,
                                                  adapter >= 0, r, rank, stride_rp, stride_rs,
                                                  PAGE_SIZE, BLOCK_N)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        if PREFETCH:
            kr = kr_next
            kr_next, r_off_next = residual_rows_step(KR, ResBlockTables, table_row, start_n,
                                                     stop, adapter >= 0, r_off_next, r, rank,
                                                     stride_rp, stride_rs, PAGE_SIZE, BLOCK_N)
        else:
            kr = residual_tile(KR, ResBlockTables, table_row, offs_n, n_ok, r, rank, stride_rp,
                               stride_rs, PAGE_SIZE)
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
    Scores, BlockMax, VR, BV, ResBlockTables, AdapterIdx, KvStarts, PartOut, PartLse,
    rank, stride_sb, stride_sh, stride_mb, stride_mh, stride_rp, stride_rs, stride_ba,
    stride_br, stride_rbt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr,
    REL_SCORE: tl.constexpr = False,
):
    """Split-form cascade, after the tiled prefix launch: adds a row's V residual to each of
    its prefix partials, ``(sum_n exp2(s_n - lse) V_res[n]) B_v``, from the scores ``s`` and
    the partial's log2-sum-exp ``lse`` that launch wrote (so already normalised like the
    partial). Grid ``(batch, n_kv // KV_HEADS, prefix splits)``, the splits laid out as the
    prefix launch's (``BLOCK_N``, ``KvStarts`` = the row's prefix length). A program takes
    the ``KV_HEADS * GROUP`` query heads of ``KV_HEADS`` consecutive KV heads: each key
    tile's scores, ``V_res`` rows and block-table entries are loaded once for all of them
    and accumulated by one dot in rank space; ``B_v`` is applied per KV head at the end
    (``residual_values(grid=...)``: 1 or all). ``REL_SCORE``: each score is stored relative
    to its ``BLOCK_N``-key block's max, kept in ``BlockMax`` (float16 scores,
    decode_attention.py)."""
    b = tl.program_id(0)
    kv0 = tl.program_id(1) * KV_HEADS
    split = tl.program_id(2)
    adapter = tl.load(AdapterIdx + b)
    span = tl.where(adapter >= 0, tl.load(KvStarts + b), 0)
    key_split = tl.cdiv(tl.cdiv(span, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * key_split
    stop = tl.minimum(start + key_split, span)
    rows = tl.arange(0, BLOCK_H)
    heads = kv0 * GROUP + rows
    row_ok = (rows < KV_HEADS * GROUP) & (start < stop)
    lse = tl.load(PartLse + b * stride_lb + heads * stride_lh + split, mask=row_ok, other=0.0)
    r = tl.arange(0, RANK)
    r_ok = r < rank
    d = tl.arange(0, HEAD_DIM)
    acc_r = tl.zeros([BLOCK_H, RANK], tl.float32)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        ok = row_ok[:, None] & n_ok[None, :]
        s = tl.load(Scores + b * stride_sb + heads[:, None] * stride_sh + offs_n[None, :],
                    mask=ok, other=0.0)
        if REL_SCORE:
            # (block max - lse) first, both float32: the float16 part stays a small number.
            shift = tl.load(BlockMax + b * stride_mb + heads * stride_mh + start_n // BLOCK_N,
                            mask=row_ok, other=0.0) - lse
            p = tl.where(ok, tl.exp2(s.to(tl.float32) + shift[:, None]), 0.0)
        else:
            p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs_n, n_ok, stride_rp, stride_rs,
                                 PAGE_SIZE)
        vr = tl.load(VR + r_off[:, None] + r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                     other=0.0)
        acc_r += tl.dot(p.to(vr.dtype), vr)
    # Each KV head's slice of B_v up-projects only its own group's rows of acc_r: a masked
    # [BLOCK_H, RANK] x [RANK, D] dot per KV head (KV_HEADS times the needed FLOPs, still
    # ~1 MFLOP a program) keeps every operand 2-D; gathering B_v per row would hold a
    # [BLOCK_H, RANK, D] tile.
    bv_ptr = BV + tl.maximum(adapter, 0) * stride_ba + r[:, None] * stride_br + d[None, :]
    out = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for j in tl.static_range(KV_HEADS):
        bv = tl.load(bv_ptr + (kv0 + j) * HEAD_DIM, mask=r_ok[:, None], other=0.0)
        out += tl.dot(tl.where((rows // GROUP == j)[:, None], acc_r, 0.0), bv.to(tl.float32))
    o_ptr = PartOut + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    part = tl.load(o_ptr, mask=row_ok[:, None], other=0.0)
    tl.store(o_ptr, part + out, mask=row_ok[:, None])



def residual_scores(q: torch.Tensor, k_res: torch.Tensor, res_block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, b_k_all: torch.Tensor, adapter_idx: torch.Tensor,
                    rope_table: torch.Tensor, n_kv: int, max_seq_len: int, *,
                    dtype: torch.dtype | None = None, block_n: int = 32, num_warps: int = 4,
                    num_stages: int = 2, chunk: int | None = None,
                    keys_m: bool = False, form: str = "rotate",
                    angle_add: bool | None = None, prefetch: bool = False,
                    table16: bool = False, kv_heads: int = 1, pdl: bool = False,
                    waves: int = 2, progress: ScoreProgress | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 1 of two-pass ResidualAttention decode: ``[batch, H, max_seq_len]`` with
    ``q[b, h] . RoPE_n(K_res[b, n] B_k[adapter_b])`` (unscaled) at every key ``n < seq_len``
    of a sequence with an adapter; other entries are left unwritten.

    ``dtype``: default ``score_dtype_for(q)``.
    ``chunk``: keys per program (default: enough programs for about ``waves`` waves).
    ``block_n=32``:
    128 registers, no spills on sm_90 (64: 240; see ``kernel_bench.py --regs``).
    ``keys_m``: score the rotated tile as ``rot @ q^T`` (keys as M). At ``block_n=64`` the
    compiler then uses wgmma with the rotated tile as a register operand (no shared-memory
    transpose, no replicated warps) at 217 registers; two-pass decode's default
    (``score_tuning_for``) at batch 2-16 on the H200 (docs/KERNELS.md).
    ``form``: ``"rotate"`` (this module's kernel: rebuild, rotate and score each key) or
    ``"qfold"`` (residual_score_qfold.py: the queries folded into ``B_k``, cos/sin rows by
    ``angle_add``, default True, or from the table; ``keys_m`` does not apply).
    ``prefetch``: the tile loop loads each key tile's residual rows (a gather behind the
    residual table, which the pipeliner does not load ahead) a tile before it uses them.
    ``table16`` (qfold from the table): read the cos/sin rows from a copy of the table in
    the queries' dtype (``rope.rope_table_in``): the kernel rounds each row to it before its
    dot anyway, so the scores are the same and the rows half the bytes.
    ``kv_heads`` (qfold): KV heads per program, sharing each key tile's residual and cos/sin
    rows in one product that many times wider; a tuning names it for any model, so a
    program takes ``gcd(kv_heads, n_kv)`` (an MQA model's one KV head alone).
    ``pdl`` (qfold, CUDA): the next launch may start programmatically while this one runs
    (``decode_partials(pdl=True)``, which waits for it before reading the scores).
    ``progress`` (qfold): publish each written key tile there, in chunks of its
    ``chunk_len`` (``chunk`` unused), for a partial kernel that follows this pass
    (score_progress.py).
    ``out``: a ``[batch, H, max(max_seq_len, 1)]`` buffer to write instead of a new one (a
    call split into launches over buffers allocated once); ``dtype`` is then its own.
    """
    if form not in SCORE_FORMS:
        raise ValueError(f"residual score form must be one of {SCORE_FORMS}, got {form!r}")
    batch, n_heads, head_dim = q.shape
    group = n_heads // n_kv
    bias = score_buffer(q, max_seq_len, dtype) if out is None else out
    span = bias.shape[2]
    if table16 and (form != "qfold" or angle_add is not False):
        raise ValueError("table16 is an option of the qfold form reading table rows "
                         "(angle_add=False); the rotate form rotates in float32")
    if kv_heads < 1 or kv_heads != 1 and form != "qfold":
        raise ValueError(f"kv_heads {kv_heads!r}: a positive count, and a qfold-form option "
                         "(the rotate form loops over the KV heads)")
    if pdl and (form != "qfold" or not q.is_cuda):
        raise ValueError("pdl is a qfold-form option on a CUDA device")
    if progress is not None and form != "qfold":
        raise ValueError("progress is a qfold-form option")
    if table16:
        rope_table = rope_table_in(rope_table, q.dtype)
    if form == "qfold":
        if keys_m:
            raise ValueError("keys_m is a rotate-form option; the qfold form has no rebuilt keys")
        qfold_scores(q, k_res, res_block_tables, seq_lens, b_k_all, adapter_idx, rope_table, n_kv,
                     bias, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                     chunk=chunk, angle_add=angle_add is not False, prefetch=prefetch,
                     kv_heads=math.gcd(kv_heads, n_kv), pdl=pdl, waves=waves,
                     progress=progress)
        return bias
    if angle_add is not None:
        raise ValueError("angle_add is a qfold-form option; the rotate form reads table rows")
    chunk = score_chunk(span, batch, block_n, q.device, chunk, waves)
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
        KEYS_M=keys_m, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages,
    )
    return bias



def value_launch_grid(grid: str, batch: int, n_kv: int, num_splits: int) -> tuple[int, int, int]:
    """The value pass's launch grid for ``residual_values(grid=...)``: ``"kv_head"``, a
    program per row, KV head and split; ``"row"``, a program per row and split over all
    heads (the middle axis 1)."""
    if grid not in VALUE_GRIDS:
        raise ValueError(f"value pass grid must be one of {VALUE_GRIDS}, got {grid!r}")
    return (batch, n_kv if grid == "kv_head" else 1, num_splits)


def residual_values(scores: torch.Tensor, v_res: torch.Tensor, b_v_all: torch.Tensor,
                    res_block_tables: torch.Tensor, adapter_idx: torch.Tensor,
                    kv_starts: torch.Tensor,
                    part_out: torch.Tensor, part_lse: torch.Tensor, n_kv: int, num_splits: int,
                    block_n: int, block_max: torch.Tensor | None = None,
                    grid: str = DEFAULT_VALUE_GRID,
                    num_warps: int = 4) -> None:
    """The split-form cascade's value pass (see its kernel): ``scores`` as the tiled prefix
    launch left them, its partials at slots ``0 .. num_splits``, its ``block_n``;
    ``block_max``: the block maxima it stored beside relative scores (float16 ones).
    ``grid`` (``value_launch_grid``): ``"row"`` (``DEFAULT_VALUE_GRID``) reads each row's
    ``V_res`` and residual block table once for all heads; ``"kv_head"`` once per KV head,
    in 16-row tiles of ``GROUP`` live rows."""
    batch, n_heads, _, head_dim = part_out.shape
    launch = value_launch_grid(grid, batch, n_kv, num_splits)
    group = n_heads // n_kv
    kv_heads = n_kv // launch[1]
    rank = b_v_all.shape[1]
    m_strides = (0, 0) if block_max is None else (block_max.stride(0), block_max.stride(1))
    _residual_value_kernel[launch](
        scores, block_max, v_res, b_v_all, res_block_tables, adapter_idx, kv_starts, part_out,
        part_lse, rank, scores.stride(0), scores.stride(1), *m_strides,
        v_res.stride(0), v_res.stride(1), b_v_all.stride(0), b_v_all.stride(1),
        res_block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, KV_HEADS=kv_heads, BLOCK_H=max(16, triton.next_power_of_2(group * kv_heads)),
        HEAD_DIM=head_dim, PAGE_SIZE=v_res.shape[1], BLOCK_N=block_n,
        RANK=max(16, triton.next_power_of_2(rank)), REL_SCORE=block_max is not None,
        num_warps=num_warps,
    )



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
                       dtype=score_dtype_for(q))
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



def residual_decode_triton(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                           k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                           res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                           inv_freq: torch.Tensor, scale: float | None = None,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                           split_score: bool = False, variant: str = "two_pass",
                           score_tuning: dict | None = None, chunk: int = 256,
                           plan: str | None = None, prefetch: bool | None = None,
                           overlap_slices: int | None = None,
                           pdl: bool | None = None,
                           follow: bool | dict = False) -> torch.Tensor:
    """ResidualAttention decode (see the module docstring for ``variant``). ``score_tuning``
    goes to ``residual_scores`` (two-pass), ``residual_logits`` (msc) or ``split_logits``
    (msc2s), ``chunk`` is the chunked variant's keys per phase, ``split_score`` picks the
    fused variant's score form; ``block_n`` defaults per variant (``DEFAULT_BLOCK_N``).
    ``plan`` (two-pass): the partial kernel's split plan, ``"dynamic"`` (the default: unified
    decode's, each sequence's own keys cut on the device, one split writing the output with
    no merge; ``paged_decode_triton``) or ``"static"`` (``plan_splits`` over
    ``[0, max_seq_len)``, every other variant's).
    ``prefetch`` (two-pass and folded; default on): the partial kernel loads each key tile's
    bias and residual table entries one tile ahead (``decode_partials``; H200: pass 2 1.4 ->
    1.1x unified at batch 64, docs/KERNELS.md "Round 13"; folded: the table entries).
    ``overlap_slices`` (two-pass, dynamic plan; off by default): the rows in that many
    slices, pass 1 of slice i + 1 on a side stream beside pass 2 of slice i
    (``streams.row_pipeline``), so the tensor-core score pass and the memory-bound partial
    kernel could share the SMs. H200, round 14: 2 slices tie at batch 1 and lose 0.01-0.17x
    unified elsewhere, 4 lose more (smaller grids, and pass 2's programs fill the SMs).
    ``pdl`` (two-pass, dynamic plan, no slices, CUDA sm_90+, the q-folded pass 1): pass 2 is
    launched programmatically, so its programs start while pass 1 runs and wait for it
    before their first score read (``griddepcontrol``; at batch 1 pass 1 is mostly a fixed
    latency: H200, 1.34-1.41x -> 1.28-1.35x unified, no change past it). Default: on
    wherever it applies.
    ``follow`` (two-pass, dynamic plan, no slices, prefetch, the q-folded pass 1): pass 1
    publishes how far it has scored each row's keys and pass 2 waits only for the tile it
    reads next (score_progress.py), so with ``pdl`` the two passes overlap instead of
    running back to back. A dict: ``FOLLOW_TUNING``'s keys to override. H200, round 16:
    0.0-0.1x unified slower than the whole-pass wait at two waves, up to 0.3x at one (the
    polls cost about what the overlap wins); off by default."""
    assert variant in RESIDUAL_VARIANTS, f"unknown ResidualAttention variant {variant!r}"
    if variant == "ws":
        from forkserve.kernels.residual_decode_gluon import residual_decode_ws
        return residual_decode_ws(q, k_base, v_base, k_res, v_res, block_tables,
                                  res_block_tables, seq_lens, b_k_all, b_v_all, adapter_idx,
                                  inv_freq, scale, key_bound(seq_lens, max_seq_len), num_splits)
    plans = VARIANT_PLANS.get(variant, ("static",))
    if plan is None:
        plan = plans[0]
    if prefetch is None:
        prefetch = variant in PREFETCHING
    if plan not in plans:
        raise ValueError(f"plan {plan!r}: {variant} runs on {plans} (of {PLANS})")
    if prefetch and variant not in PREFETCHING:
        raise ValueError(f"prefetch is an option of {PREFETCHING}")
    tuning = score_tuning_for(q.shape[0]) if score_tuning is None else score_tuning
    pdl_applies = (variant == "two_pass" and plan == "dynamic" and overlap_slices is None
                   and tuning.get("form") == "qfold" and programmatic_launches(q.device))
    if pdl is None:
        pdl = pdl_applies
    if pdl and not pdl_applies:
        raise ValueError("pdl: two_pass on the dynamic plan without overlap_slices, its pass "
                         "1 q-folded, on a CUDA device of sm_90 or later")
    if follow and not (variant == "two_pass" and plan == "dynamic" and overlap_slices is None
                       and prefetch and tuning.get("form") == "qfold"):
        raise ValueError("follow: two_pass on the dynamic plan with prefetch, without "
                         "overlap_slices, its pass 1 q-folded")
    if overlap_slices is not None and (variant != "two_pass" or plan != "dynamic"
                                       or overlap_slices < 1):
        raise ValueError(f"overlap_slices {overlap_slices!r}: a positive count, with "
                         f"two_pass on the dynamic plan")
    block_n = DEFAULT_BLOCK_N[variant] if block_n is None else block_n
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    max_seq_len = key_bound(seq_lens, max_seq_len)
    n_kv = k_base.shape[2]
    rope_tab = cached_rope_table(inv_freq, max_seq_len)
    if variant == "folded":  # its products take the rows in the queries' dtype
        rope_tab = rope_table_in(rope_tab, q.dtype)
    residual = (k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, rope_tab)
    res_bias = res_logits = progress = None
    batch = q.shape[0]
    if variant == "three_pass":
        return _three_pass(q, k_base, v_base, block_tables, seq_lens, residual, scale=scale,
                           max_seq_len=max_seq_len, num_splits=num_splits, block_n=block_n,
                           num_warps=num_warps, num_stages=num_stages, score_tuning=tuning)
    if variant == "two_pass":
        # Allocated here, before any fork: with overlap_slices the side stream fills it.
        res_bias = score_buffer(q, max_seq_len, tuning.get("dtype"))
        if follow:
            # Chunks of whole tiles of both passes, segments of pass 1's; the same flags and
            # lengths to both.
            how = FOLLOW_TUNING | (follow if isinstance(follow, dict) else {})
            kv_heads = math.gcd(tuning.get("kv_heads", 1), n_kv)
            score_tile = tuning.get("block_n", 32)
            progress = score_progress(
                q, n_kv, res_bias.shape[2],
                score_chunk(res_bias.shape[2], batch * n_kv // kv_heads,
                            math.lcm(score_tile, block_n), q.device, tuning.get("chunk"),
                            how["waves"]),
                whole_tiles(how["segment"], score_tile))

        def scores(lo: int, hi: int) -> None:  # pass 1 of rows [lo, hi), into res_bias
            residual_scores(q[lo:hi], k_res, res_block_tables[lo:hi], seq_lens[lo:hi], b_k_all,
                            adapter_idx[lo:hi], rope_tab, n_kv, max_seq_len, out=res_bias[lo:hi],
                            pdl=pdl, progress=progress, **tuning)

        if overlap_slices is None:
            scores(0, batch)
    elif variant == "msc":
        res_logits = residual_logits(q, k_base, block_tables, k_res, res_block_tables, seq_lens,
                                     b_k_all, adapter_idx, rope_tab, scale, max_seq_len,
                                     **(MSC_TUNING if score_tuning is None else score_tuning))
    elif variant == "msc2s":
        res_logits, res_bias = split_logits(
            q, k_base, block_tables, k_res, res_block_tables, seq_lens, b_k_all, adapter_idx,
            rope_tab, scale, max_seq_len,
            **(MSC2S_TUNING if score_tuning is None else score_tuning))

    if plan == "dynamic":
        out = torch.empty_like(q)

        def attend(lo: int, hi: int) -> None:  # pass 2 of rows [lo, hi), into out
            rows = (k_res, v_res, res_block_tables[lo:hi], b_k_all, b_v_all, adapter_idx[lo:hi],
                    rope_tab)

            def fill(part: torch.Tensor, part_lse: torch.Tensor | None, splits: int) -> None:
                decode_partials(q[lo:hi], k_base, v_base, block_tables[lo:hi], seq_lens[lo:hi],
                                part, part_lse, scale=scale, kv_start=0, kv_limit=NO_LIMIT,
                                num_splits=splits, split_len=0, split_offset=0, residual=rows,
                                block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                res_bias=None if res_bias is None else res_bias[lo:hi],
                                dyn_split=True, direct=part_lse is None, prefetch=prefetch, pdl=pdl,
                                progress=progress, fold=variant == "folded")

            dynamic_split_decode(q[lo:hi], (hi - lo) * n_kv, max_seq_len, num_splits, block_n,
                                 fill, out=out[lo:hi])

        if overlap_slices is None:
            attend(0, batch)
        else:
            row_pipeline(batch, overlap_slices, scores, attend, q.device)
        return out

    def fill(part_out: torch.Tensor, part_lse: torch.Tensor, splits: int, split_len: int) -> None:
        tuning = dict(scale=scale, num_splits=splits, split_len=split_len, block_n=block_n,
                      num_warps=num_warps, num_stages=num_stages)
        if variant == "chunked":
            residual_chunked_partials(q, k_base, v_base, block_tables, seq_lens, residual,
                                      part_out, part_lse, max_seq_len=max_seq_len, chunk=chunk,
                                      **tuning)
        else:
            decode_partials(q, k_base, v_base, block_tables, seq_lens, part_out, part_lse,
                            kv_start=0, kv_limit=NO_LIMIT, split_offset=0, residual=residual,
                            split_score=split_score, res_bias=res_bias, res_logits=res_logits,
                            prefetch=prefetch, **tuning)

    return split_decode(q, q.shape[0] * n_kv, max_seq_len, num_splits, block_n, fill)


def _three_pass(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, residual: tuple, *,
                scale: float, max_seq_len: int, num_splits: int | None, block_n: int,
                num_warps: int, num_stages: int, score_tuning: dict) -> torch.Tensor:
    """``variant="three_pass"``: the score pass, the partial kernel over the base K/V with
    the scores added and written back (no ``acc_r``), the value pass over ``V_res``, the
    merge. Each sequence's keys are split on the device (the dynamic plan), which the value
    pass repeats from ``seq_lens``; float16 scores are written back relative to their
    ``block_n``-key block's max, kept in float32 beside them."""
    k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, rope_tab = residual
    batch = q.shape[0]
    n_kv = k_base.shape[2]
    scores = residual_scores(q, k_res, res_bt, seq_lens, b_k_all, adapter_idx, rope_tab, n_kv,
                             max_seq_len, **score_tuning)
    block_max = block_maxima(scores, block_n)
    splits = dynamic_splits(batch * n_kv, max_seq_len, sm_count(q.device), block_n, num_splits)
    part_out, part_lse = empty_partials(q, splits)
    decode_partials(q, k_base, v_base, block_tables, seq_lens, part_out, part_lse, scale=scale,
                    kv_start=0, kv_limit=NO_LIMIT, num_splits=splits, split_len=0,
                    split_offset=0, residual=residual, block_n=block_n, num_warps=num_warps,
                    num_stages=num_stages, res_bias=scores, dyn_split=True, block_max=block_max,
                    value_pass=True)
    residual_values(scores, v_res, b_v_all, res_bt, adapter_idx, seq_lens.to(torch.int32),
                    part_out, part_lse, n_kv, splits, block_n, block_max=block_max)
    return merge_partials(part_out, part_lse, torch.empty_like(q), splits)
