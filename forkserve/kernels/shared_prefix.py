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
(residual_score_tiled.py). Its score buffer is float32, or float16 (``score_dtype``): the
prefix launch's write-back then stores each score relative to its key block's max, kept in
float32 beside it, so the value pass's weights near the max stay exact to ~5e-4.

Each call is a ``CascadeLaunches``: its launches in order, named (``pass1`` and ``values``
in the split form only; ``prefix``, ``suffix``, ``merge``), over buffers allocated once
(``cascade_launches``, ``cascade_residual_launches``), so a benchmark can time each alone;
the decode functions build and run them. Budgets in docs/KERNELS.md ("The split cascade,
launch by launch").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forkserve.kernels import cascade_tile_agents
from forkserve.kernels.decode_attention import decode_partials
from forkserve.kernels.residual_decode_triton import (
    DEFAULT_VALUE_GRID,
    block_maxima,
    residual_scores,
    residual_values,
    score_buffer,
    score_dtype_for,
    score_tuning_for,
    value_launch_grid,
)
from forkserve.kernels.residual_msc import MSC_TUNING, empty_logits, residual_logits
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


Launch = tuple[str, Callable[[], object]]


@dataclass(frozen=True)
class CascadeLaunches:
    """One cascade decode call as its launches, in order (``"pass1"``, split form only;
    ``"prefix"``; ``"values"``, split form only; ``"suffix"``; ``"merge"``), over buffers
    allocated once: ``run()`` is the whole call (and can be run again, as a CUDA graph
    replays it); a launch run alone redoes its step over what the earlier ones left
    (``kernel_bench.py --cascade-split`` times them one by one). ``grids``: the programs of
    the launches planned here (prefix, values, suffix, merge)."""

    launches: tuple[Launch, ...]
    grids: dict[str, tuple[int, ...]]
    out: torch.Tensor

    def run(self) -> torch.Tensor:
        for _, launch in self.launches:
            launch()
        return self.out


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
    return cascade_launches(q, k_cache, v_cache, block_tables, seq_lens, tile_seqs, tile_lens,
                            kv_starts, scale, max_seq_len, **tuning).run()


def cascade_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, tile_seqs: torch.Tensor,
                     tile_lens: torch.Tensor, kv_starts: torch.Tensor, scale: float | None = None,
                     max_seq_len: int | None = None, **tuning) -> CascadeLaunches:
    """``cascade_decode_triton``'s call as its launches (nothing launched yet)."""
    return _launches(q, k_cache, v_cache, block_tables, seq_lens, tile_seqs, tile_lens,
                     kv_starts, scale, max_seq_len, None, **tuning)


def cascade_residual_decode_triton(*args, **kwargs) -> torch.Tensor:
    """Split-form cascade decode: ``cascade_residual_launches``' arguments, its launches run
    in order. Returns ``[batch, H, D]``."""
    return cascade_residual_launches(*args, **kwargs).run()


