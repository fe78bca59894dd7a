"""benchmarks/kernel_bench.py --cascade-split at a toy shape (CPU, Triton interpreter): one
case with two-pass, msc and the tiled score pass, each whole and its pass 1 alone, equal
outputs, the JSON, table and plot. On CUDA run the bench itself."""
from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_script import load_script

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CPU smoke shapes; on CUDA run the bench itself"),
              pytest.mark.slow]  # ~7 s in the interpreter


def test_cascade_split_rows(tmp_path, monkeypatch) -> None:
    kb = load_script("kernel_bench")
    names = ("two_pass", "msc", "tiled_a2h1_bn64_w8")
    monkeypatch.setattr(kb, "CASCADE_SPLIT_VARIANTS",
                        {n: kb.CASCADE_SPLIT_VARIANTS[n] for n in names})
    s = kb.Setup(smoke=True)
    s.split_prefixes, s.split_agents, s.split_suffix = [40], [3], 8
    res = kb.result_header(s, cascade_split=[])
    path = tmp_path / "kernel_bench_cascade_split.json"
    kb.run_cascade_split(s, res, lambda: path.write_text(json.dumps(res)))
    assert "errors" not in res
    (row,) = json.loads(path.read_text())["cascade_split"]
    assert (row["prefix_ctx"], row["agents"], row["suffix"]) == (40, 3, 8)
    for n in names:
        assert row[n + "_ms"] > 0 and row[n + "_pass1_ms"] > 0 and row[n + "_rel_err"] < 1e-5
    kb.print_cascade_split(res)
    kb.plot_cascade_split(res, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
