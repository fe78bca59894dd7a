"""benchmarks/linear_bench.py --smoke: the sweep's plumbing on the CPU (interpreter): every
point timed against F.linear, each tile checked first, the tuning it would adopt written."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kernel_testlib import ON_CUDA

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
linear_bench = pytest.importorskip("linear_bench")

from forkserve.kernels.skinny_gemm import ShapeKey, SkinnyTuning  # noqa: E402


@pytest.mark.skipif(ON_CUDA, reason="--smoke is the interpreter's run over CPU tensors")
def test_smoke_run_writes_points_and_tuning(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["linear_bench.py", "--smoke", "--out", str(tmp_path)])
    linear_bench.main()
    res = json.loads((tmp_path / "linear_bench.json").read_text())
    assert len(res["points"]) == 2 * len(linear_bench.SMOKE)
    for point in res["points"]:
        assert "cublas" in point["ms"] and point["best"] in point["ms"]
        # every tile that ran was checked against F.linear first, within tolerance
        assert all(point["max_error"][n] <= point["tolerance"] for n in point["ms"]
                   if n != "cublas")
    tuning = SkinnyTuning.from_json(json.loads((tmp_path / "skinny_tuning.json").read_text()))
    assert tuning.devices() == ("cpu",)
    adopted = {p["key"]: p["adopted"] for p in res["points"]}
    for key, name in adopted.items():
        tile = tuning.tile("cpu", ShapeKey.parse(key))
        assert (tile is None) == (name is None)
        assert tile is None or linear_bench.tile_name(tile) == name
    assert (tmp_path / "linear_bench.png").stat().st_size > 0
