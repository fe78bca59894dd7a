"""benchmarks/decode_bench.py --tiny --engine-only on CPU: the Engine-level decode rows (batch 1
and 64, 64 over 32 adapters; overlap off and on) run, land in the JSON and the table. On CPU
the overlap's launch runs synchronously: the plumbing is checked, not the speed."""
from __future__ import annotations

import json
import sys

from tests.benchmark_script import load_script


def test_engine_only_rows(tmp_path, monkeypatch, capsys) -> None:
    db = load_script("decode_bench")
    monkeypatch.setattr(sys, "argv", ["decode_bench.py", "--tiny", "--engine-only", "--steps",
                                      "3", "--out", str(tmp_path)])
    db.main()
    res = json.loads((tmp_path / "decode_bench_engine.json").read_text())
    assert res["errors"] == {}
    rows = res["engine_decode"]
    assert [(r["batch"], r["lora"], r["overlap"]) for r in rows] == [
        (1, False, False), (1, False, True), (64, False, False), (64, False, True),
        (64, True, False), (64, True, True)]
    assert all(r["steps"] == 3 and r["prompt"] == 512 and r["ms_per_step"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "engine_b64 LoRA overlap" in out


def test_step_only_rows(tmp_path, monkeypatch) -> None:
    """--step-only: the backend-step rows (goal rows 10a/b) and the Engine rows, no prefill,
    shared-context or disaggregated rows."""
    db = load_script("decode_bench")
    monkeypatch.setattr(sys, "argv", ["decode_bench.py", "--tiny", "--step-only", "--steps",
                                      "2", "--out", str(tmp_path)])
    db.main()
    res = json.loads((tmp_path / "decode_bench_step.json").read_text())
    assert res["errors"] == {}
    assert all(res[k]["ms_per_step"] > 0 for k in
               ("decode_b1", "decode_b1_lora", "decode_b64", "decode_b64_lora",
                "decode_b1_columns", "decode_b64_columns"))
    # items and columns timed in turn (no cuBLAS baseline off CUDA)
    assert set(res["ab_b64"]) == {"items", "columns"}
    assert res["decode_b64_columns"]["last_tokens"] == res["decode_b64"]["last_tokens"]
    assert len(res["engine_decode"]) == 6
    for batch in (1, 64):  # the traced steps, cut into their phases (step_trace.py)
        assert res[f"trace_b{batch}"]["trace"]["steps"] == 8
        assert (tmp_path / res[f"trace_b{batch}"]["trace_file"]).is_file()
    assert not any(k.startswith(("prefill", "decode_b32_shared", "decode_b64_lora_dis"))
                   for k in res)
