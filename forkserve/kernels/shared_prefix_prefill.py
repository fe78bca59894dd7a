"""Cascade prefill: prefill chunks whose page tables share a prefix read it once per group.

32 agents each prefilling a short observation over one shared 8K context re-read the whole
context per chunk in the paged kernel (prefill_attention.py): every query tile of every
member loads every prefix key. Here the members' query rows are stacked into one query block
per group and attend the shared prefix in one launch; every one of them lies after the
prefix, so no causal mask applies there. Each member then attends its own suffix (its keys
from the prefix's end: a context tail past the last shared page, then its new tokens,
causal), and the two partial softmax states merge by log-sum-exp
(``split_kv.merge_partials``), so the output equals plain prefill up to float rounding.

Both passes are ``prefill_attention``'s kernel with its cascade options: the prefix pass
reads the group's table (its first member's) over keys ``[0, prefix)`` with the stacked
rows placed after the prefix (``q_rows``: no copy of q), the suffix pass each member's own
table over ``[prefix, seq_len)``. The grouping is host data planned once per step
(``prefix_groups.py``); nothing here reads the device back. Unified K/V only (unified,
full_reuse, no-LoRA, adaptive merged pages): the split form falls back to its plain route.
"""
from __future__ import annotations

import torch

from forkserve.kernels.prefill_attention import prefill_launch
from forkserve.kernels.prefix_groups import PrefillGroups
from forkserve.kernels.split_kv import merge_partials

# The prefix launch has no causal mask and many rows per group: 128-row query tiles (tokens
# x padded GQA group) held by 8 warps, as the decode cascade's prefix tiles. A first
# estimate, to be measured on the H200 (kernel_bench --cascade-prefill).
PREFIX_ROWS = 128
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
    ``PREFIX_ROWS`` rows) for the prefix launch. Returns ``[total_new, H, D]``."""
    total, n_heads, head_dim = q.shape
    part_out = torch.empty(total, n_heads, 2, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(total, n_heads, 2, dtype=torch.float32, device=q.device)
    if groups.grouped_rows < total:  # rows of no group have no prefix partial
        part_lse[:, :, 0].fill_(float("-inf"))
    pre = PREFIX_TUNING | (prefix_tuning or {})
    group_pad = 1 << (n_heads // k_cache.shape[2] - 1).bit_length()
    pre_m = pre.pop("block_m", None) or max(1, PREFIX_ROWS // group_pad)
    if groups.max_rows:
        prefill_launch(q, k_cache, v_cache, groups.tables, groups.seq_lens, groups.starts,
                       scale, groups.max_rows, None, None, pre_m, pre["block_n"],
                       pre["num_warps"], pre["num_stages"], kv_range=groups.prefix_range,
                       q_rows=groups.rows, partial=(part_out[:, :, 0], part_lse[:, :, 0]))
    prefill_launch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_q_len,
                   None, None, block_m, block_n, num_warps, num_stages,
                   kv_range=groups.suffix_range, partial=(part_out[:, :, 1], part_lse[:, :, 1]))
    return merge_partials(part_out, part_lse, torch.empty_like(q), 2)
