"""benchmarks/adaptive_policy_bench.py on a short context: the systems asked for, the split
waves given reaching the adaptive layout, the tagged JSON and PNG written; a run without a
'vs best' reference refused."""
from __future__ import annotations

import json

import pytest

from tests.benchmark_script import load_script


def test_bench_runs_the_systems_and_split_waves_asked_for(tmp_path, monkeypatch):
    bench = load_script("adaptive_policy_bench")
    seen = []  # each engine's policy's split waves, as the layout reads them
    init = bench.FormCounter.__init__

    def spy(self, backend, *args):
        init(self, backend, *args)
        seen.append(getattr(self.kv.policy, "split_waves", None))

    monkeypatch.setattr(bench.FormCounter, "__init__", spy)
    assert bench.main(["--workloads", "react", "--workflows", "1", "--context", "512",
                       "--systems", "unified", "adaptive", "--split-waves", "3",
                       "--tag", "t", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "adaptive_policy_cpu_t.json").read_text())
    assert res["adaptive_split_waves"] == 3.0
    assert seen == [None, 3.0]  # unified has a fixed form, adaptive the pressure policy
    assert [r["system"] for r in res["rows"]] == ["unified", "adaptive"]
    assert all(r["modeled_tasks_per_s"] > 0 for r in res["rows"])
    assert res["rows"][0]["vs_better"] == 1.0
    assert (tmp_path / "adaptive_policy_cpu_t.png").stat().st_size > 0


def test_bench_refuses_systems_without_a_reference(tmp_path):
    bench = load_script("adaptive_policy_bench")
    with pytest.raises(SystemExit) as refused:
        bench.main(["--systems", "adaptive", "--out", str(tmp_path)])
    assert refused.value.code == 2
