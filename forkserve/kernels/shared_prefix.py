"""Shared-prefix (cascade) decode: sequences whose block tables start with the same pages.

Plain decode reads the shared pages once per sequence. Here a prefix is attended once per
tile of sequences: a program's query tile stacks the GQA groups of up to
``cascade_tile_agents(group)`` sequences, so each prefix key tile is loaded once and multiplied
against all of them (a 128-row matrix product instead of many 16-row ones). Each
sequence's own suffix is attended by the ordinary decode partial kernel from its own start,
and both partial softmax states are merged by log-sum-exp, so the output equals plain
decode up to float rounding.

The general form (``cascade_decode_triton``) takes the tiles as tensors: ``tile_seqs``
lists each tile's sequences (-1 pads), ``tile_lens`` its prefix length in keys (any length,
page-aligned or not), ``kv_starts`` each sequence's first suffix key (its tile's prefix
length, 0 for a sequence in no tile). Every program splits its own key range, so one
launch shape serves any grouping of a batch: it can be captured in a CUDA graph.
``cascade_residual_decode_triton`` is the split form (disaggregated cache): the tile shares
the base pages, each row adds its own adapter's residual (two-pass decode's score pass, a
value pass for ``V_res B_v``). Its ``variant="msc"`` materializes every row's whole logits
first (residual_msc.py's pass 1, per row), so the tiled prefix launch reads the shared
``V_base`` and no K at all; ``variant="tiled_scores"`` scores the prefix keys per tile
(residual_score_tiled.py); budgets in docs/KERNELS.md.
"""
from __future__ import annotations

import math

import torch

from forkserve.kernels import cascade_tile_agents
from forkserve.kernels.decode_attention import decode_partials
from forkserve.kernels.residual_decode_triton import (
    residual_scores,
    residual_values,
    score_tuning_for,
)
from forkserve.kernels.residual_msc import MSC_TUNING, residual_logits
from forkserve.kernels.residual_score_tiled import tiled_scores
from forkserve.kernels.rope import cached_rope_table
from forkserve.kernels.split_kv import (
    NO_LIMIT,
    empty_partials,
    key_bound,
    merge_partials,
    plan_splits,
)

# The prefix launch multiplies 128-row query tiles: 8 warps hold the 128 x D accumulator
# (4 would hold 128 fp32 values per thread for it alone); 32-key blocks measured best on the
# H200 (kernel_bench --cascade-sweep: 0.056 ms vs 0.066 at 64 keys, 8K prefix, 32 agents).
PREFIX_TUNING = {"num_splits": None, "block_n": 32, "num_warps": 8, "num_stages": 2}
# How the split form gets each row's scores (``cascade_residual_decode_triton(variant=...)``).
CASCADE_RESIDUAL_VARIANTS = ("two_pass", "msc", "tiled_scores")


def cascade_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          tile_seqs: torch.Tensor, tile_lens: torch.Tensor, kv_starts: torch.Tensor,
                          scale: float | None = None, max_seq_len: int | None = None,
                          **tuning) -> torch.Tensor:
    """Decode ``q [batch, H, D]`` over a unified cache with the prefixes of ``tile_seqs
    [n_tiles, agents]`` read once per tile. ``max_seq_len``: a host bound on every length
    (plans the split counts; a CUDA graph passes its table width). ``tuning``: ``num_splits``,
    ``block_n``, ``num_warps``, ``num_stages`` of the suffix launch; ``prefix_tuning``
    overrides ``PREFIX_TUNING`` for the prefix launch. Returns ``[batch, H, D]``."""
    return _cascade(q, k_cache, v_cache, block_tables, seq_lens, tile_seqs, tile_lens, kv_starts,
                    scale, max_seq_len, None, **tuning)


def cascade_residual_decode_triton(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                                   k_res: torch.Tensor, v_res: torch.Tensor,
                                   block_tables: torch.Tensor, res_block_tables: torch.Tensor,
                                   seq_lens: torch.Tensor, b_k_all: torch.Tensor,
                                   b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                                   inv_freq: torch.Tensor, tile_seqs: torch.Tensor,
                                   tile_lens: torch.Tensor, kv_starts: torch.Tensor,
                                   scale: float | None = None, max_seq_len: int | None = None,
                                   variant: str = "two_pass", score_tuning: dict | None = None,
                                   **tuning) -> torch.Tensor:
    """The split form (disaggregated cache, ResidualAttention): a tile's rows share the base
    pages of the prefix but each has its own adapter's residual.

    ``"two_pass"``: two-pass decode's score pass writes every row's residual score (float32
    here: the prefix launch writes the full score back into it); the tiled prefix launch adds
    it to the shared ``Q K_base^T`` and reads ``K_base, V_base`` once per tile.
    ``"msc"``: msc's pass 1 writes every row's whole logits over its whole length (it reads
    the shared ``K_base`` once per row); the tiled prefix launch reads them and ``V_base``
    once per tile, no K. Then, either way, the value pass adds each row's ``(p V_res) B_v``
    to its prefix partials and the suffixes run per row from ``kv_starts`` (two-pass: scores
    plus ``q.K_base``; msc: the logits). ``"tiled_scores"``: two-pass, but the prefix keys'
    scores come per tile, the tile's cos|sin rows loaded once for several agents
    (residual_score_tiled.py), the suffixes' per row. ``score_tuning``: pass 1's (default
    ``score_tuning_for(batch)``, msc ``MSC_TUNING``, tiled_scores ``tiled_scores``'
    defaults)."""
    if variant not in CASCADE_RESIDUAL_VARIANTS:
        raise ValueError(f"cascade residual variant must be one of {CASCADE_RESIDUAL_VARIANTS}, "
                         f"got {variant!r}")
    residual = (k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, inv_freq)
    return _cascade(q, k_base, v_base, block_tables, seq_lens, tile_seqs, tile_lens, kv_starts,
                    scale, max_seq_len, residual, variant=variant, score_tuning=score_tuning,
                    **tuning)


