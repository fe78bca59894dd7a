"""Paged decode and ResidualAttention decode against the plain formulas (plain_oracle.py)."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import (
    DEVICE,
    DTYPE,
    REL_TOL,
    make_adapters,
    make_cache,
    rel_err,
    residual_inputs,
)

from forkserve.kernels import paged_decode, residual_decode
from forkserve.kernels.rope import default_inv_freq

# (seq_lens, n_heads, n_kv_heads): ragged, mid-page ends, a length of exactly one page,
# GQA groups of 1, 2, 4 and a non power of two (3).
CASES = [
    ([37, 100, 16, 1], 4, 2),
    ([129, 50], 8, 2),
    ([70, 33, 17], 6, 2),
    ([90], 2, 2),
]


def _q(gen: torch.Generator, batch: int, n_heads: int, head_dim: int) -> torch.Tensor:
    return torch.randn(batch, n_heads, head_dim, generator=gen).to(DEVICE, DTYPE)


@pytest.mark.parametrize("seq_lens,n_heads,n_kv", CASES)
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_paged_decode(seq_lens: list[int], n_heads: int, n_kv: int, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + n_heads)
    c = make_cache(gen, seq_lens, n_kv, 32, rank=8)
    q = _q(gen, len(seq_lens), n_heads, 32)
    out = paged_decode(q, c.k, c.v, c.block_tables, c.seq_lens, use_triton=True,
                       num_splits=num_splits, block_n=16)
    assert rel_err(out, plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens)) < REL_TOL


# (variant, extra tuning): two-pass (scores kernel + unified loop with a score bias; the
# score pass in its rotate form, keys as N or M, and in the q-folded form with cos/sin by
# angle addition or from the table), chunked (both passes in one launch; a 32-key chunk gives
# several chunks per split, and chunks that end mid-tile), the fused rebuild with both score
# forms. A 48-key chunk starts score programs mid-tile and mid-page. Materialized scores
# (msc: whole logits from K_base and K_res, then a loop over V only) at its default tiles
# (one tile covers a sequence), at 16-key tiles with several chunks per sequence, and with
# cos/sin by angle addition. msc2s (msc's pass 1 as a base-logits kernel and the q-folded
# residual scorer, two streams on CUDA) at its default tuning, and at 16-key tiles with
# several base chunks per sequence (8 waves) and residual chunks of 48 keys (mid-tile).
# Three-pass (two-pass whose partial kernel writes the scores back and leaves V_res to the
# value pass) at the default split count and at 2, so a value program meets split bounds.
# Two-pass on the static plan and on the dynamic one without prefetch (the defaults since
# round 13 are the dynamic plan with the bias and residual table loaded a tile ahead): 2
# splits, the plan's own count, and one split (the output written directly, no merge); the
# rows in 2 and 3 slices, pass 1 of each before its pass 2 (a side stream on CUDA). Pass 1
# with its residual rows loaded a tile ahead (q-folded from a table in the queries' dtype,
# and the rotate form).
QFOLD_ANGLE = {"form": "qfold", "block_n": 16}
QFOLD_TABLE = {"form": "qfold", "block_n": 16, "angle_add": False, "chunk": 48}
VARIANTS = [
    ("two_pass", {}),
    ("two_pass", {"score_tuning": {"block_n": 16, "chunk": 48}}),
    ("two_pass", {"score_tuning": {"block_n": 16, "keys_m": True}}),
    ("two_pass", {"score_tuning": QFOLD_ANGLE}),
    ("two_pass", {"score_tuning": dict(QFOLD_ANGLE, chunk=48)}),
    ("two_pass", {"score_tuning": QFOLD_TABLE}),
    ("two_pass", {"score_tuning": dict(QFOLD_TABLE, prefetch=True, table16=True)}),
    ("two_pass", {"score_tuning": {"block_n": 16, "keys_m": True, "prefetch": True}}),
    ("two_pass", {"plan": "static", "prefetch": False}),
    ("two_pass", {"plan": "dynamic", "prefetch": False}),
    ("two_pass", {"plan": "dynamic", "num_splits": None}),
    ("two_pass", {"plan": "dynamic", "num_splits": 1}),
    ("two_pass", {"plan": "dynamic", "num_splits": 1, "prefetch": False}),
    ("two_pass", {"plan": "static", "score_tuning": {"block_n": 16, "chunk": 48}}),
    ("two_pass", {"overlap_slices": 2}),
    ("two_pass", {"overlap_slices": 3, "num_splits": None}),
    ("three_pass", {}),
    ("three_pass", {"num_splits": None, "score_tuning": {"block_n": 16, "chunk": 48}}),
    ("chunked", {"chunk": 32}),
    ("fused", {"split_score": True}),
    ("fused", {"split_score": False}),
    ("folded", {}),
    ("folded", {"num_splits": 1, "prefetch": False}),
    ("msc", {"block_n": 64}),
    ("msc", {"score_tuning": {"block_n": 16, "chunk": 48}}),
    ("msc", {"score_tuning": {"block_n": 16, "angle_add": True}}),
    ("msc2s", {"block_n": 64}),
    ("msc2s", {"score_tuning": {"block_n": 16, "waves": 8,
                                "residual": {"block_n": 16, "chunk": 48}}}),
]


@pytest.mark.parametrize("seq_lens,n_heads,n_kv", CASES)
@pytest.mark.parametrize("variant,tuning", VARIANTS)
def test_residual_decode(seq_lens: list[int], n_heads: int, n_kv: int, variant: str,
                         tuning: dict) -> None:
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(len(seq_lens) * 7, seq_lens, n_kv)
    q = _q(gen, len(seq_lens), n_heads, 32)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, inv_freq)
    out = residual_decode(*args, use_triton=True, **{"num_splits": 2, "block_n": 16, **tuning},
                          variant=variant)
    ref = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens,
                       (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))
    assert rel_err(out, ref) < REL_TOL
    # The residual must matter, or this test could not catch a kernel that drops it.
    base_only = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens)
    with_adapter = adapters >= 0
    assert rel_err(base_only[with_adapter], ref[with_adapter]) > 20 * REL_TOL
    # No adapter: exactly the unified kernel's math over the base pages.
    assert rel_err(out[~with_adapter], base_only[~with_adapter]) < REL_TOL


@pytest.mark.parametrize("variant,tuning", [
    # 64-key tiles: the interpreter's cost is per tile (the chunked form took 26 s at 16).
    ("two_pass", {}), ("chunked", {"block_n": 64}), ("three_pass", {}),
    ("two_pass", {"plan": "dynamic", "prefetch": True}),
    ("two_pass", {"score_tuning": {"form": "qfold"}}),
    ("two_pass", {"score_tuning": {"form": "qfold", "angle_add": False}}),
    ("folded", {}),
])
def test_residual_decode_past_4k(variant: str, tuning: dict) -> None:
    """One adapter, keys past position 4K: RoPE of the rebuilt keys far from the table's
    first rows (angle addition in the kernels, a direct rotation in the oracle)."""
    seq_lens = [4100 + 9, 4096 + 64]
    n_heads, n_kv, head_dim = 4, 2, 32
    gen, c, b_k, b_v, _, inv_freq = residual_inputs(11, seq_lens, n_kv, head_dim)
    adapters = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    q = _q(gen, len(seq_lens), n_heads, head_dim)
    out = residual_decode(q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables,
                          c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=True,
                          variant=variant, **tuning)
    ref = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens,
                       (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.parametrize("variant,score_tuning", [
    ("two_pass", {}), ("two_pass", QFOLD_ANGLE), ("two_pass", QFOLD_TABLE),
    ("two_pass", dict(QFOLD_TABLE, table16=True, prefetch=True)),
    ("three_pass", {}), ("msc", {"block_n": 16}), ("msc", {"block_n": 16, "dtype": torch.float16}),
    ("msc2s", {"block_n": 16, "residual": {"block_n": 16}}),
    ("msc2s", {"block_n": 16, "dtype": torch.float16, "residual": {"block_n": 16}}),
])
def test_residual_decode_fp16(variant: str, score_tuning: dict) -> None:
    """Half-precision operands (the score pass rounds folded matrices, cos/sin and its
    float16 scores; msc's logits float32 or float16; msc2s's float16 bias beside float32 or
    float16 logits): still the plain formula at half precision, every adapter kind."""
    seq_lens, n_heads, n_kv, head_dim, rank = [37, 100, 70, 16], 8, 2, 32, 8
    gen = torch.Generator().manual_seed(5)
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=rank, dtype=torch.float16)
    b_k, b_v = make_adapters(gen, 3, rank, n_kv, head_dim, dtype=torch.float16)
    adapters = torch.tensor([0, 2, -1, 1], dtype=torch.int32, device=DEVICE)
    inv_freq = default_inv_freq(head_dim, device=DEVICE)
    q = _q(gen, len(seq_lens), n_heads, head_dim).to(torch.float16)
    out = residual_decode(q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables,
                          c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=True,
                          num_splits=2, block_n=16, score_tuning=score_tuning or None,
                          variant=variant)
    ref = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens,
                       (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))
    assert rel_err(out, ref) < 5e-3  # measured 6e-4 to 8e-4 under the interpreter
    assert rel_err(plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens), ref) > 0.2


@pytest.mark.parametrize("score_tuning,wrong", [
    ({"form": "rotated"}, "form"),
    ({"form": "qfold", "keys_m": True}, "keys_m"),
    ({"angle_add": False}, "angle_add"),
    ({"table16": True}, "table16"),
    ({"form": "qfold", "table16": True}, "table16"),
    ({"kv_heads": 2}, "kv_heads"),
    ({"form": "qfold", "kv_heads": 0}, "kv_heads"),
])
def test_residual_score_options_refused(score_tuning: dict, wrong: str) -> None:
    """An unknown score form, or an option of the other form, is a clear error."""
    _, c, b_k, b_v, adapters, inv_freq = residual_inputs(3, [20], 2)
    q = torch.zeros(1, 2, 32, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=wrong):
        residual_decode(q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables,
                        c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=True,
                        variant="two_pass", score_tuning=score_tuning)


# (form options): pass 1's q-folded form from the table at 16-key tiles, chunks of 48 keys
# (programs start mid-tile) and of 16 (one tile: the prefetch runs past the chunk), and the
# rotate form with keys as M.
SCORE_PASSES = [
    {"form": "qfold", "angle_add": False, "block_n": 16, "chunk": 48},
    {"form": "qfold", "angle_add": False, "block_n": 16, "chunk": 16},
    {"block_n": 16, "keys_m": True, "chunk": 48},
]


# The serving dtype on CUDA; float16 under the interpreter, which holds bf16 wrongly.
@pytest.mark.parametrize("dtype", [torch.float32,
                                   torch.bfloat16 if DEVICE.type == "cuda" else torch.float16])
@pytest.mark.parametrize("options", SCORE_PASSES)
@pytest.mark.parametrize("n_heads,n_kv", [(8, 4), (6, 2), (4, 1)])
def test_score_pass_prefetch_and_table16_change_no_score(options: dict, dtype: torch.dtype,
                                                         n_heads: int, n_kv: int) -> None:
    """Loading each tile's residual rows a tile ahead, and (q-folded) reading cos/sin from a
    table already in the queries' dtype, reorder loads only: every score the pass writes is
    bit for bit the plain pass's, and it writes nothing else (the buffer starts NaN). Two KV
    heads per q-folded program (GQA groups of 2, and of 3 in a padded block of 4) change the
    products' width, not a column's sum: the same scores to rounding."""
    from forkserve.kernels.residual_decode_triton import residual_scores
    from forkserve.kernels.rope import cached_rope_table

    seq_lens = [37, 100, 70, 16, 81]
    gen, c, b_k, _, adapters, inv_freq = residual_inputs(23, seq_lens, n_kv)
    q = _q(gen, len(seq_lens), n_heads, 32).to(dtype)
    k_res, b_k = c.k_res.to(dtype), b_k.to(dtype)
    table = cached_rope_table(inv_freq, max(seq_lens))

    def scores(**extra) -> torch.Tensor:
        out = torch.full((len(seq_lens), n_heads, max(seq_lens)), float("nan"), device=DEVICE)
        residual_scores(q, k_res, c.res_block_tables, c.seq_lens, b_k, adapters, table, n_kv,
                        max(seq_lens), out=out, **options, **extra)
        return out

    plain_pass = scores()
    written = ~plain_pass.isnan()
    for b, (n, a) in enumerate(zip(seq_lens, adapters.tolist(), strict=True)):
        assert written[b, :, :n].all() == (a >= 0) and not written[b, :, n:].any()
    variants = [{"prefetch": True}]
    if options.get("form") == "qfold":
        variants += [{"table16": True}, {"prefetch": True, "table16": True}]
    for extra in variants:
        assert torch.equal(scores(**extra).nan_to_num(7.0), plain_pass.nan_to_num(7.0)), extra
    if options.get("form") == "qfold":
        shared = scores(kv_heads=2, prefetch=True, table16=True)
        assert torch.equal(shared.isnan(), plain_pass.isnan())
        torch.testing.assert_close(shared[written], plain_pass[written], rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="programmatic launches need sm_90")
@pytest.mark.parametrize("batch_lens", [[700], [37, 100, 70, 16, 81]])
def test_pdl_changes_no_output(batch_lens: list[int]) -> None:
    """Pass 2 launched programmatically while pass 1 runs (``pdl``, the default on sm_90)
    waits for pass 1's scores: the output is the plain launch's, bit for bit, at one row and
    at five (one without an adapter), under a CUDA graph too."""
    from forkserve.kernels.residual_decode_triton import programmatic_launches

    assert programmatic_launches(DEVICE)  # an H200: on by default
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(29, batch_lens, 2)
    q = _q(gen, len(batch_lens), 8, 32)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, inv_freq)
    # pdl is a two-pass option; the host bound keeps the capture free of a host sync
    bound = {"variant": "two_pass", "max_seq_len": max(batch_lens)}
    plain_launch = residual_decode(*args, use_triton=True, pdl=False, **bound)
    assert torch.equal(residual_decode(*args, use_triton=True, pdl=True, **bound), plain_launch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = residual_decode(*args, use_triton=True, pdl=True, **bound)
    graph.replay()
    assert torch.equal(captured, plain_launch)


# (score tuning, follow, splits): pass 1's 16-key tiles beside pass 2's 32, chunks of 32 keys
# (a pass-2 tile spans one chunk; several chunks per split) and 96 (several tiles of both
# passes per chunk, a split starting mid-chunk) published whole or in segments of 32 keys
# and of 16 (each tile: a segment ends mid-pass-2-tile), one split (direct output) and three;
# pass 1 with two KV heads per program publishing for both, in one wave.
QFOLD_ROWS = {"form": "qfold", "angle_add": False, "block_n": 16}
FOLLOW_CASES = [
    (dict(QFOLD_ROWS, chunk=32), True, 3),
    (dict(QFOLD_ROWS, chunk=96, prefetch=True), True, 1),
    (dict(QFOLD_ROWS, chunk=96), {"segment": 32}, 3),
    (dict(QFOLD_ROWS, chunk=96, prefetch=True), {"segment": 16}, 1),
    (dict(QFOLD_ROWS, kv_heads=2), {"waves": 1, "segment": 32}, 2),
]


@pytest.mark.parametrize("score_tuning,follow,splits", FOLLOW_CASES)
def test_follow_changes_no_output(score_tuning: dict, follow: bool | dict, splits: int) -> None:
    """Pass 2 following pass 1's published keys (``follow``) reads each tile's scores only
    once the flags say they are written: the same output as the whole-pass wait, bit for bit,
    with a row without an adapter and rows ending mid-tile. In the interpreter the wait
    returns the flag as it stands and pass 2 masks keys past it, so a flag raised short (or
    read at the wrong chunk, row or head) changes the output; on CUDA with pdl the passes
    overlap, under a CUDA graph too."""
    from forkserve.kernels.residual_decode_triton import programmatic_launches

    seq_lens = [37, 190, 70, 16, 81]
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(31, seq_lens, 4)
    q = _q(gen, len(seq_lens), 8, 32)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, inv_freq)
    tuning = {"variant": "two_pass", "max_seq_len": max(seq_lens), "num_splits": splits,
              "block_n": 32, "score_tuning": score_tuning}
    whole = residual_decode(*args, use_triton=True, pdl=False, **tuning)
    residual = (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq)
    assert rel_err(whole, plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens, residual)) < REL_TOL
    pdl = programmatic_launches(DEVICE)
    assert torch.equal(residual_decode(*args, use_triton=True, pdl=pdl, follow=follow, **tuning),
                       whole)
    if DEVICE.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = residual_decode(*args, use_triton=True, pdl=pdl, follow=follow, **tuning)
        graph.replay()
        assert torch.equal(captured, whole)


def test_follow_refused_where_nothing_publishes() -> None:
    """``follow`` needs the q-folded pass 1 and pass 2's tile-ahead bias loads on the
    dynamic plan: elsewhere, a clear error."""
    _, c, b_k, b_v, adapters, inv_freq = residual_inputs(3, [20], 2)
    q = torch.zeros(1, 2, 32, dtype=DTYPE, device=DEVICE)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, inv_freq)
    for wrong in ({"plan": "static"}, {"prefetch": False}, {"score_tuning": {"block_n": 16}}):
        with pytest.raises(ValueError, match="follow"):
            residual_decode(*args, use_triton=True, variant="two_pass", follow=True, pdl=False,
                            **wrong)


def test_pdl_refused_off_cuda() -> None:
    """A programmatic launch is a CUDA sm_90 feature: elsewhere, and with a pass that has no
    programmatic partner, a clear error."""
    _, c, b_k, b_v, adapters, inv_freq = residual_inputs(3, [20], 2)
    q = torch.zeros(1, 2, 32, dtype=DTYPE, device=DEVICE)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, inv_freq)
    with pytest.raises(ValueError, match="pdl"):
        residual_decode(*args, use_triton=True, variant="two_pass", pdl=True, plan="static")
    if DEVICE.type != "cuda":
        with pytest.raises(ValueError, match="pdl"):
            residual_decode(*args, use_triton=True, variant="two_pass", pdl=True)


def test_dynamic_two_pass_one_split_skips_the_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the dynamic plan one split writes the output itself, B_v applied, with no merge."""
    from forkserve.kernels import split_kv

    def no_merge(*args, **kwargs):
        raise AssertionError("one split must not launch the merge")

    monkeypatch.setattr(split_kv, "merge_partials", no_merge)
    seq_lens, n_heads, n_kv = [70, 9, 33, 16], 4, 2
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(9, seq_lens, n_kv)
    q = _q(gen, len(seq_lens), n_heads, 32)
    residual = (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq)
    out = residual_decode(q, c.k, c.v, *residual[:2], c.block_tables, c.res_block_tables,
                          c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=True,
                          variant="two_pass", plan="dynamic", num_splits=1, block_n=16)
    assert rel_err(out, plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens, residual)) < REL_TOL


