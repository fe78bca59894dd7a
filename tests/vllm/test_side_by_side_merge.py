"""benchmarks/vllm_side_by_side.py's ``--rows-from`` merge (this run's rows replace the earlier
ones of the same key, decode entries merge by (batch, LoRA)) and its TorchBackend decode row,
which runs without vLLM (no harness)."""
from __future__ import annotations

import json

import pytest

from tests.benchmark_script import load_script


@pytest.fixture(scope="module")
def sbs():
    return load_script("vllm_side_by_side")


def _row(system, w, tput, cascade=True):
    return {"system": system, "workflows": w, "cascade": cascade, "overlap": False,
            "tasks_per_s": tput}


def test_merge_replaces_same_key_rows_and_merges_decode(sbs):
    earlier = {"results": [_row("unified", 1, 1.0), _row("vllm", 1, 2.0),
                           _row("unified", 1, 3.0, cascade=False)],
               "errors": [{"system": "unified", "workflows": 8, "error": "OOM"},
                          {"system": "vllm", "workflows": 8, "error": "boom"}],
               "decode": [{"batch": 1, "lora": False, "steps": 32,
                           "vllm_backend_ms_per_step": 9.0, "native_vllm_ms_per_step": 5.0}]}
    report = {"warmup": True, "results": [_row("unified", 1, 10.0), _row("unified", 8, 11.0)],
              "errors": [],
              "decode": [{"batch": 64, "lora": True, "steps": 4, "torch_backend_ms_per_step": 7.0},
                         {"batch": 1, "lora": False, "steps": 4,
                          "torch_backend_ms_per_step": 1.5}]}
    merged = sbs.merge_reports(report, earlier, "old.json")
    assert [(r["system"], r["workflows"], r["cascade"], r["tasks_per_s"])
            for r in merged["results"]] == [("unified", 1, True, 10.0), ("vllm", 1, True, 2.0),
                                            ("unified", 1, False, 3.0), ("unified", 8, True, 11.0)]
    assert merged["errors"] == [{"system": "vllm", "workflows": 8, "error": "boom"}]
    assert merged["decode"] == [
        {"batch": 1, "lora": False, "steps": 4, "vllm_backend_ms_per_step": 9.0,
         "native_vllm_ms_per_step": 5.0, "torch_backend_ms_per_step": 1.5},
        {"batch": 64, "lora": True, "steps": 4, "torch_backend_ms_per_step": 7.0}]
    assert merged["warmup"] is True and merged["merged_from"] == "old.json"
    assert sbs.merge_reports(report, None) is report
    assert "TorchBackend 1.50; Engine on VllmBackend 9.00; vLLM's own loop 5.00" in \
        sbs.decode_line(merged["decode"][0])


def test_tiny_run_warms_up_and_adds_a_torch_decode_row_without_vllm(sbs, tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    flags = ["--tiny", "--turns", "1", "--gen", "4", "--context", "64", "--decode-steps", "2"]
    assert sbs.main([*flags, "--systems", "no_lora", "--workflows", "1", "--out", str(first),
                     "--skip-decode"]) == 0
    earlier = json.loads((first / "vllm_side_by_side.json").read_text())
    earlier["results"].append({**earlier["results"][0], "system": "vllm"})
    earlier["decode"] = [{"batch": 1, "lora": True, "steps": 2, "vllm_backend_ms_per_step": 9.0,
                          "native_vllm_ms_per_step": 5.0}]
    (first / "vllm_side_by_side.json").write_text(json.dumps(earlier))
    assert sbs.main([*flags, "--systems", "no_lora", "--workflows", "1", "2", "--warmup",
                     "--rows-from", str(first / "vllm_side_by_side.json"),
                     "--out", str(second)]) == 0
    report = json.loads((second / "vllm_side_by_side.json").read_text())
    assert report["warmup"] is True and report["errors"] == []
    assert sorted((r["system"], r["workflows"]) for r in report["results"]) == [
        ("no_lora", 1), ("no_lora", 2), ("vllm", 1)]
    decode = {(d["batch"], d["lora"]): d for d in report["decode"]}
    assert list(decode) == [(1, False), (1, True), (64, False), (64, True)]
    assert all(d["torch_backend_ms_per_step"] > 0 for d in decode.values())
    assert decode[1, True]["native_vllm_ms_per_step"] == 5.0  # the earlier vLLM columns stay
    assert "vllm_backend_ms_per_step" not in decode[64, True]
    out = capsys.readouterr().out
    assert "no_lora        warm-up" in out and "decode b=64  lora=True  TorchBackend" in out
