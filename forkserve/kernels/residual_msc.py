"""Materialized-scores ResidualAttention decode (``residual_decode_triton(variant="msc")``,
option (c) of issue 15 in docs/KERNELS.md).

Two-pass decode splits the work by kind: pass 1 computes the residual score (compute, few
bytes), pass 2 streams K and V and adds it. Pass 2 alone then costs ~1.3-1.4x unified on the
H200, so even a free pass 1 misses the goal. Here the split is by stream instead, each pass
reading about half of unified's bytes:

* pass 1 (``residual_logits``; the q-folded score kernel in its ``LOGITS`` mode,
  residual_score_qfold.py): per KV head and key tile, reads ``K_base`` and ``K_res``, and
  writes the whole logit ``(q.K_base + q.RoPE(K_res B_k)) * scale * log2(e)`` of every
  query head to ``[batch, H, keys]`` (keys contiguous per head, so pass 2 reads a head's
  tile as one row). The folded residual products run under the K stream.
* pass 2 (decode_attention.py's partial kernel with ``RES_LOGITS``): the split-K online
  softmax over the logits, ``acc += p V_base``, ``acc_r += p V_res`` (rank r), ``B_v`` once
  per split, the usual merge. No K read, no q.K product.

Logits are float32 by default: they are the softmax argument itself (a float16 logit of 30
in the log2 domain is off by up to 0.008, i.e. ~0.5% on its weight), and they cost 128 B per
key for 32 heads, written once and read once (~6% over unified's 4 KiB of K/V; float16 halves
that, ``dtype=torch.float16``). Written in the log2 domain so pass 2 applies no scale.
Rows without an adapter get the base logits (their residual pages are never read).
Budgets per key and the H200 command: docs/KERNELS.md.
"""
from __future__ import annotations

import torch

from forkserve.kernels.residual_score_qfold import qfold_scores
from forkserve.kernels.split_kv import LOG2E

# Pass 1 default: the q-folded score pass's best H200 form in decode v4 (cos/sin rows from
# the table, 64-key tiles). Pass 2's key tile is the variant's ``block_n``.
MSC_TUNING = {"block_n": 64, "angle_add": False}


def empty_logits(q: torch.Tensor, max_seq_len: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An unwritten logits buffer for ``q [batch, H, D]`` over ``max_seq_len`` keys."""
    batch, n_heads, _ = q.shape
    # Rows padded to 16 entries: the JIT then knows every head's row is aligned, and both
    # passes move the logits in vectors (pass 2: 96 instead of 160 registers).
    span = -(-max(max_seq_len, 1) // 16) * 16
    return torch.empty(batch, n_heads, span, dtype=dtype, device=q.device)


def residual_logits(q: torch.Tensor, k_base: torch.Tensor, block_tables: torch.Tensor,
                    k_res: torch.Tensor, res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    b_k_all: torch.Tensor, adapter_idx: torch.Tensor, rope_table: torch.Tensor,
                    scale: float, max_seq_len: int, *, dtype: torch.dtype = torch.float32,
                    block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                    chunk: int | None = None, angle_add: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 1: ``[batch, H, max_seq_len]`` logits ``q.K * scale * log2(e)`` at every key
    ``n < seq_len`` (other entries unwritten). ``block_n``, ``num_warps``, ``num_stages``,
    ``chunk`` (keys per program), ``angle_add`` (cos/sin by angle addition instead of table
    rows): the q-folded score kernel's tuning. ``out``: an ``empty_logits`` buffer to write
    (a call split into launches over buffers allocated once); ``dtype`` is then its own."""
    logits = empty_logits(q, max_seq_len, dtype) if out is None else out
    qfold_scores(q, k_res, res_block_tables, seq_lens, b_k_all, adapter_idx, rope_table,
                 k_base.shape[2], logits, block_n=block_n, num_warps=num_warps,
                 num_stages=num_stages, chunk=chunk, angle_add=angle_add,
                 logits=(k_base, block_tables, scale * LOG2E))
    return logits
