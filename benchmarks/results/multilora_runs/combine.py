"""Assemble benchmarks/results/{react,mapreduce}_multilora.json (+ .png) from this session's H200
calls (the raw JSON of each call sits beside this file). Run from the repository root."""
import json
from pathlib import Path

from forkserve.bench.multilora import RunResult, format_table, plot

runs = Path("benchmarks/results/multilora_runs")
calls = {
    "call1": "3d23172 (session start: a backend per W, 256-token warm-up)",
    "call2": "01aad28 (adaptive system, backend per system, graphs captured ahead)",
    "call3": "1a9c98f (merged residual prefill v1, W=1 median of 3)",
    "call4": "264bfab (merged residual prefill per adapter; adaptive high-water 0.5)",
    "call5": "20d51fa (final: residual prefill auto, adaptive high-water 0.9)",
}
def rows(name):
    d = json.loads((runs / name).read_text())
    return {(r["system"], r["workflows"]): r for r in d["results"]}
react_pick = {
    1: {"unified": "call3_w1_react_multilora.json", "adaptive": "call3_w1_react_multilora.json",
        "disaggregated": "call2_react_multilora.json",
        "disaggregated_base": "call2_react_multilora.json",
        "full_reuse": "call1_react_multilora.json", "no_lora": "call1_react_multilora.json"},
    8: {"unified": "call3_react_multilora.json",
        "disaggregated": "call5_react3_react_multilora.json",
        "disaggregated_base": "call3_react_multilora.json",
        "adaptive": "call5_react3_react_multilora.json",
        "full_reuse": "call3_react_multilora.json", "no_lora": "call3_react_multilora.json"},
}
react_pick[32] = dict(react_pick[8])
out = []
for w, picks in react_pick.items():
    for system, f in picks.items():
        r = dict(rows(f)[(system, w)])
        call = f.split("_")[0]
        r.setdefault("notes", []).append(f"H200 {call}: commit {calls[call]}")
        for k in ("context_kv_per_agent_bytes", "prefill_tick_s", "decode_tick_s"):
            r.setdefault(k, None)
        out.append(r)
def save(stem, results, src):
    base = json.loads((runs / src).read_text())
    base["results"], base["errors"] = results, []
    base["calls"] = calls
    base["anchors_vllm_0_26_tasks_per_s"] = {"lora": {"1": 0.455, "8": 1.529, "32": 0.842},
                                             "no_lora": {"1": 0.654, "8": 4.183, "32": 10.269}}
    Path(f"benchmarks/results/{stem}.json").write_text(json.dumps(base, indent=2))
    objs = [RunResult(**{k: (v if v is not None else 0.0) for k, v in r.items()}) for r in results]
    plot(objs, Path(f"benchmarks/results/{stem}.png"), stem.split("_")[0])
    print(format_table(objs, stem))
save("react_multilora", out, "call3_react_multilora.json")
mr = []
for r in json.loads((runs / "call4_mapreduce_multilora.json").read_text())["results"]:
    r = dict(r)
    r["notes"].append(f"H200 call4: commit {calls['call4']}")
    mr.append(r)
save("mapreduce_multilora", mr, "call4_mapreduce_multilora.json")
