"""benchmarks/kernel_bench.py --decode-short at its smoke shapes (CPU, Triton interpreter):
a row for a wide table (a decode graph's): the static and dynamic plans' split counts, the
sweep, and both plans' outputs equal (and equal to the float32 reference), its JSON and plot.
On CUDA run the bench itself."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernelbench.decode_short import (
    plot_decode_short,
    print_decode_short,
    run_decode_short,
)
from benchmarks.kernelbench.report import result_header
from benchmarks.kernelbench.setup import Setup

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU smoke shapes; on CUDA run the bench itself")


def test_decode_short_rows(tmp_path) -> None:
    s = Setup(smoke=True)
    s.short_keys, s.short_widths, s.short_batches = [24], [128], [1]
    res = result_header(s, decode_short=[])
    path = tmp_path / "kernel_bench_decode_short.json"
    saved = []
    run_decode_short(s, res, lambda: saved.append(path.write_text(json.dumps(res))))
    assert "errors" not in res
    assert len(saved) == 1 and json.loads(path.read_text())["decode_short"] == res["decode_short"]
    (row,) = res["decode_short"]
    assert (row["keys"], row["width"], row["batch"]) == (24, 128, 1)
    # The static plan cuts the table's width (one 128-key split); the dynamic plan caps its
    # count by the width (4 SMs off CUDA: 2 programs ask for 8 splits, 128 keys allow 2 of
    # DYN_MIN_SPLIT_TOKENS) and 24 keys in 16-key tiles fill both.
    assert (row["old_splits"], row["old_split_len"]) == (1, 128)
    assert (row["new_splits"], row["new_live_splits"]) == (2, 2)
    assert set(row["sweep_ms"]) == {"1", "2"}
    assert row["new_rel_err_vs_old"] < 1e-5 and row["new_rel_err_vs_ref_fp32"] < 1e-5
    assert row["old_TBps"] > 0 and row["new_TBps"] > 0
    # The tile sweep (one configuration at smoke shapes), over the dynamic plan's time.
    assert list(row["tiles_ms"]) == ["bn64_w4_s3"] and row["tiles_over_new"]["bn64_w4_s3"] > 0
    print_decode_short(res)
    plot_decode_short(res, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
