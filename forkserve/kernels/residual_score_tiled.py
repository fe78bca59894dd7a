"""The split-form cascade's score pass over a tile's prefix keys (``variant="tiled_scores"``).

Same output as two-pass decode's score pass (``Bias[b, h, n] = q[b, h] . RoPE_n(K_res[b, n]
B_k[adapter_b])``, unscaled) for the prefix keys of every row of a cascade tile. The
q-folded pass (residual_score_qfold.py) runs one program per (row, KV head, chunk) and
multiplies, per key tile, the keys' cos|sin rows ``[keys, D]`` by the row's folded matrix
``[D, G r]``; every program reads those table rows again (512 B per key from L2: ~1 GB per
layer at 8K keys x 32 rows x 8 KV heads). The rows of a cascade tile have the same prefix
positions, so here one program takes ``SLOTS = AGENTS x KV_HEADS`` (row, KV head) pairs of
one tile: it loads each key tile's cos|sin rows once and multiplies them by the slots'
folded matrices side by side, ``[D, SLOTS G r]`` (a GQA group of 4 at rank 16: N = 64 per
slot; 2 slots fill two warpgroups' N = 64 each, 4 slots N = 256), then contracts each slot's
columns with its own row's ``K_res`` tile. Table reads drop by ``SLOTS``; the multiply-adds
stay (``D G r`` per key and slot), in products N = ``SLOTS G r`` wide instead of ``G r``.

Grid ``(tiles, n_kv / KV_HEADS, agent blocks x chunks)``; each program finds its block and
its share of the tile's prefix itself, so a CUDA graph captures one shape for any grouping
(``tile_seqs``, ``tile_lens`` as in shared_prefix.py). The keys a row has past its tile's
prefix (its suffix, or all of a row in no tile) are the per-row q-folded pass's, from
``kv_starts`` (``tiled_scores``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkserve.kernels.residual_score_qfold import qfold_scores
from forkserve.kernels.residual_triton import fold_queries, residual_offsets
from forkserve.kernels.rope import rope_table_in
from forkserve.kernels.split_kv import waves_of

# The per-row pass over the suffixes (qfold_scores' tuning): the batch >= 17 row of
# SCORE_TUNING_BY_BATCH.
SUFFIX_SCORE_TUNING = {"angle_add": False, "block_n": 64}


@triton.jit
def _slot_rows(TileSeqs, AdapterIdx, tile, agent, SEQS: tl.constexpr):
    """The sequence (-1: none) and adapter (-1: none) of the tile's agents ``agent``."""
    seq = tl.load(TileSeqs + tile * SEQS + agent, mask=agent < SEQS, other=-1)
    adapter = tl.load(AdapterIdx + tl.maximum(seq, 0), mask=seq >= 0, other=-1)
    return seq, adapter