@pytest.mark.parametrize("variant,columns", [("two_pass", 32), ("folded", 32), ("fused", 16)])
def test_residual_columns_per_variant(monkeypatch: pytest.MonkeyPatch, variant: str,
                                      columns: int) -> None:
    """The partial kernel's residual columns at rank 12 as each variant launches it: 32 where
    a 16-wide p @ V_res spills on sm_90 (two-pass, folded; test_sm90_compile checks the
    spills at that width), 16 for the fused rebuild."""
    from forkserve.kernels import decode_attention

    seen = []
    kernel = decode_attention._decode_partial_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["RANK"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode_attention, "_decode_partial_kernel", Recorder())
    seq_lens, n_heads, n_kv = [40, 9], 4, 2
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(5, seq_lens, n_kv)
    q = _q(gen, len(seq_lens), n_heads, 32)
    residual_decode(q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables,
                    c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=True, variant=variant,
                    block_n=16)
    assert seen and set(seen) == {columns}


@pytest.mark.parametrize("variant,options,wrong", [
    ("two_pass", {"plan": "dyn"}, "plan"), ("msc", {"plan": "dynamic"}, "plan"),
    ("msc", {"prefetch": True}, "prefetch"),
    ("two_pass", {"plan": "static", "overlap_slices": 2}, "overlap_slices"),
    ("two_pass", {"overlap_slices": 0}, "overlap_slices"),
])
def test_residual_plan_refused(variant: str, options: dict, wrong: str) -> None:
    """An unknown split plan, or the dynamic plan, prefetch or row slices for a variant or
    plan without them, is a clear error."""
    _, c, b_k, b_v, adapters, inv_freq = residual_inputs(3, [20], 2)
    q = torch.zeros(1, 2, 32, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=wrong):
        residual_decode(q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables,
                        c.seq_lens, b_k, b_v, adapters, inv_freq, use_triton=True,
                        variant=variant, **options)


