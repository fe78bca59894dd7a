"""benchmarks/h200_vllm.py end to end on CPU: the ``cuda-fanout`` stage on a tiny
TorchBackend, then the ``vllm`` stage over the fake vLLM (vllm_fakes.FakeLLM) standing in
for the one engine the H200 call starts. Checks the plumbing the GPU call relies on: every
unit writes its file, rows merge across calls, ``--stop-at`` skips instead of overrunning.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
from vllm_fakes import FAKE_API, FakeGauge, FakeLLM, FakeLLMEngine, FakePinner

from forkserve.bench.multilora import tiny_config
from tests.benchmark_script import load_script


@pytest.fixture(scope="module")
def scripts():
    sbs = load_script("vllm_side_by_side")
    return sbs, load_script("h200_vllm")


def _harness(sbs, tmp_path):
    engine = FakeLLMEngine()
    return sbs.VllmHarness(FakeLLM(engine), FAKE_API, FakePinner(engine), FakeGauge(engine),
                           tiny_config(), tmp_path / "assets", 100, 32)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_three_units_write_their_files_and_merge_the_cuda_rows(scripts, tmp_path):
    sbs, driver = scripts
    cuda, out = tmp_path / "call0", tmp_path / "call2"
    assert driver.main(["cuda-fanout", "--tiny", "--out", str(cuda)]) == 0
    # --skip-tests: on a CPU the GPU test module only skips itself (tests/vllm runs it).
    status = driver.main(["vllm", "--tiny", "--skip-tests", "--out", str(out),
                          "--cuda-rows", str(cuda / "fanout_cuda.json"), "--side-by-side",
                          "--systems", "vllm", "vllm_native", "--workflows", "1", "2",
                          "--turns", "2", "--decode-steps", "2"], harness=_harness(sbs, tmp_path))
    assert status == 0
    assert {p.name for p in out.iterdir()} == {
        "fanout_h200.json", "fanout_h200.png", "vllm_side_by_side.json",
        "vllm_side_by_side.png"}
    fanout = json.loads((out / "fanout_h200.json").read_text())
    assert fanout["errors"] == [] and fanout["skipped"] == []
    rows = {(r["system"], r["distinct_trunks"]): r for r in fanout["rows"]}
    assert set(rows) == {(s, d) for s in ("cuda", "vllm", "vllm_backend") for d in (True, False)}
    for distinct in (True, False):
        # Both Engine rows take the cost model's cascade decisions; plain vLLM prunes nothing.
        assert rows["cuda", distinct]["actions"] == rows["vllm_backend", distinct]["actions"]
        assert rows["cuda", distinct]["computed_tokens"] == rows["cuda", distinct][
            "model_prefill_tokens"]
        assert rows["vllm", distinct]["pruned"] == 0
        assert rows["vllm", distinct]["vllm_peak_blocks"] > 0
    side = json.loads((out / "vllm_side_by_side.json").read_text())
    assert side["errors"] == [] and side["skipped"] == []
    assert {(r["system"], r["workflows"]) for r in side["results"]} == {
        (s, w) for s in ("vllm", "vllm_native") for w in (1, 2)}
    assert [(d["batch"], d["lora"]) for d in side["decode"]] == [
        (1, False), (1, True), (64, False), (64, True)]


def test_past_stop_at_every_run_is_recorded_as_skipped(scripts, tmp_path):
    sbs, _ = scripts
    status = sbs.main(["--tiny", "--systems", "vllm", "vllm_native", "--workflows", "1",
                       "--stop-at", "0", "--out", str(tmp_path)], harness=_harness(sbs, tmp_path))
    assert status == 0
    report = json.loads((tmp_path / "vllm_side_by_side.json").read_text())
    assert report["results"] == [] and report["decode"] == []
    assert [s["why"] for s in report["skipped"]] == ["out of time (--stop-at)"] * 2
