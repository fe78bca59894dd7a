"""benchmarks/residual_prefill_bench.py at its smoke shapes (CPU, Triton interpreter): every
case row names the route the policy takes and times each route eagerly and, where a graph
holds it, by device time, as ratios to the best unified route; the JSON and PNG land."""
from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_script import load_script

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU smoke shapes; on CUDA run the bench itself")


def test_smoke_rows(tmp_path) -> None:
    bench = load_script("residual_prefill_bench")
    assert bench.main(["--smoke", "--out", str(tmp_path), "--tag", "rp"]) == 0
    res = json.loads((tmp_path / "rp.json").read_text())
    assert [(r["batch"], r["new"], r["keys"]) for r in res["rows"]] == bench.SMOKE_CASES
    for row in res["rows"]:
        # No FA4 nor ws on CPU: the Triton routes, the policy's pick recorded with them.
        assert row["policy_route"] in ("fused", "merged") and row["baseline"] == "paged"
        assert set(row["residual"]) == {"fused", "flash", "auto"}
        assert row["over_baseline"]["fused"] == pytest.approx(
            row["residual"]["fused"] / row["unified"]["paged"])
        assert set(row["device"]) == {"unified_paged", "residual_fused"}
        assert row["device_over_best_unified"]["unified_paged"] == pytest.approx(1.0)
    assert (tmp_path / "rp.png").stat().st_size > 0


def test_an_unknown_launch_to_skip_is_one_line(tmp_path, capsys) -> None:
    bench = load_script("residual_prefill_bench")
    with pytest.raises(SystemExit) as e:
        bench.main(["--smoke", "--out", str(tmp_path), "--skip-launches", "ws_m96_s3"])
    assert e.value.code == 2
    assert "unknown ws launch ws_m96_s3" in capsys.readouterr().err.splitlines()[-1]