@triton.jit
def _tiled_score_kernel(
    Q, KR, BK, RopeTable, ResBlockTables, SeqLens, AdapterIdx, TileSeqs, TileLens, Bias,
    rank, stride_qb, stride_qh, stride_rp, stride_rs, stride_ba, stride_br, stride_rbt,
    stride_sb, stride_sh,
    SEQS: tl.constexpr, AGENTS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, RANK: tl.constexpr, SEQS_P2: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    SLOTS: tl.constexpr = AGENTS * KV_HEADS
    SLOT_COLS: tl.constexpr = BLOCK_G * RANK
    tile = tl.program_id(0)
    kvh0 = tl.program_id(1) * KV_HEADS
    # The prefix as the tiled launch reads it (decode_attention.py, TILED).
    first = tl.load(TileSeqs + tile * SEQS)
    kv_end = tl.where(first >= 0, tl.minimum(tl.load(SeqLens + tl.maximum(first, 0)),
                                             tl.load(TileLens + tile)), 0)
    # The tile's programs go to its blocks of AGENTS up to its last listed agent: a graph's
    # tiles are as wide as the widest group (-1 pads), so a tile of 8 agents in 32 places
    # gets all its programs, not a quarter of them.
    at = tl.arange(0, SEQS_P2)
    listed = tl.load(TileSeqs + tile * SEQS + at, mask=at < SEQS, other=-1) >= 0
    blocks = tl.maximum(tl.cdiv(tl.max(tl.where(listed, at + 1, 0), 0), AGENTS), 1)
    chunks = tl.num_programs(2) // blocks
    agent0 = (tl.program_id(2) % blocks) * AGENTS
    chunk = tl.program_id(2) // blocks

    # Slot s = (agent s // KV_HEADS, KV head s % KV_HEADS); a slot without an adapter is
    # never read by the later passes, so it scores nothing.
    slot = tl.arange(0, SLOTS)
    seq, adapter = _slot_rows(TileSeqs, AdapterIdx, tile, agent0 + slot // KV_HEADS, SEQS)
    live = adapter >= 0
    seq = tl.maximum(seq, 0)
    kvh = kvh0 + slot % KV_HEADS
    # The num_programs % blocks left over (chunk == chunks) have nothing to do.
    span = tl.where((tl.max(live.to(tl.int32), 0) > 0) & (chunk < chunks), kv_end, 0)
    key_split = tl.cdiv(tl.cdiv(span, chunks), BLOCK_N) * BLOCK_N
    start = chunk * key_split
    stop = tl.minimum(start + key_split, span)

    # The slots' folded matrices side by side: column (s, g, k) = slot s, query row g of its
    # group, rank column k.
    col = tl.arange(0, SLOTS * SLOT_COLS)
    c_slot = col // SLOT_COLS
    g = (col // RANK) % BLOCK_G
    k = col % RANK
    c_seq, c_ad = _slot_rows(TileSeqs, AdapterIdx, tile, agent0 + c_slot // KV_HEADS, SEQS)
    c_kvh = kvh0 + c_slot % KV_HEADS
    fold_c, fold_s = fold_queries(
        Q, BK, tl.maximum(c_seq, 0) * stride_qb + (c_kvh * GROUP + g) * stride_qh,
        (g < GROUP) & (c_seq >= 0),
        tl.maximum(c_ad, 0) * stride_ba + k * stride_br + c_kvh * HEAD_DIM,
        (k < rank) & (c_ad >= 0), HALF)
    # [Fc; Fs] as one [D, columns] operand: a table row is [cos | sin], so one product with
    # K = D replaces two with K = D/2 (and the accumulator's layout change between them).
    dt = Q.dtype.element_ty
    fold = tl.reshape(tl.permute(tl.join(fold_c, fold_s), (2, 0, 1)),
                      (HEAD_DIM, SLOTS * SLOT_COLS)).to(dt)
    d = tl.arange(0, HEAD_DIM)

    r = tl.arange(0, RANK)
    gg = tl.arange(0, BLOCK_G)
    s_ptr = (Bias + (seq * stride_sb)[None, :, None]
             + ((kvh * GROUP)[None, :, None] + gg[None, None, :]) * stride_sh)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        # One table tile (the keys' [cos | sin] rows, rope.py) for every slot: the point.
        cs = tl.load(RopeTable + offs_n[:, None] * HEAD_DIM + d[None, :], mask=n_ok[:, None],
                     other=0.0)
        w = tl.dot(cs.to(dt), fold)
        res_ok = n_ok[:, None] & live[None, :]
        r_off = residual_offsets(ResBlockTables, (seq * stride_rbt)[None, :], offs_n[:, None],
                                 res_ok, stride_rp, stride_rs, PAGE_SIZE)
        kr = tl.load(KR + r_off[:, :, None] + r[None, None, :],
                     mask=res_ok[:, :, None] & (r < rank)[None, None, :], other=0.0)
        # score[n, s, g] = sum_k K_res[row_s, n, k] W[n, (s, g, k)]
        sc = tl.sum(tl.reshape(w, [BLOCK_N, SLOTS, BLOCK_G, RANK])
                    * kr.to(tl.float32)[:, :, None, :], 3)
        tl.store(s_ptr + offs_n[:, None, None], sc.to(Bias.dtype.element_ty),
                 mask=res_ok[:, :, None] & (gg < GROUP)[None, None, :])


def tiled_scores(q: torch.Tensor, k_res: torch.Tensor, res_block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, b_k_all: torch.Tensor, adapter_idx: torch.Tensor,
                 rope_table: torch.Tensor, n_kv: int, bias: torch.Tensor, tile_seqs: torch.Tensor,
                 tile_lens: torch.Tensor, kv_starts: torch.Tensor, *, agents: int = 2,
                 kv_heads: int = 1, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
                 chunks: int | None = None, suffix: dict | None = None,
                 table16: bool = False) -> None:
    """Every row's residual scores into ``bias [batch, H, >= max key]`` (as
    ``residual_scores`` writes them): the prefix keys of each cascade tile by this module's
    kernel, ``agents`` rows x ``kv_heads`` KV heads per program; each row's keys from
    ``kv_starts`` by the per-row q-folded pass (``suffix``: its tuning, default
    ``SUFFIX_SCORE_TUNING``). ``chunks``: programs per block of ``agents`` and KV heads in
    a full tile (default: about two waves of programs; a tile listing fewer agents spreads
    the same programs over its blocks). ``agents``, ``kv_heads``: powers of two. The defaults
    are picked from registers, not measured on the H200 (sm_90a, ptxas): 2 slots (N = 128)
    over 8 warps at 64-key tiles take 117 registers, two programs per SM; 4 slots (N = 256)
    take 175, one (docs/KERNELS.md). ``table16``: both passes read the table's copy in the
    queries' dtype (``rope.rope_table_in``; the rows their dots round to anyway)."""
    _, n_heads, head_dim = q.shape
    if n_kv % kv_heads or kv_heads & (kv_heads - 1) or agents & (agents - 1):
        raise ValueError(f"agents={agents} and kv_heads={kv_heads} must be powers of two, "
                         f"kv_heads dividing the {n_kv} KV heads")
    n_tiles, seqs = tile_seqs.shape
    agents = min(agents, triton.next_power_of_2(seqs))
    blocks = -(-seqs // agents)
    programs = n_tiles * blocks * (n_kv // kv_heads)
    if chunks is None:
        chunks = max(1, min(waves_of(programs, q.device), -(-bias.shape[2] // block_n)))
    group = n_heads // n_kv
    if table16:
        rope_table = rope_table_in(rope_table, q.dtype)
    _tiled_score_kernel[(n_tiles, n_kv // kv_heads, blocks * chunks)](
        q, k_res, b_k_all, rope_table, res_block_tables, seq_lens, adapter_idx, tile_seqs,
        tile_lens, bias, b_k_all.shape[1],
        q.stride(0), q.stride(1), k_res.stride(0), k_res.stride(1),
        b_k_all.stride(0), b_k_all.stride(1), res_block_tables.stride(0),
        bias.stride(0), bias.stride(1),
        SEQS=seqs, AGENTS=agents, KV_HEADS=kv_heads, GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim, PAGE_SIZE=k_res.shape[1],
        BLOCK_N=block_n, RANK=max(16, triton.next_power_of_2(b_k_all.shape[1])),
        SEQS_P2=triton.next_power_of_2(seqs), num_warps=num_warps, num_stages=num_stages,
    )
    qfold_scores(q, k_res, res_block_tables, seq_lens, b_k_all, adapter_idx, rope_table, n_kv,
                 bias, kv_starts=kv_starts, **(SUFFIX_SCORE_TUNING if suffix is None else suffix))
