"""The q-folded residual score pass of two-pass ResidualAttention decode (``form="qfold"``).

Same output as ``residual_scores``'s rotate form: ``Bias[b, h, n] = q[b, h] . RoPE_n(K_res[n] B_k)``
for every key ``n`` of a sequence with an adapter. The rotate form up-projects each key
(``K_res[n] B_k``, ``r x D`` multiply-adds per key and KV head), rotates it elementwise and
multiplies it with a query tile padded from the GQA group (4) to 16 rows. Here the query is
folded into ``B_k`` once per program instead, because RoPE is a rotation of each frequency
pair ``(i, i + D/2)``:

    q . RoPE_n(u) = sum_i cos_n[i] (q_lo u_lo + q_hi u_hi)[i] + sin_n[i] (q_hi u_lo - q_lo u_hi)[i]

and ``u = K_res[n] B_k`` is linear in ``K_res[n]``, so with, for every query row ``g`` of the
group and rank column ``k``,

    Fc[i, (g, k)] = q_lo[g, i] B_lo[k, i] + q_hi[g, i] B_hi[k, i]
    Fs[i, (g, k)] = q_hi[g, i] B_lo[k, i] - q_lo[g, i] B_hi[k, i]

a key tile's scores are ``W = cos_n @ Fc + sin_n @ Fs`` (``[keys, G * r]``, two dense
tensor-core products with K = D/2, nothing padded but G to a power of two) followed by the
contraction ``score[n, g] = sum_k K_res[n, k] W[n, (g, k)]``. No per-key rotation, no
rotate-half, no transpose of a rebuilt key. It does ``D x G x r`` multiply-adds per key and KV
head, about twice the rotate form's padded products, as two well-shaped products instead of
four small ones and the elementwise rotation between them.

Where a tile's cos/sin come from (``ANGLE_ADD``):

* False: the rows at the keys' absolute positions, read from the table (rope.py):
  ``2 x D/2 x 4`` bytes per key and program from the float32 table (from L2; the table is
  shared by all sequences), half that from its copy in the queries' dtype, which the dots
  round the rows to anyway (``residual_scores(table16=True)``; H200 round 15: the rows'
  bytes, not the products, bounded this pass);
* True: angle addition moved onto the folded matrices. ``cos_{n0+j} Fc + sin_{n0+j} Fs =
  cos_j (cos_n0 Fc + sin_n0 Fs) + sin_j (cos_n0 Fs - sin_n0 Fc)``: the program holds the
  rows ``j < BLOCK_N`` for the whole loop and rotates ``Fc, Fs`` by the tile start's one row
  (``D/2 x G r`` pairs per tile, no per-key table read).

Grid ``(batch, n_kv / KV_HEADS, chunks)``; ``Fc, Fs`` live for the whole program. A program
takes ``KV_HEADS`` KV heads of its row, their folded matrices side by side (``[D/2, KV_HEADS
G r]``): each tile's residual and cos/sin rows serve all of them in one product. With
``PREFETCH`` the loop holds the next tile's residual rows (a gather the pipeliner does not
load ahead); with ``LAUNCH_DEPENDENTS`` the programs let the next launch start
(``griddepcontrol``, pass 2 with ``pdl``). Output buffers are the caller's
(``residual_scores``).

``LOGITS`` is pass 1 of the materialized-scores decode (residual_msc.py): the program also
streams its KV head's ``K_base`` tiles, adds ``K_base @ q^T`` (keys as M, one more product
per tile) and writes the whole logit scaled into the log2 domain, for every row (a row
without an adapter gets the base term alone).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from forkserve.kernels.residual_triton import (
    base_key_tile,
    fold_queries,
    group_base_scores,
    group_queries_t,
    residual_rows_ahead,
    residual_rows_step,
    residual_tile,
)
from forkserve.kernels.rope_triton import rope_row, rope_rows, rope_rows_at
from forkserve.kernels.score_progress import ScoreProgress, publish_keys, reset_progress
from forkserve.kernels.split_kv import waves_of


@triton.jit
def _qfold_score_kernel(
    Q, KR, BK, RopeTable, ResBlockTables, SeqLens, AdapterIdx, Bias, K, BlockTables, KvStarts,
    Flags, rank, chunk_len, segment, qk_scale,
    stride_qb, stride_qh, stride_rp, stride_rs, stride_ba, stride_br, stride_rbt,
    stride_sb, stride_sh, stride_kp, stride_ks, stride_kh, stride_bt, stride_fb, stride_fh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr,
    ANGLE_ADD: tl.constexpr, LOGITS: tl.constexpr = False, BASE_N: tl.constexpr = 16,
    SEQ_START: tl.constexpr = False, PREFETCH: tl.constexpr = False, KV_HEADS: tl.constexpr = 1,
    LAUNCH_DEPENDENTS: tl.constexpr = False, PUBLISH: tl.constexpr = False,
    SPIN: tl.constexpr = False,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    SLOT_ROWS: tl.constexpr = KV_HEADS * BLOCK_G
    COLS: tl.constexpr = SLOT_ROWS * RANK
    b = tl.program_id(0)
    kvh = tl.program_id(1) * KV_HEADS
    chunk = tl.program_id(2)
    if PUBLISH:
        # Pass 2 follows this program's keys (score_progress.py); it may start only once
        # the flags read zero.
        f_ptr = Flags + b * stride_fb + kvh * stride_fh + chunk
        reset_progress(f_ptr, KV_HEADS, stride_fh, LAUNCH_DEPENDENTS)
    elif LAUNCH_DEPENDENTS:
        # The next launch (pass 2, ``pdl``) may start once every program here has: it
        # waits for this grid's end before reading the scores.
        gdc_launch_dependents()
    adapter = tl.load(AdapterIdx + b)
    has_ad = adapter >= 0
    a_safe = tl.maximum(adapter, 0)
    seq_len = tl.load(SeqLens + b)
    if SEQ_START:
        # Split-form cascade, tiled scores: only the keys from the row's suffix start (its
        # prefix keys are scored per tile), cut over the chunks in this row (graph-safe).
        key0 = tl.load(KvStarts + b)
        chunk_len = tl.cdiv(tl.cdiv(tl.maximum(seq_len - key0, 0), tl.num_programs(2)),
                            BLOCK_N) * BLOCK_N
        start = key0 + chunk * chunk_len
    else:
        start = chunk * chunk_len
    stop = tl.minimum(start + chunk_len, seq_len)
    if not LOGITS:
        stop = tl.where(has_ad, stop, start)  # no adapter: pass 2 never reads the bias

    # The groups' queries folded into B_k: column (h, g, k) = KV head kvh + h, query row g
    # of its group, rank column k. The KV heads of one program share each tile's K_res and
    # cos/sin rows (one product N = KV_HEADS G r wide).
    col = tl.arange(0, COLS)
    h = col // (BLOCK_G * RANK)
    g = (col // RANK) % BLOCK_G
    k = col % RANK
    fold_c, fold_s = fold_queries(
        Q, BK, b * stride_qb + ((kvh + h) * GROUP + g) * stride_qh, g < GROUP,
        a_safe * stride_ba + k * stride_br + (kvh + h) * HEAD_DIM, k < rank, HALF)
    dt = Q.dtype.element_ty
    if ANGLE_ADD:
        cos_j, sin_j = rope_rows(RopeTable, BLOCK_N, HALF)
        cos_j = cos_j.to(dt)
        sin_j = sin_j.to(dt)
    else:
        fc = fold_c.to(dt)
        fs = fold_s.to(dt)

    r = tl.arange(0, RANK)
    rows = tl.arange(0, SLOT_ROWS)
    row_ok = rows % BLOCK_G < GROUP
    heads = (kvh + rows // BLOCK_G) * GROUP + rows % BLOCK_G
    s_ptr = Bias + b * stride_sb + heads[None, :] * stride_sh
    if LOGITS:
        # The group's queries as the N operand of the base product (keys as M).
        q_t = group_queries_t(Q, b * stride_qb, kvh, stride_qh, GROUP, HEAD_DIM, BASE_N)
    table_row = b * stride_rbt
    if PREFETCH:
        # The residual rows feed the contraction, not a dot, and sit behind a residual-table
        # gather: the pipeliner loads neither ahead (only the cos/sin rows), so without this
        # every tile waits on two dependent L2 reads. Here the loop holds tile i + 1's rows
        # and tile i + 2's offsets.
        kr_next, r_off_next = residual_rows_ahead(KR, ResBlockTables, table_row, start, stop,
                                                  has_ad, r, rank, stride_rp, stride_rs,
                                                  PAGE_SIZE, BLOCK_N)
    # Keys in segments of ``segment`` (one segment: the whole chunk unless PUBLISH): each
    # segment's tiles one pipelined loop, the CTA barrier of a publish between them (inside
    # the loop it would stop the pipeliner loading the table rows ahead).
    for seg in range(start, stop, segment):
        seg_stop = tl.minimum(seg + segment, stop)
        for start_n in range(seg, seg_stop, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < stop
            if LOGITS:
                k_base = base_key_tile(K, BlockTables, b * stride_bt, offs_n, n_ok, kvh,
                                       stride_kp, stride_ks, stride_kh, PAGE_SIZE, HEAD_DIM)
            # A row without an adapter scores zero here (its residual pages are never read).
            if PREFETCH:
                kr = kr_next
                kr_next, r_off_next = residual_rows_step(
                    KR, ResBlockTables, table_row, start_n, stop, has_ad, r_off_next, r, rank,
                    stride_rp, stride_rs, PAGE_SIZE, BLOCK_N)
            else:
                kr = residual_tile(KR, ResBlockTables, table_row, offs_n, n_ok & has_ad, r,
                                   rank, stride_rp, stride_rs, PAGE_SIZE)
            if ANGLE_ADD:
                cos_b, sin_b = rope_row(RopeTable, start_n, HALF)
                wc = fold_c * cos_b[:, None] + fold_s * sin_b[:, None]
                ws = fold_s * cos_b[:, None] - fold_c * sin_b[:, None]
                w = tl.dot(cos_j, wc.to(dt))
                w = tl.dot(sin_j, ws.to(dt), w)
            else:
                cos, sin = rope_rows_at(RopeTable, offs_n, n_ok, HALF)
                w = tl.dot(cos.to(dt), fc)
                w = tl.dot(sin.to(dt), fs, w)
            # score[n, g] = sum_k K_res[n, k] W[n, (g, k)]
            sc = tl.sum(tl.reshape(w, [BLOCK_N, SLOT_ROWS, RANK])
                        * kr.to(tl.float32)[:, None, :], 2)
            if LOGITS:
                sc = ((sc + group_base_scores(k_base, q_t, BLOCK_N, BLOCK_G, BASE_N))
                      * qk_scale)
                # Chunks start at multiples of BLOCK_N: vector stores along a head's keys.
                offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
            tl.store(s_ptr + offs_n[:, None], sc.to(Bias.dtype.element_ty),
                     mask=n_ok[:, None] & row_ok[None, :])
        if PUBLISH:
            publish_keys(f_ptr, seg_stop, KV_HEADS, stride_fh, SPIN)


def score_chunk(span: int, programs: int, block_n: int, device: torch.device,
                chunk: int | None = None, waves: int = 2) -> int:
    """Keys per score-pass program over ``span`` keys: ``chunk`` rounded up to whole
    ``block_n`` tiles, default enough chunks of ``programs`` programs for about ``waves``
    waves on ``device``."""
    if chunk is None:
        chunk = -(-span // waves_of(programs, device, waves))
    return whole_tiles(chunk, block_n)


def whole_tiles(keys: int, block_n: int) -> int:
    """``keys`` rounded up to whole ``block_n``-key tiles, one tile at least."""
    return max(block_n, -(-keys // block_n) * block_n)


def qfold_scores(q: torch.Tensor, k_res: torch.Tensor, res_block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, b_k_all: torch.Tensor, adapter_idx: torch.Tensor,
                 rope_table: torch.Tensor, n_kv: int, bias: torch.Tensor, *, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 2, chunk: int | None = None,
                 angle_add: bool = True,
                 logits: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                 kv_starts: torch.Tensor | None = None, prefetch: bool = False,
                 kv_heads: int = 1, pdl: bool = False, waves: int = 2,
                 progress: ScoreProgress | None = None) -> None:
    """Write the residual scores into ``bias [batch, H, >= max key]`` (see the module
    docstring; ``residual_scores(form="qfold")`` allocates it). ``chunk``: keys per program
    (default: about ``waves`` waves of ``batch x n_kv / kv_heads`` programs). ``logits``:
    ``(k_base, block_tables, qk_scale)``: write whole logits instead,
    ``(q.K_base + q.RoPE(K_res B_k)) * qk_scale``, for every row (adapter -1: the base
    term alone); residual_msc.py.
    ``kv_starts [batch]``: score only keys ``kv_starts[b] .. seq_lens[b]`` of each row, its
    range cut over the same number of chunks (residual_score_tiled.py scores the rest).
    ``prefetch``: load each key tile's residual rows a tile ahead (``PREFETCH``).
    ``kv_heads``: KV heads per program (a divisor of ``n_kv``), sharing each key tile's
    residual and cos/sin rows; 1 with ``logits``. ``pdl`` (CUDA sm_90+): let the next launch
    start programmatically while this one runs (it must wait before reading the scores).
    ``progress`` (residual scores over every key): publish the written keys in its flags
    after each of its segments (score_progress.py), in chunks of its ``chunk_len``
    (``chunk`` is then unused)."""
    if logits is not None and kv_starts is not None:
        raise ValueError("kv_starts is a residual-score option; msc's logits cover every key")
    if progress is not None and (logits is not None or kv_starts is not None
                                 or progress.chunk_len % block_n or progress.segment % block_n):
        raise ValueError("progress: residual scores over every key, in chunks and segments "
                         f"of whole {block_n}-key tiles (chunk_len {progress.chunk_len}, "
                         f"segment {progress.segment})")
    if kv_heads < 1 or n_kv % kv_heads or (logits is not None and kv_heads != 1):
        raise ValueError(f"kv_heads {kv_heads!r}: a divisor of the {n_kv} KV heads, 1 with "
                         "logits")
    batch, n_heads, head_dim = q.shape
    span = bias.shape[2]
    chunk = (score_chunk(span, batch * n_kv // kv_heads, block_n, q.device, chunk, waves)
             if progress is None else progress.chunk_len)
    group = n_heads // n_kv
    rank = b_k_all.shape[1]
    k_base, block_tables, qk_scale = logits if logits is not None else (None, None, 1.0)
    base_strides = ((k_base.stride(0), k_base.stride(1), k_base.stride(2), block_tables.stride(0))
                    if logits is not None else (0, 0, 0, 0))
    flags = None if progress is None else progress.flags
    _qfold_score_kernel[(batch, n_kv // kv_heads, -(-span // chunk))](
        q, k_res, b_k_all, rope_table, res_block_tables, seq_lens, adapter_idx, bias,
        k_base, block_tables, kv_starts, flags, rank, chunk,
        chunk if progress is None else progress.segment, qk_scale,
        q.stride(0), q.stride(1), k_res.stride(0), k_res.stride(1),
        b_k_all.stride(0), b_k_all.stride(1), res_block_tables.stride(0),
        bias.stride(0), bias.stride(1), *base_strides,
        *((flags.stride(0), flags.stride(1)) if flags is not None else (0, 0)),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        PAGE_SIZE=k_res.shape[1], BLOCK_N=block_n, RANK=max(16, triton.next_power_of_2(rank)),
        ANGLE_ADD=angle_add, LOGITS=logits is not None,
        BASE_N=max(16, triton.next_power_of_2(group)), SEQ_START=kv_starts is not None,
        PREFETCH=prefetch, KV_HEADS=kv_heads, LAUNCH_DEPENDENTS=pdl,
        PUBLISH=progress is not None, SPIN=q.is_cuda, num_warps=num_warps,
        num_stages=num_stages,
    )
