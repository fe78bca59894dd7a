"""Shared-prefix decode: a batch of agents whose block tables start with the same pages.

Plain decode reads the shared pages once per agent. Here the prefix is attended once per
group of agents: a program's query tile stacks the GQA groups of up to ``agents_per_program``
agents, so each prefix key tile is loaded once and multiplied against all of them (a small
matrix product instead of many vector ones). Each agent's own suffix is attended by the
ordinary decode partial kernel, and both partial softmax states are merged by log-sum-exp,
so the output equals plain decode up to float rounding.

Contract: every sequence of the batch lists the same first ``prefix_pages`` page ids and
has ``seq_len >= prefix_pages * P``. Unified layout only: in the disaggregated layout each
agent rebuilds a different K from the shared base, which this kernel does not do.
"""
from __future__ import annotations

import math

import torch
import triton

from forkserve.kernels.decode_attention import NO_LIMIT, decode_partials, merge_partials, plan_splits


def shared_prefix_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                prefix_pages: int, scale: float | None = None,
                                max_seq_len: int | None = None,
                                agents_per_program: int | None = None,
                                num_splits: int | None = None, block_n: int = 64,
                                num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Decode ``q [batch, H, D]`` over a unified cache whose first ``prefix_pages`` pages
    are shared by the whole batch. Returns ``[batch, H, D]``."""
    batch, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[2]
    group = n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # one host sync; callers that know it pass it
    prefix_len = prefix_pages * k_cache.shape[1]
    if agents_per_program is None:  # a 128-row query tile: one tensor-core sized product
        agents_per_program = max(1, 128 // triton.next_power_of_2(group))
    agents_per_program = min(agents_per_program, batch)
    n_groups = -(-batch // agents_per_program)
    pre_splits, pre_len = plan_splits(n_groups * n_kv, prefix_len, q.device, block_n, num_splits)
    suf_splits, suf_len = plan_splits(batch * n_kv, max_seq_len - prefix_len, q.device, block_n,
                                      num_splits)
    splits = pre_splits + suf_splits
    part_out = torch.empty(batch, n_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, n_heads, splits, dtype=torch.float32, device=q.device)
    common = dict(scale=scale, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    if prefix_len > 0:
        decode_partials(q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
                        kv_start=0, kv_limit=prefix_len, num_splits=pre_splits, split_len=pre_len,
                        split_offset=0, seqs_per_program=agents_per_program, **common)
    else:
        part_lse[:, :, :pre_splits].fill_(float("-inf"))
        part_out[:, :, :pre_splits].zero_()
    decode_partials(q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
                    kv_start=prefix_len, kv_limit=NO_LIMIT, num_splits=suf_splits,
                    split_len=suf_len, split_offset=pre_splits, **common)
    out = torch.empty_like(q)
    merge_partials(part_out, part_lse, out, splits)
    return out
