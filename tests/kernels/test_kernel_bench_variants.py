"""benchmarks/kernel_bench.py --variants at its smoke shapes (CPU, Triton interpreter): unified
and each variant's whole call timed together (``measure_interleaved``), a variant that fails
(``pdl`` needs an sm_90 GPU) recorded as NaN with its error while the others are still timed,
and each two-pass variant's pass 1 alone. On CUDA run the bench itself."""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.kernelbench.report import result_header
from benchmarks.kernelbench.setup import Setup
from benchmarks.kernelbench.variants import run_decode_variants

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU smoke shapes; on CUDA run the bench itself")


def test_variants_row_keeps_the_others_when_one_fails(tmp_path) -> None:
    s = Setup(smoke=True)
    s.contexts, s.batches = [64], [2]
    res = result_header(s, decode_variants=[])
    path = tmp_path / "kernel_bench_decode_variants.json"
    run_decode_variants(s, res, ["two_pass_nopdl", "two_pass_pdl"], path)
    (row,) = json.loads(path.read_text())["decode_variants"]
    assert row["unified_ms"] > 0 and row["two_pass_nopdl_ms"] > 0
    assert row["two_pass_nopdl_ratio"] == row["two_pass_nopdl_ms"] / row["unified_ms"]
    assert row["two_pass_nopdl_scores_ms"] > 0
    assert math.isnan(row["two_pass_pdl_ms"])
    assert any("two_pass_pdl" in e and "pdl" in e for e in res["errors"])


def test_another_group_and_rank_reach_the_pools_and_the_header() -> None:
    """``--group`` and ``--rank``: the query heads a KV head and the residual pools' rank, in
    the pools, the adapters and the result's recorded shape (issue15_goals reads it)."""
    s = Setup(smoke=True, group=3, rank=32)
    assert (s.n_heads, s.n_kv, s.rank) == (3 * s.n_kv, s.n_kv, 32)
    assert s.k_res.shape[-1] == 32 and s.b_k.shape[1] == 32
    assert result_header(s)["shape"] == {"n_heads": 3 * s.n_kv, "n_kv": s.n_kv,
                                         "head_dim": s.head_dim, "rank": 32,
                                         "page_size": s.page}
    default = Setup(smoke=True)
    assert (default.n_heads // default.n_kv, default.rank) == (2, 16)
