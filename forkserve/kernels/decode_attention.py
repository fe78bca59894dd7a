"""Paged split-K decode attention, in Triton: one partial kernel for every decode form.

``_decode_partial_kernel`` attends a tile of query rows over a contiguous key range of one
KV head and writes a split partial (split_kv.py merges them). Its constexpr modes:

* plain: unified paged K/V (``paged_decode_triton``);
* ``HAS_RES``: ResidualAttention over the disaggregated cache, with the key tile rebuilt as
  ``K = K_base + RoPE(K_res @ B_k)`` (``"fused"``), or, with ``RES_BIAS``, the residual
  score precomputed by the score pass (``"two_pass"``; ``PREFETCH`` loads each tile's bias
  and residual table entries one tile ahead, as neither feeds a dot the pipeliner would
  prefetch; ``FOLLOW`` waits for the score pass tile by tile, score_progress.py), or, with
  ``RES_FOLD``, the score pass's q-folded products inside the loop (``"folded"``); all keep
  a rank-r accumulator
  ``acc_r`` over ``V_res`` with the same online-softmax rescale as ``acc`` and apply ``B_v``
  once per split (matrix associativity, seed 001 section 7). With ``RES_LOGITS`` the whole
  logits come precomputed (``"msc"``, residual_msc.py) and only V and ``V_res`` are read;
  with ``RES_LOGITS`` and ``RES_BIAS`` they are base logits plus the residual score
  (``"msc2s"``, residual_msc2s.py: the two halves of msc's pass 1 written side by side).
  With ``VALUE_PASS`` (and ``RES_BIAS``) the loop keeps no ``acc_r``: it writes every
  score back and ``residual_values`` adds the V residual after it (``"three_pass"``, and
  the split-form cascade's prefix tiles). The variants and their drivers are in
  residual_decode_triton.py;
* ``TILED`` / ``SEQ_START`` / ``DYN_SPLIT``: cascade decode's prefix tiles and per-row
  suffixes, split on the device (shared_prefix.py); ``REL_SCORE``: the split form's float16
  score write-back, each score relative to its key block's max. Unified decode's dynamic plan uses
  ``DYN_SPLIT`` alone (each sequence's own keys cut in ``num_splits``), with ``LIVE_ONLY``
  (an empty split writes only its lse) or, at one split, ``DIRECT`` (the output itself, no
  merge).

Grid ``(seq_groups, n_kv_heads, num_splits)``. A program owns one KV head, a contiguous
range of keys and a tile of query rows that all read those keys: the GQA group of one
sequence (``SEQS = 1``) or the GQA groups of several sequences that share the pages
(``SEQS > 1``: a cascade tile). H200 numbers and register counts: docs/KERNELS.md.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from forkserve.kernels.residual_triton import (
    fold_queries,
    fused_residual_score,
    residual_offsets,
    rotated_residual_keys,
)
from forkserve.kernels.rope_triton import rope_rows, rope_rows_at
from forkserve.kernels.score_progress import (
    ScoreProgress,
    keys_needed,
    load_published,
    wait_for_keys,
)
from forkserve.kernels.split_kv import (
    LOG2E,
    NO_LIMIT,
    dynamic_split_decode,
    key_bound,
    split_decode,
    store_live_partial,
    store_partial,
)

# Integer arguments that change from step to step (batch, table widths, the score buffer's
# key bound, split counts). Triton builds one kernel per class of each (== 1, divisible by
# 16, other): an eager mixed tick whose widths fell in a class the captured graphs never
# met compiled its kernels inside a timed adaptive run (1.35 s at W = 32,
# ``kernels_built_specs``). One build serves every class.
_STEP_INTS = ["batch", "kv_start", "kv_limit", "split_len", "split_offset", "stride_bt",
              "stride_rbt", "stride_lh", "stride_sb", "stride_sh", "stride_mb", "stride_mh",
              "score_chunk", "stride_fb"]


@triton.jit(do_not_specialize=_STEP_INTS)
def _decode_partial_kernel(
    Q, K, V, KR, VR, BK, BV, RopeTable, Bias, LogitBias, BlockMax,
    BlockTables, ResBlockTables, SeqLens, AdapterIdx,
    PartOut, PartLse, TileSeqs, TileLens, KvStarts, Flags,
    batch, qk_scale, rank, kv_start, kv_limit, split_len, split_offset, score_chunk,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_rp, stride_rs,
    stride_ba, stride_br,
    stride_bt, stride_rbt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_sb, stride_sh,
    stride_mb, stride_mh,
    stride_fb, stride_fh,
    GROUP: tl.constexpr, SEQS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_SCORE: tl.constexpr,
    RES_BIAS: tl.constexpr, TILED: tl.constexpr = False, SEQ_START: tl.constexpr = False,
    DYN_SPLIT: tl.constexpr = False, RES_LOGITS: tl.constexpr = False,
    LIVE_ONLY: tl.constexpr = False, DIRECT: tl.constexpr = False,
    REL_SCORE: tl.constexpr = False, VALUE_PASS: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, GDC_WAIT: tl.constexpr = False,
    FOLLOW: tl.constexpr = False, SPIN: tl.constexpr = False,
    RES_FOLD: tl.constexpr = False, FOLD_G: tl.constexpr = 4, FOLD_RANK: tl.constexpr = 16,
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
        row_seq = tl.load(TileSeqs + pid_g * SEQS + rows // GROUP, mask=rows < SEQS * GROUP,
                          other=-1)
        row_ok = row_seq >= 0
        row_seq = tl.maximum(row_seq, 0)
        first = tl.load(TileSeqs + pid_g * SEQS)
        lead = tl.maximum(first, 0)
        kv_end = tl.where(first >= 0,
                          tl.minimum(tl.load(SeqLens + lead), tl.load(TileLens + pid_g)), 0)
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
    # A split with no keys (past its sequence's end) reads no q: it only writes lse -inf.
    q_ok = row_ok & (start < stop)
    q_lo = tl.load(q_ptr + d_lo[None, :], mask=q_ok[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF + d_lo[None, :], mask=q_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    if HAS_RES and VALUE_PASS:
        # Split-form cascade (rows of several adapters share the tile's base keys) or
        # three-pass decode: a row's residual score comes from the score pass; the full
        # score is written back for the value pass (``residual_values``), which adds the
        # row's own V residual, so this loop keeps no ``acc_r``. With RES_LOGITS every
        # row's whole logits are already there (msc cascade).
        s_ptr = Bias + row_seq[:, None] * stride_sb + row_head[:, None] * stride_sh
        if RES_LOGITS:
            s_rows = row_ok
        else:
            s_rows = row_ok & (tl.load(AdapterIdx + row_seq, mask=row_ok, other=-1) >= 0)
    elif HAS_RES:
        adapter = tl.load(AdapterIdx + lead)
        has_ad = adapter >= 0
        a_safe = tl.maximum(adapter, 0)
        r = tl.arange(0, RANK)
        r_ok = (r < rank) & has_ad
        if RES_FOLD:
            # The group's queries folded into this KV head's B_k (residual_score_qfold.py's
            # pass, here inside the key loop): each tile's residual score is two products
            # against its cos/sin rows (in the queries' dtype) and a rank contraction, on
            # tensor cores the K/V stream leaves idle.
            col = tl.arange(0, FOLD_G * FOLD_RANK)
            g = col // FOLD_RANK
            kk = col % FOLD_RANK
            fold_c, fold_s = fold_queries(
                Q, BK, lead * stride_qb + (kvh * GROUP + g) * stride_qh, g < GROUP,
                a_safe * stride_ba + kk * stride_br + kvh * HEAD_DIM, (kk < rank) & has_ad,
                HALF)
            fc = fold_c.to(Q.dtype.element_ty)
            fs = fold_s.to(Q.dtype.element_ty)
            rk = tl.arange(0, FOLD_RANK)
        elif not RES_BIAS and not RES_LOGITS:
            b_row = BK + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM
            bk_lo = tl.load(b_row + d_lo[None, :], mask=r_ok[:, None], other=0.0)
            bk_hi = tl.load(b_row + HALF + d_lo[None, :], mask=r_ok[:, None], other=0.0)
            cos_j, sin_j = rope_rows(RopeTable, BLOCK_N, HALF)
        else:
            s_ptr = Bias + row_seq[:, None] * stride_sb + row_head[:, None] * stride_sh
            s_rows = row_ok & has_ad
            if RES_LOGITS:
                if RES_BIAS:
                    # Logits of the base term only; the residual score of rows with an
                    # adapter is in LogitBias (same strides).
                    b_ptr = (LogitBias + row_seq[:, None] * stride_sb
                             + row_head[:, None] * stride_sh)
                    b_rows = s_rows
                s_rows = row_ok  # every row's logits, adapter or not
        acc_r = tl.zeros([BLOCK_H, RANK], tl.float32)
    if GDC_WAIT:
        # Launched while the score pass still runs (``pdl``): everything above reads what
        # was written before that pass began; its scores only after this wait.
        gdc_wait()
    if PREFETCH:
        # The first tile's bias (and, where this loop reads V_res, its residual table
        # entries); the loop loads each next tile's while it computes this one. Neither feeds
        # a dot the pipeliner would prefetch: with every adapter off two-pass's loop ran at
        # unified's speed, with them on ~1.35x (round 13).
        offs_f = start + tl.arange(0, BLOCK_N)
        ok_f = offs_f < stop
        if FOLLOW:
            # The score pass may still be writing this row's later keys (score_progress.py).
            f_ptr = Flags + lead * stride_fb + kvh * stride_fh
            ready = wait_for_keys(f_ptr + start // score_chunk, start * 0,
                                  keys_needed(start, stop, has_ad, BLOCK_N), SPIN)
            bias_next = load_published(s_ptr, s_rows, offs_f, ok_f, ready, SPIN)
        elif not RES_FOLD:  # (folded: no score buffer, only the residual table entries)
            bias_next = tl.load(s_ptr + offs_f[None, :], mask=s_rows[:, None] & ok_f[None, :],
                                other=0.0)
        if not VALUE_PASS:
            r_off_next = residual_offsets(ResBlockTables, lead * stride_rbt, offs_f,
                                          ok_f & has_ad, stride_rp, stride_rs, PAGE_SIZE)

    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        page = tl.load(BlockTables + lead * stride_bt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        kv_off = (page.to(tl.int64) * stride_kp + (offs_n % PAGE_SIZE) * stride_ks
                  + kvh * stride_kh)
        if not RES_LOGITS:
            k_lo = tl.load(K + kv_off[:, None] + d_lo[None, :], mask=n_ok[:, None], other=0.0)
            k_hi = tl.load(K + kv_off[:, None] + HALF + d_lo[None, :], mask=n_ok[:, None],
                           other=0.0)
        v = tl.load(V + kv_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if HAS_RES and not VALUE_PASS:
            rn_ok = n_ok & has_ad
            if PREFETCH:
                r_off = r_off_next
            else:
                r_off = residual_offsets(ResBlockTables, lead * stride_rbt, offs_n, rn_ok,
                                         stride_rp, stride_rs, PAGE_SIZE)
            res_mask = rn_ok[:, None] & r_ok[None, :]
            vr = tl.load(VR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
        if HAS_RES and RES_LOGITS:
            # Materialized scores: the logits pass wrote q.K scaled into the log2 domain, so
            # this loop reads no K and multiplies no q. Tiles start at multiples of BLOCK_N
            # (split starts are; the driver asserts kv_start 0): said here so each thread
            # loads 16-byte vectors, not single floats (96 -> 160 registers at 64 keys).
            # A cascade suffix starts at its row's prefix length, which promises nothing.
            if SEQ_START:
                s_n = offs_n
            else:
                s_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
            s = tl.load(s_ptr + s_n[None, :], mask=s_rows[:, None] & n_ok[None, :],
                        other=0.0).to(tl.float32)
            if RES_BIAS:  # the unscaled residual score, into the log2 domain
                s += tl.load(b_ptr + s_n[None, :], mask=b_rows[:, None] & n_ok[None, :],
                             other=0.0).to(tl.float32) * qk_scale
        elif HAS_RES and RES_BIAS:
            # Two-pass: q.RoPE(K_res B_k) for these keys was written by the score kernel.
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
            if PREFETCH:
                s += bias_next.to(tl.float32)
                offs_f = start_n + BLOCK_N + tl.arange(0, BLOCK_N)
                ok_f = offs_f < stop
                if FOLLOW:
                    ready = wait_for_keys(f_ptr + (start_n + BLOCK_N) // score_chunk, ready,
                                          keys_needed(start_n + BLOCK_N, stop, has_ad, BLOCK_N),
                                          SPIN)
                    bias_next = load_published(s_ptr, s_rows, offs_f, ok_f, ready, SPIN)
                else:
                    bias_next = tl.load(s_ptr + offs_f[None, :],
                                        mask=s_rows[:, None] & ok_f[None, :], other=0.0)
                if not VALUE_PASS:
                    r_off_next = residual_offsets(ResBlockTables, lead * stride_rbt, offs_f,
                                                  ok_f & has_ad, stride_rp, stride_rs,
                                                  PAGE_SIZE)
            else:
                s += tl.load(s_ptr + offs_n[None, :], mask=s_rows[:, None] & n_ok[None, :],
                             other=0.0).to(tl.float32)
        elif HAS_RES and RES_FOLD:
            kr = tl.load(KR + r_off[:, None] + rk[None, :],
                         mask=rn_ok[:, None] & (rk < rank)[None, :], other=0.0)
            cos, sin = rope_rows_at(RopeTable, offs_n, n_ok, HALF)
            w = tl.dot(cos.to(fc.dtype), fc)
            w = tl.dot(sin.to(fs.dtype), fs, w)
            # [keys, FOLD_G] residual scores, their group rows repeated down the BLOCK_H rows
            # (rows past the group are masked).
            sc = tl.sum(tl.reshape(w, [BLOCK_N, FOLD_G, FOLD_RANK])
                        * kr.to(tl.float32)[:, None, :], 2)
            s_res = tl.reshape(tl.broadcast_to(tl.trans(sc)[None, :, :],
                                               [BLOCK_H // FOLD_G, FOLD_G, BLOCK_N]),
                               [BLOCK_H, BLOCK_N])
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi)) + s_res
            if PREFETCH:
                offs_f = start_n + BLOCK_N + tl.arange(0, BLOCK_N)
                r_off_next = residual_offsets(ResBlockTables, lead * stride_rbt, offs_f,
                                              (offs_f < stop) & has_ad, stride_rp, stride_rs,
                                              PAGE_SIZE)
        elif HAS_RES:
            kr = tl.load(KR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
            rot_lo, rot_hi = rotated_residual_keys(kr, bk_lo, bk_hi, RopeTable, start_n, cos_j,
                                                   sin_j, HALF)
            s = fused_residual_score(q_lo, q_hi, k_lo, k_hi, rot_lo, rot_hi, SPLIT_SCORE)
        else:
            s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
        if not RES_LOGITS:
            s = s * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        if HAS_RES and VALUE_PASS and not RES_LOGITS:
            if REL_SCORE:
                # A float16 buffer: each score relative to its block's row max (float32,
                # beside it). The value pass needs exp2(s - lse) where s is near the max: a
                # difference near 0 keeps ~5e-4 there; a whole log2 score of 30 only ~1e-2.
                blk_max = tl.max(s, 1)
                tl.store(BlockMax + row_seq * stride_mb + row_head * stride_mh
                         + start_n // BLOCK_N, blk_max, mask=s_rows)
                tl.store(s_ptr + offs_n[None, :], (s - blk_max[:, None]).to(Bias.dtype.element_ty),
                         mask=s_rows[:, None] & n_ok[None, :])
            else:
                tl.store(s_ptr + offs_n[None, :], s, mask=s_rows[:, None] & n_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        if HAS_RES and not VALUE_PASS:
            # Same rescale as acc: acc_r is the softmax-weighted sum of V_res rows.
            acc_r = acc_r * alpha[:, None] + tl.dot(p.to(vr.dtype), vr)
        m_i = m_new

    if HAS_RES and not VALUE_PASS:
        bv = tl.load(BV + a_safe * stride_ba + r[:, None] * stride_br + kvh * HEAD_DIM
                     + d[None, :], mask=r_ok[:, None], other=0.0)
        acc += tl.dot(acc_r, bv.to(tl.float32))
    slot = split_offset + split
    out_ptr = (PartOut + row_seq[:, None] * stride_ob + row_head[:, None] * stride_oh
               + slot * stride_os)
    if DIRECT:
        # One split: the normalised output itself, in the output's dtype (no merge launch).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + d[None, :], out.to(PartOut.dtype.element_ty), mask=row_ok[:, None])
    elif LIVE_ONLY:
        store_live_partial(acc, l_i, m_i, out_ptr,
                           PartLse + row_seq * stride_lb + row_head * stride_lh + slot, row_ok, d)
    else:
        store_partial(acc, l_i, m_i, out_ptr,
                      PartLse + row_seq * stride_lb + row_head * stride_lh + slot, row_ok, d)


def residual_columns(rank: int, wide: bool) -> int:
    """Columns of the residual rows (and ``acc_r``) the partial kernel holds for adapters of
    ``rank``. ``wide``: a launch reading a score buffer (two-pass, msc) or folding the scores
    in (``fold``) pads to 32: there a 16-wide ``p @ V_res`` product compiles to 255 registers
    with spills on sm_90 (two-pass 112-126 registers at 32; folded 856 bytes of spills at
    16, none at 32, and 3.5-5.3x unified on the H200 against 1.5-1.9x: round 17)."""
    return max(32 if wide else 16, triton.next_power_of_2(rank))


def decode_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, part_out: torch.Tensor,
                    part_lse: torch.Tensor, *,
                    scale: float, kv_start: int, kv_limit: int, num_splits: int, split_len: int,
                    split_offset: int, seqs_per_program: int = 1,
                    residual: tuple | None = None, block_n: int = 64, num_warps: int = 4,
                    num_stages: int = 2, split_score: bool = False,
                    res_bias: torch.Tensor | None = None,
                    res_logits: torch.Tensor | None = None,
                    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                    kv_starts: torch.Tensor | None = None, dyn_split: bool = False,
                    direct: bool = False, block_max: torch.Tensor | None = None,
                    value_pass: bool = False, prefetch: bool = False,
                    pdl: bool = False, progress: ScoreProgress | None = None,
                    fold: bool = False) -> None:
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
    ``res_logits`` (residual only): ``[batch, H, >= max key]`` whole logits
    ``q.K * scale * log2(e)`` of every row, written by residual_msc.py's pass 1; the kernel
    reads neither K nor q (materialized scores). With ``tiles`` it reads each row's own
    logits beside the tile's shared V and, like the bias form, leaves ``V_res`` to
    ``residual_values`` (the msc cascade). With ``res_bias`` too (same strides, no
    ``tiles`` / ``kv_starts``): base logits ``q.K_base * scale * log2(e)`` plus the bias,
    scaled here (msc2s, residual_msc2s.py).
    ``tiles`` (cascade prefix): ``(tile_seqs [n_tiles, seqs], tile_lens [n_tiles])`` int32;
    program ``g`` serves the sequences ``tile_seqs[g]`` lists (-1: none) over keys
    ``[kv_start, tile_lens[g])`` of the first one's pages; rows of no tile are not written.
    ``kv_starts`` (cascade suffix): ``[batch]`` int32, each sequence's first key instead of
    ``kv_start``. With either, ``split_len`` is ignored: each program splits its own
    sequence's range in ``num_splits`` (graph-safe, no host bound needed).
    ``dyn_split`` (unified, the dynamic plan): the same per-sequence split of
    ``[kv_start, min(seq_len, kv_limit))`` without tiles or ``kv_starts``; ``split_len`` is
    ignored and an empty split writes only its lse (-inf), which the merge skips.
    ``direct`` (one split, no tiles): ``part_out`` is the output ``[batch, H, D]`` itself,
    written normalised in its dtype; ``part_lse`` is not read or written (may be None).
    ``block_max`` (split-form cascade prefix with a float16 ``res_bias``): ``[batch, H, >=
    key blocks]`` float32; the write-back stores each score relative to its ``block_n``-key
    block's row max and the max here (``residual_values`` adds it back).
    ``value_pass`` (residual with ``res_bias`` and ``dyn_split``, no tiles): three-pass
    decode; as the cascade's prefix launch, the loop keeps no ``acc_r`` and writes every
    score back (relative to its block's max where ``block_max`` is given) for
    ``residual_values``, which splits each sequence's keys as this launch did.
    ``prefetch`` (residual with ``res_bias`` or ``fold``, no logits): each key tile's bias
    (and, where the loop reads ``V_res``, its residual table entries) is loaded one tile
    ahead.
    ``pdl`` (residual with ``res_bias``, CUDA sm_90+): launched programmatically after the
    score pass that writes ``res_bias`` (``residual_scores(pdl=True)``, the launch right
    before this one): the programs start and load what that pass does not write while it
    runs, and wait for it (``griddepcontrol.wait``) before the first bias read.
    ``progress`` (two-pass with ``prefetch`` and ``dyn_split``; the flags the score pass
    publishes, ``residual_scores(progress=...)``): wait, tile by tile, only for the keys
    about to be read instead (score_progress.py); with ``pdl`` the two passes overlap.
    ``fold`` (residual, no scores, one sequence a program, no tiles): score each key tile's
    residual inside the loop, the queries folded into ``B_k`` as residual_score_qfold.py's
    pass does (``RES_FOLD``); ``residual``'s RoPE table in the queries' dtype
    (``rope.rope_table_in``).
    """
    batch, n_heads, head_dim = q.shape
    if tiles is not None:
        seqs_per_program = tiles[0].shape[1]
    n_kv = k.shape[2]
    group = n_heads // n_kv
    assert k.stride() == v.stride() and k.stride(-1) == 1 and q.stride(-1) == 1
    block_h = max(16, triton.next_power_of_2(group * seqs_per_program))
    scores = res_bias if res_logits is None else res_logits
    if residual is not None:
        # Rows of several sequences share a program only as a cascade tile (score pass
        # required).
        assert seqs_per_program == 1 or (tiles is not None and scores is not None)
        assert res_bias is None or res_logits is None or (
            tiles is None and kv_starts is None and res_bias.stride() == res_logits.stride())
        # The logits loop assumes tiles at multiples of block_n (vector loads), except from
        # ``kv_starts``, where it reads the logits unaligned.
        assert res_logits is None or (kv_start == 0 and split_len % block_n == 0)
        k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, rope_tab = residual
        assert k_res.stride() == v_res.stride() and b_k_all.stride() == b_v_all.stride()
        rank = b_k_all.shape[1]
        assert k_res.shape[-1] == rank, "residual pools and B matrices disagree on rank"
        rank_pad = residual_columns(rank, wide=scores is not None or fold)
        res_strides = (k_res.stride(0), k_res.stride(1), b_k_all.stride(0), b_k_all.stride(1))
        rbt_stride = res_bt.stride(0)
    else:
        k_res = v_res = res_bt = b_k_all = b_v_all = adapter_idx = rope_tab = None
        rank, rank_pad, res_strides, rbt_stride = 0, 16, (0, 0, 0, 0), 0
    if scores is not None:
        assert residual is not None and scores.stride(-1) == 1
        bias_strides = (scores.stride(0), scores.stride(1))
    else:
        bias_strides = (0, 0)
    if prefetch:
        assert residual is not None and (res_bias is not None or fold) and res_logits is None
    assert not pdl or (res_bias is not None and q.is_cuda)
    if fold:
        assert (residual is not None and scores is None and tiles is None
                and seqs_per_program == 1 and not value_pass)
    if progress is not None:
        assert (prefetch and dyn_split and tiles is None and kv_starts is None
                and not value_pass and seqs_per_program == 1
                and progress.chunk_len % block_n == 0)
        flags = progress.flags
        flag_strides = (flags.stride(0), flags.stride(1))
    else:
        flags, flag_strides = None, (0, 0)
    if value_pass:
        assert (residual is not None and res_bias is not None and res_logits is None
                and tiles is None and kv_starts is None and dyn_split and kv_start == 0)
    writes_back = tiles is not None or value_pass
    # The write-back keeps whole float32 scores, or float16 ones relative to a block max.
    assert not writes_back or res_bias is None or res_logits is not None or (
        (block_max is None) == (res_bias.dtype == torch.float32))
    if block_max is not None:
        assert writes_back and res_bias is not None and res_logits is None
        max_strides = (block_max.stride(0), block_max.stride(1))
    else:
        max_strides = (0, 0)
    programs = tiles[0].shape[0] if tiles is not None else -(-batch // seqs_per_program)
    tile_seqs, tile_lens = tiles if tiles is not None else (None, None)
    if direct:
        assert tiles is None and num_splits == 1 and split_offset == 0
        assert part_out.shape == q.shape and part_out.stride(-1) == 1
        out_strides = (part_out.stride(0), part_out.stride(1), 0)
        part_lse, lse_strides = part_out, (0, 0)
    else:
        out_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        lse_strides = (part_lse.stride(0), part_lse.stride(1))
    dyn = dyn_split and tiles is None and kv_starts is None
    _decode_partial_kernel[(programs, n_kv, num_splits)](
        q, k, v, k_res, v_res, b_k_all, b_v_all, rope_tab, scores,
        res_bias if res_logits is not None else None, block_max,
        block_tables, res_bt, seq_lens, adapter_idx, part_out, part_lse,
        tile_seqs, tile_lens, kv_starts, flags,
        batch, scale * LOG2E, rank, kv_start, kv_limit, split_len, split_offset,
        0 if progress is None else progress.chunk_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        *res_strides, block_tables.stride(0), rbt_stride,
        *out_strides, *lse_strides, *bias_strides, *max_strides, *flag_strides,
        GROUP=group, SEQS=seqs_per_program, BLOCK_H=block_h, HEAD_DIM=head_dim,
        PAGE_SIZE=k.shape[1], BLOCK_N=block_n, RANK=rank_pad, HAS_RES=residual is not None,
        SPLIT_SCORE=split_score, RES_BIAS=res_bias is not None, TILED=tiles is not None,
        SEQ_START=kv_starts is not None,
        DYN_SPLIT=tiles is not None or kv_starts is not None or dyn_split,
        RES_LOGITS=res_logits is not None, LIVE_ONLY=dyn, DIRECT=direct,
        REL_SCORE=block_max is not None, VALUE_PASS=writes_back, PREFETCH=prefetch,
        GDC_WAIT=pdl and progress is None, FOLLOW=progress is not None, SPIN=q.is_cuda,
        RES_FOLD=fold, FOLD_G=triton.next_power_of_2(group),
        FOLD_RANK=residual_columns(rank, wide=False),
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )



PLANS = ("dynamic", "static")


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float | None = None, max_seq_len: int | None = None,
                        num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                        num_stages: int = 2, plan: str = "dynamic",
                        programs_per_sm: int | None = None) -> torch.Tensor:
    """Decode over the unified paged cache. q ``[batch, H, D]`` -> ``[batch, H, D]``.

    ``plan="dynamic"`` (default): ``split_kv.dynamic_splits`` picks a split count from the
    batch and a bound (``max_seq_len``, else the table's width: no host sync either way) and
    every program splits its own sequence's keys on the device, so a short sequence in a
    wide graph table gets short splits (empty ones write only lse -inf); one split writes
    the output directly (no merge launch). ``programs_per_sm`` tunes that plan.
    ``plan="static"``: the split plan of before (``split_kv.plan_splits`` over
    ``[0, max_seq_len)``: split length from the bound, which a wide table makes long; a bound
    under a sequence's length drops its later keys), kept for side-by-side benchmarks.
    """
    if plan not in PLANS:
        raise ValueError(f"decode plan must be one of {PLANS}, got {plan!r}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    common = dict(scale=scale, kv_start=0, kv_limit=NO_LIMIT, split_offset=0, block_n=block_n,
                  num_warps=num_warps, num_stages=num_stages)
    n_programs = q.shape[0] * k_cache.shape[2]
    if plan == "static":
        def fill(part_out: torch.Tensor, part_lse: torch.Tensor, splits: int,
                 split_len: int) -> None:
            decode_partials(q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
                            num_splits=splits, split_len=split_len, **common)

        return split_decode(q, n_programs, key_bound(seq_lens, max_seq_len), num_splits,
                            block_n, fill)
    bound = block_tables.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
    tuning = {} if programs_per_sm is None else {"programs_per_sm": programs_per_sm}

    def fill(out: torch.Tensor, part_lse: torch.Tensor | None, splits: int) -> None:
        decode_partials(q, k_cache, v_cache, block_tables, seq_lens, out, part_lse,
                        num_splits=splits, split_len=0, dyn_split=True,
                        direct=part_lse is None, **common)

    return dynamic_split_decode(q, n_programs, bound, num_splits, block_n, fill, **tuning)