def cascade_residual_launches(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                              k_res: torch.Tensor, v_res: torch.Tensor,
                              block_tables: torch.Tensor, res_block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, b_k_all: torch.Tensor,
                              b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                              inv_freq: torch.Tensor, tile_seqs: torch.Tensor,
                              tile_lens: torch.Tensor, kv_starts: torch.Tensor,
                              scale: float | None = None, max_seq_len: int | None = None,
                              variant: str = "two_pass", score_tuning: dict | None = None,
                              score_dtype: torch.dtype | None = None,
                              value_grid: str = DEFAULT_VALUE_GRID,
                              prefetch: bool | None = None, **tuning) -> CascadeLaunches:
    """The split form (disaggregated cache, ResidualAttention) as its launches, nothing
    launched yet (``cascade_residual_decode_triton`` runs them): a tile's rows share the base
    pages of the prefix but each has its own adapter's residual.

    ``"two_pass"``: two-pass decode's score pass writes every row's residual score; the
    tiled prefix launch adds it to the shared ``Q K_base^T``, reads ``K_base, V_base`` once
    per tile and writes each row's full score back into the buffer for the value pass.
    ``"msc"``: msc's pass 1 writes every row's whole logits over its whole length (it reads
    the shared ``K_base`` once per row); the tiled prefix launch reads them and ``V_base``
    once per tile, no K. Then, either way, the value pass adds each row's ``(p V_res) B_v``
    to its prefix partials and the suffixes run per row from ``kv_starts`` (two-pass: scores
    plus ``q.K_base``; msc: the logits). ``"tiled_scores"``: two-pass, but the prefix keys'
    scores come per tile, the tile's cos|sin rows loaded once for several agents
    (residual_score_tiled.py), the suffixes' per row. ``score_tuning``: pass 1's (default
    ``score_tuning_for(batch)``, msc ``MSC_TUNING``, tiled_scores ``tiled_scores``'
    defaults). ``score_dtype`` (two_pass, tiled_scores): the score buffer's, float32 or
    float16 (half its bytes; the write-back then stores each score relative to its key
    block's max, kept in float32 beside it; msc's logits take ``score_tuning``'s ``dtype``).
    Default: ``score_dtype_for(q)``, float16 for half-precision queries (H200, 8K x 32: the
    whole call 0.376 -> 0.327 ms, error 1.6e-3, below bf16's rounding of the output);
    float32 for msc. ``value_grid``: the value pass's (``residual_values(grid=...)``),
    ``DEFAULT_VALUE_GRID`` ("row": V_res read once per row, 0.182 -> 0.053 ms there) or
    ``"kv_head"``. ``prefetch`` (two_pass, tiled_scores): the prefix and suffix launches load
    each key tile's scores (and the suffix its residual table entries) one tile ahead, as
    two-pass decode does; default on for them (H200, round 14: the prefix launch 3-5% and
    the whole call 0.8-1.7% faster at 8K / 32K x 32), off for msc."""
    if score_dtype is None:
        score_dtype = torch.float32 if variant == "msc" else score_dtype_for(q)
    if variant not in CASCADE_RESIDUAL_VARIANTS:
        raise ValueError(f"cascade residual variant must be one of {CASCADE_RESIDUAL_VARIANTS}, "
                         f"got {variant!r}")
    if score_dtype not in (torch.float32, torch.float16) or (
            variant == "msc" and score_dtype != torch.float32):
        raise ValueError(f"score_dtype must be torch.float32 or torch.float16 (two_pass, "
                         f"tiled_scores; msc: score_tuning's dtype), got {score_dtype} "
                         f"for {variant!r}")
    if prefetch is None:
        prefetch = variant != "msc"
    if prefetch and variant == "msc":
        raise ValueError("prefetch reads score-pass biases; msc has whole logits")
    residual = (k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, inv_freq)
    return _launches(q, k_base, v_base, block_tables, seq_lens, tile_seqs, tile_lens, kv_starts,
                     scale, max_seq_len, residual, variant=variant, score_tuning=score_tuning,
                     score_dtype=score_dtype, value_grid=value_grid, prefetch=prefetch, **tuning)


@dataclass(frozen=True)
class _Scores:
    """The split form's pass 1 and the buffers it fills: per-row residual scores (``bias``,
    with ``block_max`` where they are float16) or msc's whole logits."""

    launch: Callable[[], object]
    bias: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    block_max: torch.Tensor | None = None


def _score_pass(q: torch.Tensor, k: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, residual: tuple, tile_seqs: torch.Tensor,
                tile_lens: torch.Tensor, kv_starts: torch.Tensor, scale: float, max_seq_len: int,
                variant: str, score_tuning: dict | None, score_dtype: torch.dtype,
                prefix_block_n: int) -> _Scores:
    k_res, _, res_bt, b_k_all, _, adapter_idx, table = residual
    batch = q.shape[0]
    n_kv = k.shape[2]
    if variant == "msc":
        tuning = MSC_TUNING if score_tuning is None else score_tuning
        logits = empty_logits(q, max_seq_len, tuning.get("dtype", torch.float32))
        return _Scores(lambda: residual_logits(q, k, block_tables, k_res, res_bt, seq_lens,
                                               b_k_all, adapter_idx, table, scale, max_seq_len,
                                               out=logits, **tuning), logits=logits)
    bias = score_buffer(q, max_seq_len, score_dtype)
    block_max = block_maxima(bias, prefix_block_n)
    if variant == "tiled_scores":
        launch = lambda: tiled_scores(q, k_res, res_bt, seq_lens, b_k_all, adapter_idx,  # noqa: E731
                                      table, n_kv, bias, tile_seqs, tile_lens, kv_starts,
                                      **(score_tuning or {}))
    else:
        tuning = score_tuning_for(batch) if score_tuning is None else score_tuning
        launch = lambda: residual_scores(q, k_res, res_bt, seq_lens, b_k_all, adapter_idx,  # noqa: E731
                                         table, n_kv, max_seq_len, out=bias, **tuning)
    return _Scores(launch, bias=bias, block_max=block_max)