def test_score_tuning_follows_the_batch_table() -> None:
    """The score pass's form is picked per batch bucket from the H200 table, one bound each."""
    from forkserve.kernels.residual_decode_triton import SCORE_TUNING_BY_BATCH, score_tuning_for

    bounds = [b for b, _ in SCORE_TUNING_BY_BATCH]
    assert bounds == sorted(bounds)
    for batch, block_n, warps in ((1, 128, 8), (8, 64, 4), (32, 64, 4), (64, 128, 8)):
        t = score_tuning_for(batch)
        assert (t["form"], t["block_n"], t.get("num_warps", 4)) == ("qfold", block_n, warps)
        assert t["table16"] and t["kv_heads"] == 2 and t["angle_add"] is False
    for lo, hi in zip([0, *bounds[:-1]], bounds, strict=True):
        assert score_tuning_for(hi) is score_tuning_for(lo + 1)


@pytest.mark.parametrize("num_splits", [1, 5, 32, 45])
def test_merge_reads_any_split_count(num_splits: int) -> None:
    """The merge reads the splits in fixed tiles (``MERGE_BLOCK_S``, one build for every
    count): counts below, at and past one tile equal the log-sum-exp of the partials, and a
    slot that saw no key (lse -inf, its output never written: NaN here) is skipped."""
    from forkserve.kernels.split_kv import empty_partials, merge_partials

    gen = torch.Generator().manual_seed(num_splits)
    batch, n_heads, head_dim = 3, 4, 16
    q = torch.empty(batch, n_heads, head_dim, device=DEVICE)
    part_out, part_lse = empty_partials(q, num_splits)
    part_out.copy_(torch.randn(part_out.shape, generator=gen))
    part_lse.copy_(torch.randn(part_lse.shape, generator=gen) * 4)
    if num_splits > 1:
        part_lse[:, :, num_splits // 2] = float("-inf")
        part_out[:, :, num_splits // 2] = float("nan")
    out = merge_partials(part_out, part_lse, torch.empty_like(q, dtype=DTYPE), num_splits)
    w = torch.softmax(part_lse.float() * 0.6931471805599453, dim=2)  # log2 domain
    live = torch.nan_to_num(part_out.float())
    ref = (w[..., None] * live).sum(2)
    assert rel_err(out.float(), ref) < (1e-5 if DTYPE == torch.float32 else REL_TOL)
