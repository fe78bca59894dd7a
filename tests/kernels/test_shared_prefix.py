"""Shared-prefix (cascade) decode equals plain decode."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, REL_TOL, make_adapters, make_cache, rel_err

from forkserve.kernels import (
    cascade_decode,
    cascade_residual_decode,
    default_inv_freq,
    paged_decode,
    shared_prefix_decode,
)


@pytest.mark.parametrize("agents_per_program", [2, None])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 2), (6, 2)])
def test_shared_prefix_equals_decode(agents_per_program: int | None, n_heads: int,
                                     n_kv: int) -> None:
    gen = torch.Generator().manual_seed(n_heads)
    prefix_pages, page = 5, 16
    # Five agents (not a multiple of the agent tile): suffixes of 0, 1, mid-page, several pages.
    suffix = [0, 1, 9, 40, 23]
    seq_lens = [prefix_pages * page + s for s in suffix]
    c = make_cache(gen, seq_lens, n_kv, 32, rank=8, shared_prefix_pages=prefix_pages)
    q = torch.randn(len(seq_lens), n_heads, 32, generator=gen).to(DEVICE, DTYPE)
    out = shared_prefix_decode(q, c.k, c.v, c.block_tables, c.seq_lens, prefix_pages,
                               use_triton=True, agents_per_program=agents_per_program,
                               num_splits=2, block_n=16)
    assert rel_err(out, plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens)) < REL_TOL
    unshared = paged_decode(q, c.k, c.v, c.block_tables, c.seq_lens, use_triton=True)
    assert rel_err(out, unshared) < REL_TOL


@pytest.mark.parametrize("num_splits", [None, 3])
def test_cascade_tiles_equal_plain_attention(num_splits: int | None) -> None:
    """One batch, several groups: a group split over two tiles (prefix ending mid-page), a
    page-aligned group, a group of one and items in no group, an unused padded tile."""
    gen = torch.Generator().manual_seed(7)
    n_heads, n_kv, dim = 4, 2, 32
    seq_lens = [70, 75, 41, 90, 66, 33, 80]
    c = make_cache(gen, seq_lens, n_kv, dim, rank=8)
    tables = c.block_tables.clone()
    # Group A (rows 0, 1, 3, 4) shares 4 full pages but attends only 53 keys of them as
    # prefix; group B (rows 2, 6) shares 2 pages, attended whole; row 5 reads alone.
    tables[[1, 3, 4], :4] = tables[0, :4]
    tables[6, :2] = tables[2, :2]
    tile_seqs = torch.tensor([[0, 3], [1, 4], [2, 6], [-1, -1]], dtype=torch.int32, device=DEVICE)
    tile_lens = torch.tensor([53, 53, 32, 0], dtype=torch.int32, device=DEVICE)
    kv_starts = torch.tensor([53, 53, 32, 53, 53, 0, 32], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), n_heads, dim, generator=gen).to(DEVICE, DTYPE)
    out = cascade_decode(q, c.k, c.v, tables, c.seq_lens, tile_seqs, tile_lens, kv_starts,
                         use_triton=True, num_splits=num_splits, block_n=16)
    assert rel_err(out, plain.decode(q, c.k, c.v, tables, c.seq_lens)) < REL_TOL


def test_split_form_tiles_share_base_pages_across_adapters() -> None:
    """ResidualAttention with cascade tiles: one group's rows share base pages but each has
    its own residual pages and adapter (two adapters, and -1); a prefix ending mid-page; a
    row in no tile. Equals the plain formula K = K_base + RoPE(K_res B_k),
    V = V_base + V_res B_v."""
    gen = torch.Generator().manual_seed(11)
    n_heads, n_kv, dim, rank = 4, 2, 32, 8
    seq_lens = [70, 75, 66, 90, 41]
    c = make_cache(gen, seq_lens, n_kv, dim, rank)
    tables = c.block_tables.clone()
    # rows 0-3 share 4 full base pages; residual pages stay their own
    tables[1:4, :4] = tables[0, :4]
    b_k, b_v = make_adapters(gen, 2, rank, n_kv, dim)
    adapters = torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32, device=DEVICE)
    tile_seqs = torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int32, device=DEVICE)
    tile_lens = torch.tensor([53, 53, 0], dtype=torch.int32, device=DEVICE)
    kv_starts = torch.tensor([53, 53, 53, 53, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), n_heads, dim, generator=gen).to(DEVICE, DTYPE)
    args = (q, c.k, c.v, c.k_res, c.v_res, tables, c.res_block_tables, c.seq_lens, b_k, b_v,
            adapters, default_inv_freq(dim, device=DEVICE))
    out = cascade_residual_decode(*args, tile_seqs, tile_lens, kv_starts, use_triton=True,
                                  num_splits=2, block_n=16, prefix_tuning={"block_n": 16})
    ref = plain.decode(q, c.k, c.v, tables, c.seq_lens,
                       residual=(c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters,
                                 args[-1]))
    assert rel_err(out, ref) < REL_TOL
    # The residual matters on this input (a kernel that dropped it, or mixed up whose it is, fails).
    base_only = plain.decode(q, c.k, c.v, tables, c.seq_lens)
    assert rel_err(base_only[adapters >= 0], ref[adapters >= 0]) > 20 * REL_TOL


def _split_groups() -> tuple:
    """The split form over several groups in one batch: a group over two tiles whose prefix
    ends mid-page, with two adapters and -1 in one tile; a group of one; a group of two
    sharing 1.25 pages; a row in no tile; an unused padded tile; suffixes of 13 to 37 keys.
    ``cascade_residual_decode``'s positional arguments."""
    gen = torch.Generator().manual_seed(15)
    n_heads, n_kv, dim, rank = 4, 2, 32, 8
    seq_lens = [70, 75, 66, 90, 41, 58, 36, 50]
    c = make_cache(gen, seq_lens, n_kv, dim, rank)
    tables = c.block_tables.clone()
    tables[1:4, :4] = tables[0, :4]
    tables[6, :2] = tables[4, :2]
    b_k, b_v = make_adapters(gen, 2, rank, n_kv, dim)
    adapters = torch.tensor([0, 1, -1, 1, 1, 0, -1, 0], dtype=torch.int32, device=DEVICE)
    tile_seqs = torch.tensor([[0, 1], [2, 3], [5, -1], [4, 6], [-1, -1]], dtype=torch.int32,
                             device=DEVICE)
    tile_lens = torch.tensor([53, 53, 32, 20, 0], dtype=torch.int32, device=DEVICE)
    kv_starts = torch.tensor([53, 53, 53, 53, 20, 32, 20, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), n_heads, dim, generator=gen).to(DEVICE, DTYPE)
    return (q, c.k, c.v, c.k_res, c.v_res, tables, c.res_block_tables, c.seq_lens, b_k, b_v,
            adapters, default_inv_freq(dim, device=DEVICE), tile_seqs, tile_lens, kv_starts)


