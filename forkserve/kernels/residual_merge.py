"""Reconstruct-then-attend: ResidualAttention prefill as a bulk merge of each sequence's
base and residual pages into temporary merged pages, then unified's paged prefill kernel.

The fused prefill kernel (prefill_attention.py) rebuilds every key tile once per query
block, which costs 2.3x unified at 8K tokens. Here every page is rebuilt once per layer
(K = K_base + RoPE(K_res B_k), V = V_base + V_res B_v, the reference's own formulas,
added in float32; so the tests check this path against plain formulas, not the reference) — a few element-wise passes over the chunk's K/V, small next to the attention —
and the attention runs at unified's speed. Decode keeps the fused kernel: a decode step
reads each page once, and merging first would triple its memory traffic.
"""
from __future__ import annotations

import torch

from forkserve.kernels.reference import lora_delta_k, lora_delta_v


def merged_pages(k_base: torch.Tensor, v_base: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor,
                 block_tables: torch.Tensor, res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged K/V pages ``[n, P, Hkv, D]`` (pool dtype) for the pages each sequence uses, and
    block tables ``[B, width]`` into them. Sequences without an adapter (index -1) copy
    their base pages unchanged."""
    page_size, n_kv = k_base.shape[1], k_base.shape[2]
    width = block_tables.shape[1]
    columns = torch.arange(width, device=block_tables.device)
    used = columns[None, :] < (seq_lens.to(torch.int64)[:, None] + page_size - 1) // page_size
    base = block_tables[used].long()
    residual = res_block_tables[used].long()
    adapter = adapter_idx.to(torch.int64)[:, None].expand(-1, width)[used]
    positions = (columns[None, :].expand(used.shape[0], -1)[used][:, None] * page_size
                 + torch.arange(page_size, device=base.device)[None, :])
    k = k_base[base]
    v = v_base[base]
    # One low-rank matmul per adapter present (a batch holds few), not a B copy per page.
    for a in adapter.unique().tolist():
        if a < 0:
            continue
        rows = (adapter == a).nonzero().squeeze(1)
        dk = lora_delta_k(k_res[residual[rows]], b_k_all[a], positions[rows], inv_freq, n_kv)
        dv = lora_delta_v(v_res[residual[rows]], b_v_all[a], n_kv)
        k[rows] = (k[rows].to(torch.float32) + dk).to(k.dtype)
        v[rows] = (v[rows].to(torch.float32) + dv).to(v.dtype)
    # Page j of sequence b sits at (pages of the sequences before b) + j; unused columns
    # point at page 0 and are never read (each sequence reads only up to its length).
    starts = torch.cumsum(used.sum(dim=1), dim=0) - used.sum(dim=1)
    tables = torch.where(used, starts[:, None] + columns[None, :], torch.zeros_like(columns)[None, :])
    return k, v, tables.to(block_tables.dtype)
