"""benchmarks/kernel_bench.py --cascade-split at a toy shape (CPU, Triton interpreter): one
case with two-pass (float32 and float16 scores; the value pass's row grid) and msc, each
whole and launch by launch (times, bytes, GB/s, grids), equal outputs, the JSON, table and
plot (the tiled score pass runs the same bench code; its kernels' tests are
test_shared_prefix.py's). On CUDA run the bench itself."""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.kernelbench.cascade_split import (
    plot_cascade_split,
    print_cascade_split,
    run_cascade_split,
)
from benchmarks.kernelbench.report import result_header
from benchmarks.kernelbench.setup import Setup

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CPU smoke shapes; on CUDA run the bench itself"),
              pytest.mark.slow]  # ~12 s in the interpreter


def test_cascade_split_rows(tmp_path) -> None:
    names = ("two_pass", "two_pass_fp16", "two_pass_rowvalues", "msc", "p1_qfold_bn32_w4")
    s = Setup(smoke=True)
    s.split_prefixes, s.split_agents, s.split_suffix = [40], [3], 8
    res = result_header(s, cascade_split=[], split_variants=list(names))
    path = tmp_path / "kernel_bench_cascade_split.json"
    run_cascade_split(s, res, lambda: path.write_text(json.dumps(res)))
    assert "errors" not in res
    (row,) = json.loads(path.read_text())["cascade_split"]
    assert (row["prefix_ctx"], row["agents"], row["suffix"]) == (40, 3, 8)
    parts = ("pass1", "prefix", "values", "suffix", "merge")
    for n in names:
        assert row[n + "_ms"] > 0 and row[n + "_pass1_ms"] > 0
        assert row[n + "_rel_err"] < (3e-3 if "fp16" in n or n.startswith("p1_") else 1e-5)
        for key in ("_parts_ms", "_parts_bytes", "_parts_GBps"):
            assert tuple(row[n + key]) == parts
            assert all(math.isfinite(x) and x > 0 for x in row[n + key].values())
        assert row[n + "_parts_ms"]["pass1"] == row[n + "_pass1_ms"]
        # One tile of 3 agents (in 32 places), 2 KV heads (the row grid: all in one program),
        # split as the launches planned.
        prefix, values = row[n + "_grids"]["prefix"], row[n + "_grids"]["values"]
        assert prefix[:2] == [1, 2]
        assert values == [3, 1 if n.endswith("rowvalues") or n.startswith("p1_") else 2, prefix[2]]
    # float16 scores halve the bytes the score buffer moves
    assert row["two_pass_fp16_parts_bytes"]["prefix"] < row["two_pass_parts_bytes"]["prefix"]
    print_cascade_split(res)
    plot_cascade_split(res, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
