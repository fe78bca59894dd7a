"""FlashAttention-4 (``flash_attn.cute``, pip ``flash-attn-4``: CuTe-DSL kernels) as the
prefill's library kernel on Hopper: varlen over contiguous K/V, and paged over our pools
through the block tables, with no gather.

Why (H200, Llama-3-8B heads, bf16, causal; ``benchmarks/results/fa4_prefill.json``): torch's
SDPA pick (cuDNN) runs a cold 4K / 8K / 32K prefill at 493 / 591 / 596 TFLOP/s, FA4's varlen
kernel at 602 / 689 / 719 (0.82-0.86x the time), and FA4 reading our page-16 pool through a
shuffled block table at 548 / 624 / 618 (0.90-0.98x SDPA on K/V that is already contiguous).
FA4 compiles once per kernel configuration (~3 s, the first call), not per length, where
cuDNN builds a plan at every new length (~42 ms, ``sdpa_shapes.json``).

Optional: nothing here imports ``flash_attn`` until ``load`` is called, and
``flash_op.flash_support`` calls it only on CUDA devices of ``FA4_CAPABILITIES``; where the
package is missing the prefill keeps FlashAttention-2 and SDPA. FA4's Ampere and Blackwell
paths exist but have not run here, so only sm_90 takes it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# Compute capabilities FA4 is measured on here (its Hopper forward).
FA4_CAPABILITIES = ((9, 0),)


def load() -> Callable:
    """``flash_attn.cute.flash_attn_varlen_func``; raises ImportError (or the DSL's own error
    when its compiler libraries fail to load) where it cannot run."""
    from flash_attn.cute import flash_attn_varlen_func
    return flash_attn_varlen_func


def fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
               cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal (bottom-right per sequence) varlen attention: q ``[total_q, H, D]``, k/v
    ``[total_k, Hkv, D]``, int32 ``cu_q`` / ``cu_k`` offsets, host maxima. ``[total_q, H, D]``."""
    return load()(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                  max_seqlen_k=max_k, softmax_scale=scale, causal=True)[0]


def fa4_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q: torch.Tensor,
              max_q: int, scale: float) -> torch.Tensor:
    """Causal (bottom-right) varlen prefill over the paged cache: q ``[total_q, H, D]``, pools
    ``[pages, page_size, Hkv, D]``, ``block_tables [batch, width]`` (page ids; entries past a
    sequence's pages are never read), ``seq_lens [batch]`` keys per sequence (cached + new),
    int32 ``cu_q``, host ``max_q``. A sequence with no new token attends nothing.
    ``[total_q, H, D]``."""
    return load()(q, k_pool, v_pool, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                  seqused_k=seq_lens.to(torch.int32), page_table=block_tables.to(torch.int32),
                  softmax_scale=scale, causal=True)[0]


def warm(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
         page_size: int, long: int) -> int:
    """Compile, before serving, every FA4 kernel the prefill routes launch (~3 s each on the
    H200, the first call of a configuration; no compile per length after): varlen and paged,
    each with one query tile per sequence (FA4 then schedules statically: a separate
    kernel) and with ``long`` (> 32) queries, at batch 1 and 2. Returns the calls made."""
    calls = 0
    for n in (1, long):
        for batch in (1, 2):
            q = torch.zeros(batch * n, q_heads, head_dim, dtype=dtype, device=device)
            kv = torch.zeros(batch * n, kv_heads, head_dim, dtype=dtype, device=device)
            cu = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=device)
            fa4_varlen(q, kv, kv, cu, cu, n, n, 1.0)
            pages = -(-n // page_size)
            pool = torch.zeros(batch * pages, page_size, kv_heads, head_dim, dtype=dtype,
                               device=device)
            table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, -1)
            lens = torch.full((batch,), n, dtype=torch.int32, device=device)
            fa4_paged(q, pool, pool, table, lens, cu, n, 1.0)
            calls += 2
    return calls
