"""Cascade prefill: prefill chunks whose page tables share a prefix read it once per group.

32 agents each prefilling a short observation over one shared 8K context re-read the whole
context per chunk in the paged kernel (prefill_attention.py): every query tile of every
member loads every prefix key. Here the members' query rows are stacked into one query block
per group and attend the shared prefix together; every one of them lies after the prefix,
so no causal mask applies there. Each member then attends its own suffix (its keys from the
prefix's end: a context tail past the last shared page, then its new tokens, causal), and
the partial softmax states merge by log-sum-exp (``split_kv.merge_partials``), so the output
equals plain prefill up to float rounding.

Both passes are ``prefill_attention``'s kernel with its cascade options: the prefix pass
reads the group's table (its first member's) over keys ``[0, prefix)`` with the stacked
rows placed after the prefix (``q_rows``: no copy of q), one launch per split of those keys
(a few stacked tiles over a long prefix would leave most SMs idle: ``prefix_splits``); the
suffix pass each member's own table over ``[prefix, seq_len)``. The grouping is host data
planned once per step (``prefix_groups.py``); nothing here reads the device back. Unified
K/V only (unified, full_reuse, no-LoRA, adaptive merged pages): the split form falls back
to its plain route.
"""
from __future__ import annotations

import torch

from forkserve.kernels.prefill_attention import prefill_launch
from forkserve.kernels.prefix_groups import PREFIX_ROWS, PrefillGroups, gqa_pad
from forkserve.kernels.split_kv import merge_partials

# The prefix launch (no causal mask, many rows per group): tiles of PREFIX_ROWS query rows
# (prefix_groups.py, which plans its splits). A first estimate, to be measured on the H200
# (kernel_bench --cascade-prefill).
PREFIX_TUNING = {"block_n": 64, "num_warps": 8, "num_stages": 2}


def cascade_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, groups: PrefillGroups,
                           scale: float | None = None, max_q_len: int | None = None,
                           prefix_tuning: dict | None = None, block_m: int | None = None,
                           block_n: int = 64, num_warps: int = 4,
                           num_stages: int = 2) -> torch.Tensor:
    """Varlen causal prefill ``q [total_new, H, D]`` over the unified paged cache with each
    group's prefix read once (``groups``). ``max_q_len``: host bound of the suffix launch
    (else one read-back); ``block_m`` .. ``num_stages``: the suffix launch's tiles (the
    paged kernel's); ``prefix_tuning`` overrides ``PREFIX_TUNING`` (and ``block_m``, else
    ``PREFIX_ROWS`` rows) for the prefix launches, one per split of ``groups``. Returns
    ``[total_new, H, D]``."""
    total, n_heads, head_dim = q.shape
    splits = groups.splits  # partial slots 0 .. splits - 1: the prefix's; then the suffix's
    part_out = torch.empty(total, n_heads, splits + 1, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(total, n_heads, splits + 1, dtype=torch.float32, device=q.device)
    if groups.grouped_rows < total:  # rows of no group have no prefix partial
        part_lse[:, :, :splits].fill_(float("-inf"))
    pre = PREFIX_TUNING | (prefix_tuning or {})
    pre_m = pre.pop("block_m", None) or max(1, PREFIX_ROWS // gqa_pad(n_heads, k_cache.shape[2]))
    for s in range(splits if groups.max_rows else 0):
        prefill_launch(q, k_cache, v_cache, groups.tables, groups.seq_lens, groups.starts,
                       scale, groups.max_rows, None, None, pre_m, pre["block_n"],
                       pre["num_warps"], pre["num_stages"], kv_range=groups.prefix_ranges[s],
                       q_rows=groups.rows, partial=(part_out[:, :, s], part_lse[:, :, s]))
    prefill_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len,
                   None, None, block_m, block_n, num_warps, num_stages,
                   kv_range=groups.suffix_range,
                   partial=(part_out[:, :, splits], part_lse[:, :, splits]))
    return merge_partials(part_out, part_lse, torch.empty_like(q), splits + 1)