def _cascade(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, tile_seqs: torch.Tensor, tile_lens: torch.Tensor,
             kv_starts: torch.Tensor, scale: float | None, max_seq_len: int | None,
             residual: tuple | None, num_splits: int | None = None, block_n: int = 64,
             num_warps: int = 4, num_stages: int = 2, prefix_tuning: dict | None = None,
             variant: str = "two_pass", score_tuning: dict | None = None) -> torch.Tensor:
    batch, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    max_seq_len = key_bound(seq_lens, max_seq_len)
    bias = logits = None
    if residual is not None:  # inv_freq -> its cos/sin table; every row's scores
        residual = (*residual[:-1], cached_rope_table(residual[-1], max_seq_len))
        k_res, v_res, res_bt, b_k_all, b_v_all, adapter_idx, table = residual
        if variant == "msc":
            logits = residual_logits(q, k, block_tables, k_res, res_bt, seq_lens, b_k_all,
                                     adapter_idx, table, scale, max_seq_len,
                                     **(MSC_TUNING if score_tuning is None else score_tuning))
        elif variant == "tiled_scores":
            bias = torch.empty(batch, n_heads, max(max_seq_len, 1), dtype=torch.float32,
                               device=q.device)
            tiled_scores(q, k_res, res_bt, seq_lens, b_k_all, adapter_idx, table, n_kv, bias,
                         tile_seqs, tile_lens, kv_starts, **(score_tuning or {}))
        else:
            bias = residual_scores(q, k_res, res_bt, seq_lens, b_k_all, adapter_idx, table, n_kv,
                                   max_seq_len, dtype=torch.float32,
                                   **(score_tuning_for(batch) if score_tuning is None
                                      else score_tuning))
    pre = PREFIX_TUNING | (prefix_tuning or {})
    pre_splits, _ = plan_splits(tile_seqs.shape[0] * n_kv, max_seq_len, q.device, pre["block_n"],
                                pre["num_splits"] or num_splits)
    suf_splits, _ = plan_splits(batch * n_kv, max_seq_len, q.device, block_n, num_splits)
    splits = pre_splits + suf_splits
    part_out, part_lse = empty_partials(q, splits)
    part_lse[:, :, :pre_splits].fill_(float("-inf"))  # rows of no tile have no prefix partial
    common = dict(scale=scale, split_len=0, kv_start=0, kv_limit=NO_LIMIT, residual=residual,
                  res_bias=bias, res_logits=logits)
    decode_partials(q, k, v, block_tables, seq_lens, part_out, part_lse, num_splits=pre_splits,
                    split_offset=0, tiles=(tile_seqs, tile_lens), block_n=pre["block_n"],
                    num_warps=pre["num_warps"], num_stages=pre["num_stages"], **common)
    if residual is not None:
        residual_values(bias if logits is None else logits, v_res, b_v_all, res_bt, adapter_idx,
                        kv_starts, part_out, part_lse, n_kv, pre_splits, pre["block_n"])
    decode_partials(q, k, v, block_tables, seq_lens, part_out, part_lse, num_splits=suf_splits,
                    split_offset=pre_splits, kv_starts=kv_starts, block_n=block_n,
                    num_warps=num_warps, num_stages=num_stages, **common)
    return merge_partials(part_out, part_lse, torch.empty_like(q), splits)


def shared_prefix_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                prefix_pages: int, scale: float | None = None,
                                max_seq_len: int | None = None,
                                agents_per_program: int | None = None, **tuning) -> torch.Tensor:
    """The whole batch shares its first ``prefix_pages`` pages: consecutive tiles of
    ``agents_per_program`` sequences (default ``cascade_tile_agents``). ``tuning`` as in
    ``cascade_decode_triton``."""
    batch, n_heads, _ = q.shape
    agents = agents_per_program or cascade_tile_agents(n_heads // k_cache.shape[2])
    agents = min(agents, batch)
    n_tiles = -(-batch // agents)
    seqs = torch.arange(n_tiles * agents, dtype=torch.int32, device=q.device)
    tile_seqs = torch.where(seqs < batch, seqs, -1).view(n_tiles, agents)
    prefix = prefix_pages * k_cache.shape[1]
    tile_lens = torch.full((n_tiles,), prefix, dtype=torch.int32, device=q.device)
    kv_starts = torch.full((batch,), prefix, dtype=torch.int32, device=q.device)
    return cascade_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, tile_seqs, tile_lens,
                                 kv_starts, scale, max_seq_len, **tuning)