TUNING = dict(use_triton=True, num_splits=2, block_n=16, prefix_tuning={"block_n": 16})


def test_msc_cascade_equals_eager_and_two_pass() -> None:
    """The materialized-scores split form (``_split_groups``), pass 1 in several chunks per
    row, suffixes starting mid-tile. Equals the ungrouped eager path and the two-pass
    cascade."""
    args = _split_groups()
    msc = cascade_residual_decode(*args, variant="msc", score_tuning={"block_n": 16, "chunk": 32},
                                  **TUNING)
    assert rel_err(msc, cascade_residual_decode(*args, use_triton=False)) < REL_TOL
    assert rel_err(msc, cascade_residual_decode(*args, **TUNING)) < REL_TOL


@pytest.mark.parametrize("agents,kv_heads,angle_add,wide,table16", [
    (2, 1, False, False, False), (1, 2, True, False, False), (1, 1, False, True, False),
    (2, 1, False, False, True)])
def test_tiled_scores_write_the_per_row_scores(agents: int, kv_heads: int, angle_add: bool,
                                               wide: bool, table16: bool) -> None:
    """The tiled score pass (``_split_groups``): agents of two adapters stacked in one program
    (2 x 1), or one agent per program over both KV heads (1 x 2: up to two agent blocks per
    tile); ``wide``: tiles of four places, the first group's rows 0, 1, 3 in one (three
    blocks share eight programs, two left over) and row 2 alone. Prefixes in two chunks per
    block of a full tile, suffixes (table rows / angle addition) in several. Every score a
    later pass reads (rows with an adapter, keys below their length) equals the per-row
    pass's, and is written (the buffer starts NaN). ``table16``: both passes from the table's
    copy in the queries' dtype (the same table off CUDA, whose tests run float32)."""
    from forkserve.kernels.residual_decode_triton import residual_scores
    from forkserve.kernels.residual_score_tiled import tiled_scores
    from forkserve.kernels.rope import cached_rope_table
    q, _, _, k_res, _, _, rbt, lens, b_k, _, ad, inv_freq, tile_seqs, tile_lens, kv_starts = (
        _split_groups())
    if wide:
        tile_seqs = torch.tensor([[0, 1, 3, -1], [2, -1, -1, -1], [5, -1, -1, -1],
                                  [4, 6, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32,
                                 device=DEVICE)
    width, n_kv = int(lens.max()), 2
    table = cached_rope_table(inv_freq, width)
    ref = residual_scores(q, k_res, rbt, lens, b_k, ad, table, n_kv, width, dtype=torch.float32,
                          form="qfold", block_n=16)
    bias = torch.full_like(ref, float("nan"))
    tiled_scores(q, k_res, rbt, lens, b_k, ad, table, n_kv, bias, tile_seqs, tile_lens,
                 kv_starts, agents=agents, kv_heads=kv_heads, block_n=16, num_warps=4, chunks=2,
                 suffix=dict(block_n=16, chunk=32, angle_add=angle_add), table16=table16)
    read = ((ad >= 0)[:, None] & (torch.arange(width, device=DEVICE) < lens[:, None]))[:, None]
    read = read.expand_as(ref)
    # Elementwise in float32 (the interpreter); on CUDA the two passes round their bf16
    # folded operands at different points, so the scores agree to the suite's relative norm.
    assert not bias[read].isnan().any()
    assert rel_err(bias[read], ref[read]) < (REL_TOL if DTYPE != torch.float32 else 1e-5)


def test_tiled_scores_cascade_equals_eager() -> None:
    """The split-form cascade with ``variant="tiled_scores"`` (``_split_groups``) equals the
    ungrouped eager path."""
    args = _split_groups()
    out = cascade_residual_decode(*args, variant="tiled_scores", score_tuning=dict(
        block_n=16, num_warps=4, suffix=dict(block_n=16, chunk=32, angle_add=False)), **TUNING)
    assert rel_err(out, cascade_residual_decode(*args, use_triton=False)) < REL_TOL


# tiled_scores (not the engine's, measured slower) runs with `-m slow`: ~14 s of the CI's 10
# minutes for a form test_tiled_scores_cascade_equals_eager already checks whole.
TILED_SLOW = pytest.param("tiled_scores", marks=pytest.mark.slow)


@pytest.mark.parametrize("variant", [None, "two_pass", TILED_SLOW])
def test_launches_one_by_one_equal_the_whole_call(variant: str | None) -> None:
    """A call as its named launches (``_split_groups``: several tiles, a group of one, a
    prefix ending mid-page), each run alone in order, equals the whole call bit for bit and
    the eager path; run again over the same buffers (a graph's replay), the same again.
    ``None``: the unified form over the same base pages."""
    from forkserve.kernels.shared_prefix import (
        cascade_decode_triton,
        cascade_launches,
        cascade_residual_decode_triton,
        cascade_residual_launches,
    )
    args = _split_groups()
    tuning = {k: v for k, v in TUNING.items() if k != "use_triton"}
    if variant is None:
        q, k, v, tables, lens = args[0], args[1], args[2], args[5], args[7]
        unified = (q, k, v, tables, lens, *args[12:])
        calls = cascade_launches(*unified, **tuning)
        whole = cascade_decode_triton(*unified, **tuning)
        ref = plain.decode(q, k, v, tables, lens)
        names = ("prefix", "suffix", "merge")
    else:
        if variant == "tiled_scores":
            tuning["score_tuning"] = dict(block_n=16, num_warps=4,
                                          suffix=dict(block_n=16, chunk=32, angle_add=False))
        calls = cascade_residual_launches(*args, variant=variant, **tuning)
        whole = cascade_residual_decode_triton(*args, variant=variant, **tuning)
        ref = cascade_residual_decode(*args, use_triton=False)
        names = ("pass1", "prefix", "values", "suffix", "merge")
    assert tuple(name for name, _ in calls.launches) == names
    assert set(calls.grids) == set(names) - {"pass1"}
    for _, launch in calls.launches:
        launch()
    assert torch.equal(calls.out, whole)
    assert rel_err(whole, ref) < REL_TOL
    first = calls.out.clone()
    assert torch.equal(calls.run(), first)


@pytest.mark.parametrize("variant", ["two_pass", TILED_SLOW])
def test_float16_scores_equal_float32(variant: str) -> None:
    """``score_dtype=torch.float16`` (``_split_groups``; scores written back relative to
    their block's max) equals the float32 buffer to 3e-3; msc refuses it (its logits'
    dtype is its score tuning's)."""
    args = _split_groups()
    score_tuning = None if variant == "two_pass" else dict(
        block_n=16, num_warps=4, suffix=dict(block_n=16, chunk=32, angle_add=False))
    run = lambda dtype: cascade_residual_decode(  # noqa: E731
        *args, variant=variant, score_tuning=score_tuning, score_dtype=dtype, **TUNING)
    assert rel_err(run(torch.float16), run(torch.float32)) < 3e-3
    with pytest.raises(ValueError, match="score_dtype"):
        cascade_residual_decode(*args, variant="msc", score_dtype=torch.float16, **TUNING)


@pytest.mark.parametrize("score_dtype", [torch.float32, torch.float16])
def test_row_value_grid_equals_kv_head_grid(score_dtype: torch.dtype) -> None:
    """The value pass over all heads per program (``grid="row"``) adds what the per-KV-head
    grid adds, on ``_split_groups``' rows (prefixes of 0, 20, 32 and mid-page 53 keys over
    several 16-key tiles and two splits, adapters 0, 1 and -1) with random scores, lse and
    partials; float16 scores relative to a random block max (``REL_SCORE``). Rows without an
    adapter are left untouched."""
    from forkserve.kernels.residual_decode_triton import residual_values
    _, _, _, _, v_res, _, rbt, lens, _, b_v, ad, _, _, _, kv_starts = _split_groups()
    gen = torch.Generator().manual_seed(3)
    batch, n_heads, n_kv, splits, block_n = len(lens), 4, 2, 2, 16
    dim = b_v.shape[-1] // n_kv
    width = int(lens.max())
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)  # noqa: E731
    scores = rand(batch, n_heads, width).to(score_dtype)
    block_max = None if score_dtype == torch.float32 else rand(batch, n_heads, -(-width // block_n))
    part_lse = rand(batch, n_heads, splits) + 4.0
    part_out = rand(batch, n_heads, splits, dim)
    outs = {}
    for grid in ("kv_head", "row"):
        outs[grid] = part_out.clone()
        residual_values(scores, v_res, b_v, rbt, ad, kv_starts, outs[grid], part_lse, n_kv,
                        splits, block_n, block_max=block_max, grid=grid)
    added = outs["kv_head"] - part_out
    assert added[(ad >= 0) & (kv_starts > 0)].abs().amax() > 0.1  # the pass did add something
    assert torch.equal(outs["row"][ad < 0], part_out[ad < 0])
    assert rel_err(outs["row"] - part_out, added) < (1e-5 if DTYPE == torch.float32 else REL_TOL)


@pytest.mark.parametrize("score_dtype", [torch.float32, torch.float16])
def test_row_value_grid_cascade_equals_default(score_dtype: torch.dtype) -> None:
    """The whole split cascade (``_split_groups``) with ``value_grid="row"`` equals the
    default grid, reports its one-program-per-row-and-split grid, and refuses other grids."""
    from forkserve.kernels.shared_prefix import cascade_residual_launches
    args = _split_groups()
    tuning = {k: v for k, v in TUNING.items() if k != "use_triton"}
    run = lambda grid: cascade_residual_launches(  # noqa: E731
        *args, score_dtype=score_dtype, value_grid=grid, **tuning)
    row, kv_head = run("row"), run("kv_head")
    batch, splits = args[0].shape[0], kv_head.grids["values"][2]
    assert kv_head.grids["values"] == (batch, 2, splits)
    assert row.grids["values"] == (batch, 1, splits)
    tol = (1e-5 if score_dtype == torch.float32 else 3e-3) if DTYPE == torch.float32 else REL_TOL
    assert rel_err(row.run(), kv_head.run()) < tol
    with pytest.raises(ValueError, match="grid"):
        run("heads")


@pytest.mark.parametrize("variant,score_dtype", [("two_pass", torch.float32),
                                                 ("two_pass", torch.float16),
                                                 ("tiled_scores", torch.float16)])
def test_prefetch_cascade_equals_default(variant: str, score_dtype: torch.dtype) -> None:
    """The split cascade (``_split_groups``: several tiles, a group of one, a prefix ending
    mid-page) with each tile's scores loaded a tile ahead in the prefix and suffix launches
    (the default) computes what it does without; msc (whole logits, no bias) refuses it and
    runs without it by default."""
    from forkserve.kernels.shared_prefix import cascade_residual_launches
    args = _split_groups()
    tuning = {k: v for k, v in TUNING.items() if k != "use_triton"}
    run = lambda prefetch, v=variant: cascade_residual_launches(  # noqa: E731
        *args, variant=v, score_dtype=score_dtype, prefetch=prefetch, **tuning).run()
    assert torch.equal(run(True), run(False))
    with pytest.raises(ValueError, match="prefetch"):
        cascade_residual_launches(*args, variant="msc", score_dtype=torch.float32,
                                  prefetch=True, **tuning)
    assert torch.equal(run(None), run(True))
