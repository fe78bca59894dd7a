"""Materialized scores with pass 1 on two streams (``residual_decode_triton(variant="msc2s")``;
docs/KERNELS.md, "Round 5").

msc's pass 1 (residual_msc.py) streams ``K_base`` and computes the q-folded residual score in
one program; on the H200 the two do not overlap (pass 1 costs 1.23-1.41x unified from batch
8, about the residual score alone, 0.50-0.60x, plus a K read). Here they are two launches on
two CUDA streams, so a memory-bound and a compute-bound kernel share the SMs side by side:

* ``_base_logits_kernel`` (this module): per sequence, KV head and chunk of keys, the GQA
  group's ``q.K_base`` with keys as M (one tensor-core product per tile, residual_triton.py's
  helpers, as msc's pass 1), scaled into the log2 domain and written for every row to
  ``logits [batch, H, keys]`` (msc's contract: a row without an adapter is done here);
* ``qfold_scores`` (residual_score_qfold.py, unchanged) on a side stream: the unscaled
  residual score ``q.RoPE(K_res B_k)`` of rows with an adapter into ``bias`` (two-pass's
  contract), float16 for half-precision queries as two-pass's bias;
* pass 2 (decode_attention.py's partial kernel with ``RES_LOGITS`` and ``RES_BIAS``): msc's
  loop over ``V_base``, ``V_res`` and the logits, plus the bias row scaled into the log2
  domain (rows without an adapter do not read it).

Summing in pass 2 instead of having the residual kernel add into the logits keeps the two
kernels independent (no ordering, no read-modify-write of the logits) for 2 B per key and
head read once more (a float16 bias row beside the float32 logit row).

The fork is ``side.wait_stream(main)`` and the join ``main.wait_stream(side)`` around the
residual launch: both are event records and waits, which CUDA graph capture turns into two
parallel branches. Both buffers are allocated on the main stream before the fork and freed
on it after pass 2 (which runs after the join), so the caching allocator needs no
``record_stream``. Without CUDA (the interpreter) the halves run one after the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkserve.kernels.residual_score_qfold import qfold_scores
from forkserve.kernels.residual_triton import base_key_tile, group_base_scores, group_queries_t
from forkserve.kernels.split_kv import LOG2E, sm_count
from forkserve.kernels.streams import side_by_side

# Base kernel: 64-key tiles, 4 warps (34 registers, 37 KiB of shared memory on sm_90a),
# at most about two programs per SM. Residual scorer: the q-folded form with table rows at
# 64-key tiles (decode v4's best score pass; 120 registers, 50 KiB) at most about one
# program per SM per launch (``residual_bias``), which leaves room for four base programs
# beside it: unbounded, the kernel the scheduler starts first could fill every SM (4
# residual programs fit one). Logits float32 (msc's reasons); the bias float16 for
# half-precision queries.
MSC2S_TUNING = {"block_n": 64, "num_warps": 4, "waves": 2.0,
                "residual": {"block_n": 64, "angle_add": False, "waves": 1.0}}


@triton.jit
def _base_logits_kernel(
    Q, K, BlockTables, SeqLens, Logits, chunk_len, qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_sb, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BASE_N: tl.constexpr,
):
    """``Logits[b, h, n] = q[b, h] . K_base[n] * qk_scale`` for keys ``n`` of chunk
    ``program_id(2)`` of sequence ``b``, the GQA group of KV head ``program_id(1)``.
    Grid ``(batch, n_kv, chunks)``; every key is read once per KV head."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    start = tl.program_id(2) * chunk_len
    stop = tl.minimum(start + chunk_len, tl.load(SeqLens + b))
    q_t = group_queries_t(Q, b * stride_qb, kvh, stride_qh, GROUP, HEAD_DIM, BASE_N)
    rows = tl.arange(0, BLOCK_G)
    l_ptr = Logits + b * stride_sb + (kvh * GROUP + rows)[None, :] * stride_sh
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        k_tile = base_key_tile(K, BlockTables, b * stride_bt, offs_n, n_ok, kvh, stride_kp,
                               stride_ks, stride_kh, PAGE_SIZE, HEAD_DIM)
        sc = group_base_scores(k_tile, q_t, BLOCK_N, BLOCK_G, BASE_N) * qk_scale
        # Chunks start at multiples of BLOCK_N: vector stores along a head's keys.
        offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
        tl.store(l_ptr + offs_n[:, None], sc.to(Logits.dtype.element_ty),
                 mask=n_ok[:, None] & (rows < GROUP)[None, :])


