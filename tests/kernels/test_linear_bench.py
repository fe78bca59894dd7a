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


@pytest.mark.skipif(ON_CUDA, reason="--smoke is the interpreter's run over CPU tensors")
def test_fold_run_measures_the_folding_calls(tmp_path, monkeypatch):
    """--fold: o with the residual add in its epilogue and gate_up with its input's norm,
    each checked against the unfolded call (cuBLAS and the glue kernel) first; the keys say
    what they fold, and a folded norm's tiles are never split."""
    monkeypatch.setattr(sys, "argv", ["linear_bench.py", "--smoke", "--fold", "--projections",
                                      "o", "gate_up", "--out", str(tmp_path)])
    linear_bench.main()
    res = json.loads((tmp_path / "linear_bench.json").read_text())
    keys = [ShapeKey.parse(p["key"]) for p in res["points"]]
    assert [(k.silu, k.fold) for k in keys] == [(False, "add")] * 2 + [(True, "norm")] * 2
    for point, key in zip(res["points"], keys, strict=True):
        assert all(point["max_error"][n] <= point["tolerance"] for n in point["ms"]
                   if n != "cublas")
        if key.fold == "norm":
            assert not any(n.endswith(("_x2", "_x4", "_x8")) for n in point["ms"])
    tuning = SkinnyTuning.from_json(json.loads((tmp_path / "skinny_tuning.json").read_text()))
    assert all(tuning.names("cpu", k) for k in keys)