def _launches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, tile_seqs: torch.Tensor, tile_lens: torch.Tensor,
              kv_starts: torch.Tensor, scale: float | None, max_seq_len: int | None,
              residual: tuple | None, num_splits: int | None = None, block_n: int = 64,
              num_warps: int = 4, num_stages: int = 2, prefix_tuning: dict | None = None,
              variant: str = "two_pass", score_tuning: dict | None = None,
              score_dtype: torch.dtype = torch.float32,
              value_grid: str = DEFAULT_VALUE_GRID, prefetch: bool = False) -> CascadeLaunches:
    batch, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    max_seq_len = key_bound(seq_lens, max_seq_len)
    pre = PREFIX_TUNING | (prefix_tuning or {})
    n_tiles = tile_seqs.shape[0]
    pre_splits, _ = plan_splits(n_tiles * n_kv, max_seq_len, q.device, pre["block_n"],
                                pre["num_splits"] or num_splits)
    suf_splits, _ = plan_splits(batch * n_kv, max_seq_len, q.device, block_n, num_splits)
    splits = pre_splits + suf_splits
    part_out, part_lse = empty_partials(q, splits)
    out = torch.empty_like(q)
    launches: list[Launch] = []
    bias = logits = block_max = None
    if residual is not None:  # inv_freq -> its cos/sin table; every row's scores
        residual = (*residual[:-1], cached_rope_table(residual[-1], max_seq_len))
        scores = _score_pass(q, k, block_tables, seq_lens, residual, tile_seqs, tile_lens,
                             kv_starts, scale, max_seq_len, variant, score_tuning, score_dtype,
                             pre["block_n"])
        launches.append(("pass1", scores.launch))
        bias, logits, block_max = scores.bias, scores.logits, scores.block_max
    common = dict(scale=scale, split_len=0, kv_start=0, kv_limit=NO_LIMIT, residual=residual,
                  res_bias=bias, res_logits=logits, prefetch=prefetch)

    def prefix() -> None:
        part_lse[:, :, :pre_splits].fill_(float("-inf"))  # rows of no tile have no prefix partial
        decode_partials(q, k, v, block_tables, seq_lens, part_out, part_lse,
                        num_splits=pre_splits, split_offset=0, tiles=(tile_seqs, tile_lens),
                        block_n=pre["block_n"], num_warps=pre["num_warps"],
                        num_stages=pre["num_stages"], block_max=block_max, **common)

    launches.append(("prefix", prefix))
    grids = {"prefix": (n_tiles, n_kv, pre_splits)}
    if residual is not None:
        _, v_res, res_bt, _, b_v_all, adapter_idx, _ = residual
        launches.append(("values", lambda: residual_values(
            bias if logits is None else logits, v_res, b_v_all, res_bt, adapter_idx, kv_starts,
            part_out, part_lse, n_kv, pre_splits, pre["block_n"], block_max=block_max,
            grid=value_grid)))
        grids["values"] = value_launch_grid(value_grid, batch, n_kv, pre_splits)
    launches.append(("suffix", lambda: decode_partials(
        q, k, v, block_tables, seq_lens, part_out, part_lse, num_splits=suf_splits,
        split_offset=pre_splits, kv_starts=kv_starts, block_n=block_n, num_warps=num_warps,
        num_stages=num_stages, **common)))
    launches.append(("merge", lambda: merge_partials(part_out, part_lse, out, splits)))
    grids |= {"suffix": (batch, n_kv, suf_splits), "merge": (batch, n_heads)}
    return CascadeLaunches(tuple(launches), grids, out)


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
