"""Reconstruct-then-attend in pages: ResidualAttention prefill as a bulk merge of each
sequence's base and residual pages into temporary merged pages, then unified's paged
prefill kernel (the ``MERGED`` route; prefill_policy.py says when).

The fused prefill kernel (prefill_attention.py) rebuilds every key tile once per query
block, which costs 2.3x unified at 8K tokens. Here every page is rebuilt once per layer by
kv_pack.py's kernel (K = K_base + RoPE(K_res B_k), V = V_base + V_res B_v, the reference's
formulas added in float32; so the tests check this path against plain formulas, not the
reference), and the attention runs at unified's speed. The ``FLASH`` route rebuilds the
same way into a packed buffer instead and attends with FlashAttention-2. Decode keeps the
fused kernels: a decode step reads each page once, and merging first would triple its
memory traffic.
"""
from __future__ import annotations

import torch

from forkserve.kernels.kv_pack import ResidualPools, pack_kv
from forkserve.kernels.prefill_policy import PrefillCounts


def merged_pages(k_base: torch.Tensor, v_base: torch.Tensor, residual: ResidualPools,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 counts: PrefillCounts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged K/V pages ``[n, P, Hkv, D]`` (pool dtype) holding the pages of every sequence
    with new tokens, and block tables ``[B, width]`` into them (unused columns, and all of a
    sequence with no new token, point at page 0: the prefill kernel never reads them).
    ``counts`` sizes the pages on the host; the layout is computed on the device, so the
    call can be captured in a CUDA graph. The pages belong to the caller (one layer)."""
    page_size = k_base.shape[1]
    lens = zip(counts.query_lens, counts.seq_lens, strict=True)
    n_pages = sum(-(-s // page_size) for q, s in lens if q)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    key_lens = torch.where(q_lens > 0, seq_lens.to(torch.int32), 0).to(torch.int32)
    pages = (key_lens + page_size - 1) // page_size
    first = torch.cumsum(pages, 0) - pages
    k, v = pack_kv(k_base, v_base, block_tables, key_lens, (first * page_size).to(torch.int64),
                   n_pages * page_size, counts.max_packed_len, residual)
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    tables = torch.where(columns[None, :] < pages[:, None], first[:, None] + columns[None, :], 0)
    shape = (n_pages, page_size, *k.shape[1:])
    return k.view(shape), v.view(shape), tables.to(block_tables.dtype)