def chunk_keys(span: int, n_programs: int, device: torch.device, waves: float,
               block_n: int) -> int:
    """Keys per program (a multiple of ``block_n``) for at most about ``waves`` programs
    per SM when ``n_programs`` (sequences x KV heads) cut ``span`` keys each (rounded
    down: never more programs than that, unless ``n_programs`` alone is)."""
    cuts = max(1, int(waves * sm_count(device)) // max(n_programs, 1))
    per_program = -(-span // cuts)
    return max(block_n, -(-per_program // block_n) * block_n)


def base_logits(q: torch.Tensor, k_base: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, logits: torch.Tensor, qk_scale: float, *,
                block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                waves: float = 2.0) -> None:
    """Write ``q.K_base * qk_scale`` into ``logits [batch, H, span]`` at every key
    ``n < seq_len`` of every row (see the kernel)."""
    batch, n_heads, head_dim = q.shape
    n_kv = k_base.shape[2]
    group = n_heads // n_kv
    span = logits.shape[2]
    chunk = chunk_keys(span, batch * n_kv, q.device, waves, block_n)
    _base_logits_kernel[(batch, n_kv, -(-span // chunk))](
        q, k_base, block_tables, seq_lens, logits, chunk, qk_scale,
        q.stride(0), q.stride(1), k_base.stride(0), k_base.stride(1), k_base.stride(2),
        block_tables.stride(0), logits.stride(0), logits.stride(1),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        PAGE_SIZE=k_base.shape[1], BLOCK_N=block_n,
        BASE_N=max(16, triton.next_power_of_2(group)), num_warps=num_warps, num_stages=num_stages,
    )


def residual_bias(q: torch.Tensor, k_res: torch.Tensor, res_block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, b_k_all: torch.Tensor, adapter_idx: torch.Tensor,
                  rope_table: torch.Tensor, n_kv: int, bias: torch.Tensor, tuning: dict) -> None:
    """Write the unscaled residual scores of rows with an adapter into ``bias`` with
    ``qfold_scores``; ``tuning``: its keywords, plus ``waves`` (default 2): at most about
    that many programs per SM per launch.

    A large batch has more (row, KV head) programs than that even uncut (512 at batch 64,
    up to 4 resident per SM at 64-key tiles), and if they all start first they leave no room
    for the base kernel beside them. So the rows go in slices of about ``waves`` x SMs
    programs, one launch each on the side stream (views of the same buffers), and each
    launch cuts its keys into chunks for that many programs unless ``chunk`` is given."""
    tuning = dict(tuning)
    waves = tuning.pop("waves", 2.0)
    batch, span = q.shape[0], bias.shape[2]
    budget = max(1, round(waves * sm_count(q.device)))
    rows = max(1, budget // n_kv)
    for s in range(0, batch, rows):
        e = min(s + rows, batch)
        chunk = tuning.get("chunk") or chunk_keys(span, (e - s) * n_kv, q.device, waves,
                                                  tuning.get("block_n", 64))
        qfold_scores(q[s:e], k_res, res_block_tables[s:e], seq_lens[s:e], b_k_all,
                     adapter_idx[s:e], rope_table, n_kv, bias[s:e], **{**tuning, "chunk": chunk})


def split_logits(q: torch.Tensor, k_base: torch.Tensor, block_tables: torch.Tensor,
                 k_res: torch.Tensor, res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 b_k_all: torch.Tensor, adapter_idx: torch.Tensor, rope_table: torch.Tensor,
                 scale: float, max_seq_len: int, *, dtype: torch.dtype = torch.float32,
                 bias_dtype: torch.dtype | None = None, block_n: int = 64, num_warps: int = 4,
                 num_stages: int = 2, waves: float = 2.0,
                 residual: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 on two streams: ``(logits, bias)``, both ``[batch, H, span]`` with the same
    strides. ``logits``: ``q.K_base * scale * log2(e)`` of every row at keys ``n < seq_len``
    (``dtype``); ``bias``: the unscaled residual score of rows with an adapter
    (``bias_dtype``, default float32 for float32 queries, else float16); other entries
    unwritten. ``block_n``, ``num_warps``, ``num_stages``, ``waves``: the base kernel's
    tuning; ``residual``: ``residual_bias``'s (default ``MSC2S_TUNING``'s)."""
    batch, n_heads, _ = q.shape
    n_kv = k_base.shape[2]
    if bias_dtype is None:
        bias_dtype = torch.float32 if q.dtype == torch.float32 else torch.float16
    # Rows padded to 16 entries, as msc's: aligned rows, vector loads in pass 2.
    span = -(-max(max_seq_len, 1) // 16) * 16
    logits = torch.empty(batch, n_heads, span, dtype=dtype, device=q.device)
    bias = torch.empty(batch, n_heads, span, dtype=bias_dtype, device=q.device)
    side_by_side(
        lambda: base_logits(q, k_base, block_tables, seq_lens, logits, scale * LOG2E,
                            block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                            waves=waves),
        lambda: residual_bias(q, k_res, res_block_tables, seq_lens, b_k_all, adapter_idx,
                              rope_table, n_kv, bias,
                              MSC2S_TUNING["residual"] if residual is None else residual),
        q.device)
    return logits, bias
