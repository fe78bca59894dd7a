"""benchmarks/issue15_goals.py: a row per issue-15 goal from the result JSONs (small synthetic
folders, then the committed one): the newest commit's figure wins, a goal no file holds says
"not measured", met and missed are against the goal, and an unusable input is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import issue15_goals as goals
from benchmarks.sharing_tradeoff import RESULTS, commit_time

NEWEST, NEWER, OLDER = "4f7eedd", "8fb454c", "a1f081c"  # commits in this repo's history


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def react_row(system: str, w: int, tasks: float, overlap: bool = False) -> dict:
    return {"system": system, "workflows": w, "tasks_per_s": tasks, "cascade": True,
            "overlap": overlap, "commit": NEWER}


@pytest.fixture
def folder(tmp_path) -> Path:
    assert commit_time(NEWEST) > commit_time(NEWER) > commit_time(OLDER) > 0, \
        "needs the repository's history"
    # The newer commit sits in the file that sorts first: file order alone would pick the other.
    write(tmp_path / "kernel_bench_a.json", {"commit": NEWER, "decode_variants": [
        {"ctx": 8192, "batch": 8, "unified_ms": 1.0, "v1_ratio": 1.5, "v2_ratio": 1.4},
        {"ctx": 2048, "batch": 8, "unified_ms": 1.0, "v1_ratio": 9.0},  # below 4K: left out
        # Where the default variant ran, its ratio is the point's, however far below another's.
        {"ctx": 4096, "batch": 1, "unified_ms": 1.0, "v1_ratio": 1.0,
         "two_pass_default_ratio": 1.2},
        # Since round 20 "default" (the policy's pick) is the default's name, before
        # two_pass_default: 1.25, not 1.1.
        {"ctx": 8192, "batch": 1, "unified_ms": 1.0, "two_pass_default_ratio": 1.1,
         "default_ratio": 1.25}]})
    # The newest of all, but at another shape (GQA 8): never the goals' figure.
    write(tmp_path / "kernel_bench_gqa8.json", {
        "commit": NEWEST, "shape": {"n_heads": 64, "n_kv": 8, "head_dim": 128, "rank": 16},
        "decode_variants": [{"ctx": 8192, "batch": 8, "unified_ms": 1.0, "default_ratio": 1.0},
                            {"ctx": 8192, "batch": 1, "unified_ms": 1.0,
                             "default_ratio": 1.0}]})
    write(tmp_path / "kernel_bench_b.json", {"commit": OLDER, "decode_variants": [
        {"ctx": 8192, "batch": 8, "unified_ms": 1.0, "v1_ratio": 1.1},
        {"ctx": 4096, "batch": 1, "unified_ms": 1.0, "v1_ratio": 2.0}]})
    write(tmp_path / "decode_bench_x.json", {  # no commit, no batch 64
        "decode_b1": {"batch": 1, "ms_per_step": 4.5},
        "prefill_lora": {"tokens": 8192, "tokens_per_s": 36000.0},
        "engine_decode": [  # overlap off and LoRA rows are not the goal's
            {"batch": 1, "lora": False, "overlap": False, "ms_per_step": 4.0},
            {"batch": 1, "lora": False, "overlap": True, "ms_per_step": 5.0},
            {"batch": 1, "lora": True, "overlap": True, "ms_per_step": 3.0}]})
    # A baseline run (cuBLAS beside the skinny GEMM) is never the goal's figure, however new.
    write(tmp_path / "decode_bench_y.json", {"commit": NEWEST, "baseline": "cublas",
                                             "decode_b64": {"batch": 64, "ms_per_step": 6.0}})
    rows = [react_row("no_lora", 32, 10.0), react_row("no_lora", 32, 11.0, overlap=True)]
    for w, (u, d, a) in {1: (0.5, 0.4, 0.45), 8: (1.6, 1.5, 1.6), 32: (1.8, 2.0, 2.0)}.items():
        rows += [react_row("unified", w, u), react_row("disaggregated", w, d),
                 react_row("adaptive", w, a)]
    write(tmp_path / "react_multilora_t.json", {
        "workload": "react-multilora", "driver": "lockstep", "model": "llama3-8b-shape",
        "device": "cuda", "context": 8192, "turns": 3, "gen": 64, "kv_budget_gib": 24.0,
        "residual_share": 0.1, "commit": NEWER, "results": rows})
    return tmp_path


def test_rows_from_a_synthetic_folder(folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert goals.main(["--results", str(folder), "--out", str(out)]) == 0
    saved = {g["number"]: g for g in json.loads((out / "issue15_goals.json").read_text())["goals"]}
    assert list(saved) == [g.number for g in goals.GOALS]
    # Newest commit wins (1.4 from the newer file, not 1.1), its best variant where the
    # default did not run; missed.
    assert saved["1"]["value"] == pytest.approx(1.4) and saved["1"]["status"] == "missed"
    assert saved["1"]["source"] == "kernel_bench_a.json" and saved["1"]["commit"] == NEWER
    assert saved["1"]["ratio_to_goal"] == pytest.approx(1.4 / 1.15)
    assert saved["2"]["value"] == pytest.approx(1.25) and saved["2"]["status"] == "met"
    assert "(default)" in saved["2"]["detail"]
    assert saved["10c"]["value"] == pytest.approx(5.0) and saved["10c"]["status"] == "missed"
    for n in ("3", "4", "7", "10b", "10d"):  # no file holds them
        assert saved[n]["status"] == "not measured" and saved[n]["value"] is None
    assert saved["5"]["status"] == "met" and saved["10a"]["status"] == "met"
    assert saved["10a"]["commit"] == "unknown"
    assert saved["6"]["value"] == pytest.approx(11.0) and "overlap on" in saved["6"]["detail"]
    assert saved["8"]["value"] == pytest.approx(2.0 / 1.8) and saved["8"]["status"] == "missed"
    assert saved["9"]["value"] == pytest.approx(0.45 / 0.5) and "W=1" in saved["9"]["detail"]
    # A newer file that reruns one W alone replaces that W's ratio only.
    write(folder / "react_multilora_u.json", {**json.loads(
        (folder / "react_multilora_t.json").read_text()), "results": [
        {**react_row(s, 1, t), "commit": NEWEST} for s, t in
        (("unified", 0.5), ("disaggregated", 0.4), ("adaptive", 0.52))]})
    assert goals.main(["--results", str(folder), "--out", str(out)]) == 0
    saved = {g["number"]: g for g in json.loads((out / "issue15_goals.json").read_text())["goals"]}
    assert saved["9"]["value"] == pytest.approx(1.0) and "worst W=8" in saved["9"]["detail"]
    assert "1: 1.040 (react_multilora_u.json" in saved["9"]["detail"]
    # A still newer run of every W on another card is left out: the goals are the H200's.
    write(folder / "react_multilora_v.json", {**json.loads(
        (folder / "react_multilora_t.json").read_text()), "gpu": "NVIDIA H100 80GB HBM3",
        "results": [{**react_row(s, w, 3.0), "commit": NEWEST} for w in (1, 8, 32)
                    for s in ("unified", "disaggregated", "adaptive", "no_lora")]})
    assert goals.main(["--results", str(folder), "--out", str(out)]) == 0
    saved = {g["number"]: g for g in json.loads((out / "issue15_goals.json").read_text())["goals"]}
    assert saved["9"]["value"] == pytest.approx(1.0) and "react_multilora_v" not in str(saved)
    assert saved["6"]["value"] == pytest.approx(11.0)
    # --card H100 reads that card's runs beside the issue's (its own files, its name in them),
    # and leaves out a file that names the H200.
    (folder / "react_multilora_t.json").write_text(json.dumps({**json.loads(
        (folder / "react_multilora_t.json").read_text()), "gpu": "NVIDIA H200"}))
    assert goals.main(["--results", str(folder), "--out", str(out), "--card", "H100"]) == 0
    h100 = {g["number"]: g for g in
            json.loads((out / "issue15_goals_h100.json").read_text())["goals"]}
    assert h100["9"]["value"] == pytest.approx(1.0) and h100["6"]["value"] == pytest.approx(3.0)
    assert "react_multilora_v.json" in h100["8"]["source"]
    assert "react_multilora_t" not in str(h100)
    assert (out / "issue15_goals_h100.png").stat().st_size > 0
    table = (out / "issue15_goals.md").read_text()
    assert "would be in kernel_bench_prefill.json" in table and "| unknown |" in table
    assert (out / "issue15_goals.png").stat().st_size > 0
    assert f"wrote {out / 'issue15_goals.png'}" in capsys.readouterr().out


def test_rounds_are_paired_round_by_round(folder, tmp_path):
    """A --rounds file: rows 8 and 9 are the median of the rounds' ratios, each round's
    systems against each other (the card's drift through the run cancels within a round),
    not the ratio of the rows' medians; a failed round (None) pairs nothing."""
    by_round = {"unified": [2.4, 2.5, 2.0], "disaggregated": [2.7, 2.6, None],
                "adaptive": [2.5, 2.7, 2.2]}
    write(folder / "react_multilora_r.json", {**json.loads(
        (folder / "react_multilora_t.json").read_text()), "gpu": "NVIDIA H200",
        "results": [{**react_row(s, 32, min(x for x in t if x)), "commit": NEWEST,
                     "round_tasks_per_s": t} for s, t in by_round.items()]})
    out = tmp_path / "out"
    assert goals.main(["--results", str(folder), "--out", str(out)]) == 0
    saved = {g["number"]: g for g in json.loads((out / "issue15_goals.json").read_text())["goals"]}
    assert saved["8"]["value"] == pytest.approx((2.7 / 2.4 + 2.6 / 2.5) / 2)
    assert "median of 2 rounds, each paired: 1.125, 1.040" in saved["8"]["detail"]
    # (2.5 / 2.7 + 2.7 / 2.6) / 2 at W = 32; W = 1's 0.9 stays the worst.
    assert "32: 0.982 (react_multilora_r.json" in saved["9"]["detail"]
    assert "median of 2 rounds, each paired: 0.926, 1.038" in saved["9"]["detail"]


def test_row_3_from_the_residual_routes_bench(folder, tmp_path):
    """residual_prefill_bench's rows: the route the policy takes (recorded, or asked again
    for a row written before the bench recorded it), by device time where a graph held it,
    eagerly where not; cold prompts left out (the engine's FRESH, kernel_bench's rows)."""
    write(folder / "residual_prefill_x.json", {"commit": NEWER, "rows": [
        {"batch": 8, "new": 64, "keys": 8256, "policy_route": "ws",
         "device_over_best_unified": {"residual_ws": 2.0, "residual_fused": 4.0},
         "over_baseline": {"ws": 1.5, "flash": 1.2}},
        {"batch": 8, "new": 512, "keys": 8704, "policy_route": "flash",
         "device_over_best_unified": {"residual_ws": 2.5}, "over_baseline": {"flash": 1.1}},
        {"batch": 1, "new": 4096, "keys": 4096, "policy_route": "ws",
         "device_over_best_unified": {"residual_ws": 3.0}},
        {"batch": 4, "new": 64, "keys": 32832, "flash_kernel": "fa4", "residual": {"ws": 0.5},
         "device_over_best_unified": {"residual_ws": 1.2}}]})
    # The newest, but at another GQA group (``--group 8``): never the row's either.
    write(folder / "residual_prefill_gqa8.json", {
        "commit": NEWEST, "shape": {"n_heads": 64, "n_kv": 8, "head_dim": 128, "rank": 16},
        "rows": [{"batch": 8, "new": 64, "keys": 8256, "policy_route": "ws",
                  "device_over_best_unified": {"residual_ws": 1.05}}]})
    # A reverted kernel's run is kept under reverted/: never the row's, however new.
    (folder / "reverted").mkdir()
    write(folder / "reverted" / "residual_prefill_lost.json", {"commit": NEWEST, "rows": [
        {"batch": 8, "new": 64, "keys": 8256, "policy_route": "ws",
         "device_over_best_unified": {"residual_ws": 1.1}}]})
    out = tmp_path / "out"
    assert goals.main(["--results", str(folder), "--out", str(out)]) == 0
    saved = {g["number"]: g for g in json.loads((out / "issue15_goals.json").read_text())["goals"]}
    assert saved["3"]["value"] == pytest.approx(2.0) and saved["3"]["status"] == "missed"
    assert saved["3"]["detail"] == ("worst of 3 points: 8 x 64 over ctx 8192 "
                                    "(the policy's route ws, device time)")
    # A run that timed the launch the kernel takes by default now: its column, not ``ws``
    # (the default of the run's own commit); a run on another card than the H200 says so.
    from forkserve.kernels.residual_prefill_gluon import default_launch
    default = default_launch(64).name
    write(folder / "residual_prefill_x.json", {
        "commit": NEWER, "device": "NVIDIA H100 80GB HBM3", "rows": [
            {"batch": 8, "new": 64, "keys": 8256, "policy_route": "ws",
             "device_over_best_unified": {"residual_ws": 2.0, f"residual_{default}": 1.8,
                                          "residual_ws_m128_s3": 1.9}}]})
    assert goals.main(["--results", str(folder), "--out", str(out)]) == 0
    saved = {g["number"]: g for g in json.loads((out / "issue15_goals.json").read_text())["goals"]}
    assert saved["3"]["value"] == pytest.approx(1.8)
    assert saved["3"]["detail"].endswith(f"(the policy's route ws, device time of {default}; "
                                         "on an NVIDIA H100 80GB HBM3)")
    assert goals.policy_route({"batch": 4, "new": 64, "keys": 32832, "flash_kernel": "fa4",
                               "residual": {"ws": 0.5}}) == "ws"
    assert goals.policy_route({"batch": 4, "new": 64, "keys": 32832, "flash_kernel": "fa4",
                               "residual": {"fused": 0.5}}) == "fused"


@pytest.mark.parametrize("broken", ["missing_folder", "not_json", "not_a_bench"])
def test_an_unusable_input_is_one_line(folder, tmp_path, capsys, broken):
    results = folder
    if broken == "missing_folder":
        results = tmp_path / "nowhere"
    elif broken == "not_json":
        (folder / "decode_bench_x.json").write_text("{not json")
    else:
        write(folder / "react_multilora_t.json", {"workload": "react-multilora"})
    assert goals.main(["--results", str(results), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("issue15_goals: error: ")


def test_the_committed_results(tmp_path):
    assert goals.main(["--out", str(tmp_path)]) == 0
    saved = {g["number"]: g for g in json.loads((tmp_path / "issue15_goals.json").read_text())
             ["goals"]}
    assert all(g["status"] != "not measured" for g in saved.values()), RESULTS
    # The committed table is the one the committed results give (regenerated with them).
    committed = {g["number"]: g for g in json.loads(
        (RESULTS / "issue15_goals.json").read_text())["goals"]}
    assert committed == saved
