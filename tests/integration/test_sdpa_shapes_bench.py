"""benchmarks/sdpa_shapes_bench.py at CPU shapes: a first and a steady time per length, the
bucketed lengths rounded up to the bucket, the JSON written, the table printed."""
from __future__ import annotations

import json

from tests.benchmark_script import load_script


def test_bench_at_tiny_shapes(tmp_path, capsys):
    bench = load_script("sdpa_shapes_bench")
    assert bench.main(["--tiny", "--out", str(tmp_path), "--lengths", "3", "--reps", "1",
                       "--bucket", "32"]) == 0
    res = json.loads((tmp_path / "sdpa_shapes.json").read_text())
    rows = res["rows"]["default"]
    assert [r["length"] for r in rows["exact"]] == [64, 101, 138]
    assert rows["bucketed"] and all(r["length"] % 32 == 0 for r in rows["bucketed"])
    assert all(r["first_ms"] > 0 and r["steady_ms"] > 0 for r in rows["exact"])
    assert "overhead/len" in capsys.readouterr().out
