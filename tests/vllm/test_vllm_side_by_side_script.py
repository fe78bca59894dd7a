"""benchmarks/vllm_side_by_side.py runs without vLLM: it says vLLM is missing and skips those
runs."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_script_reports_missing_vllm(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("vllm_side_by_side",
                                                  ROOT / "benchmarks/vllm_side_by_side.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look themselves up
    spec.loader.exec_module(script)
    # --skip-decode: the decode comparison's TorchBackend rows run without vLLM (another
    # test covers them); this one is about the vLLM runs being skipped.
    status = script.main(["--tiny", "--workflows", "1", "8", "--systems", "vllm", "vllm_no_lora",
                          "--skip-decode", "--out", str(tmp_path)])
    assert status == 0  # vLLM missing is a skip, not a failure
    report = json.loads((tmp_path / "vllm_side_by_side.json").read_text())
    assert report["results"] == [] and report["errors"] == []
    assert len(report["skipped"]) == 4
    assert all('pip install -e ".[vllm]"' in s["why"] for s in report["skipped"])
    assert "vLLM is missing" in capsys.readouterr().out
