"""benchmarks/sharing_tradeoff.py joins quality reports and multi-LoRA bench results by mode
(small synthetic inputs): the right rows meet, a missing figure says "not measured", and a
name the mapping does not know, or a file that is not there, is one line."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import sharing_tradeoff as st


def quality_row(layout: str, mean: float, low: float, high: float, n: int = 120,
                kv: float = 1 / 3) -> dict:
    interval = {"mean": mean, "low": low, "high": high, "n": n, "clusters": n // 3}
    return {"layout": layout, "available": True, "rounds": n // 3, "reference": "unified",
            "kv_vs_unified": kv, "paired": {"delta_f1": interval}}


def bench_row(system: str, w: int, tasks: float, kv: float, commit: str = "c0ffee1",
              **extra) -> dict:
    return {"system": system, "workflows": w, "tasks_per_s": tasks,
            "context_kv_per_agent_bytes": kv, "cascade": True, "overlap": False,
            "commit": commit, **extra}


def bench_doc(workload: str, rows: list[dict]) -> dict:
    return {"workload": f"{workload}-multilora", "driver": "lockstep",
            "model": "llama3-8b-shape", "device": "cuda", "context": 8192, "turns": 3,
            "gen": 64, "kv_budget_gib": 24.0, "residual_share": 0.1, "results": rows}


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, list[Path]]:
    quality = write(tmp_path / "quality_x.json", {"summaries": [
        {"layout": "unified", "available": True, "rounds": 40, "reference": "unified",
         "kv_vs_unified": 1.0, "paired": None},
        quality_row("disaggregated", -0.033, -0.069, 0.002),
        quality_row("neutral", -0.107, -0.148, -0.068, n=160),
        quality_row("recompute2", -0.004, -0.029, 0.021, kv=0.8),
        {"layout": "recompute5", "available": False, "note": "needs --drift"}]})
    older = write(tmp_path / "react_a.json", bench_doc("react", [
        bench_row("unified", 8, 1.0, 100.0),
        bench_row("disaggregated", 8, 0.5, 10.0)]))  # replaced by the later file's
    newer = write(tmp_path / "react_b.json", bench_doc("react", [
        bench_row("disaggregated", 8, 0.9, 10.0),
        bench_row("adaptive", 8, 0.8, 80.0), bench_row("full_reuse", 8, 5.0, 5.0),
        bench_row("recompute2", 8, 0.7, 60.0, recompute_layers=[0, 1]),
        bench_row("no_lora", 8, 6.0, 5.0, step_profile={"ticks": 5}),  # profiled: left out
        # Kernels built inside the timed run (Triton, FlashAttention-4): left out too.
        bench_row("unified", 8, 2.0, 100.0, fa4_compiled_in_run=1),
        bench_row("unified", 8, 3.0, 100.0, kernels_built_in_run=2),
        bench_row("unified", 4, 1.0, 100.0), bench_row("disaggregated", 4, 2.0, 10.0)]))
    return quality, [older, newer]


def test_rows_meet_by_mode_and_missing_speed_is_not_measured(inputs):
    quality_path, speed_paths = inputs
    speed = st.load_speed(speed_paths)
    [column] = st.default_columns(speed)  # W=4 has one system besides unified: no column
    assert column.workflows == 8 and column.workload == "react"
    t = st.join([st.load_quality(f"M={quality_path}")], speed, [column])
    rows = {(r.mode, r.system): r for r in t.rows}
    label = column.label()
    split = rows["disaggregated", "disaggregated"]
    assert split.quality["M"].delta_f1 == pytest.approx(-3.3)
    assert (split.quality["M"].low, split.quality["M"].readers) == (pytest.approx(-6.9), 120)
    # The later file's row of the same setting and system wins (the commits are unknown to git).
    assert split.speed[label].vs_unified == pytest.approx(0.9)
    assert split.speed[label].context_kv_vs_unified == pytest.approx(0.1)
    # Adaptive runs as disaggregated: its own row under the same quality figures.
    assert rows["disaggregated", "adaptive"].quality["M"] == split.quality["M"]
    assert rows["disaggregated", "adaptive"].speed[label].vs_unified == pytest.approx(0.8)
    assert rows["recompute2", "recompute2"].speed[label].vs_unified == pytest.approx(0.7)
    # Systems the bench has but did not measure here, and modes it has no system for.
    assert rows["neutral", "neutral"].speed[label] == st.NOT_MEASURED
    assert rows["full_reuse", "full_reuse"].quality["M"] == st.NOT_MEASURED  # speed only
    assert ("no_lora", "no_lora") not in rows  # its one row was profiled, and no quality
    assert rows["recompute5", "recompute5"].quality["M"].startswith("not available")
    assert list(rows)[:2] == [("unified", "unified"), ("disaggregated", "disaggregated")]


def test_the_command_writes_table_json_and_png(inputs, tmp_path, capsys):
    quality_path, speed_paths = inputs
    out = tmp_path / "out"
    assert st.main(["--quality", f"M={quality_path}", "--speed", *map(str, speed_paths),
                    "--out", str(out)]) == 0
    table = (out / "sharing_tradeoff.md").read_text()
    assert "| neutral | neutral | -10.7 [-14.8, -6.8] (160 readers) | 0.33 | not measured |" \
        in table
    assert "| disaggregated | adaptive |" in table and "0.90x (0.10x)" in table
    saved = json.loads((out / "sharing_tradeoff.json").read_text())
    assert {r["mode"] for r in saved["rows"]} >= {"unified", "disaggregated", "neutral"}
    assert (out / "sharing_tradeoff.png").stat().st_size > 0
    assert f"wrote {out / 'sharing_tradeoff.png'}" in capsys.readouterr().out


@pytest.mark.parametrize("broken,message", [
    ("quality_missing", "quality report .*missing.json does not exist"),
    ("speed_missing", "bench result .*missing.json does not exist"),
    ("quality_mode", "unknown mode 'fastest'"),
    ("speed_system", "unknown system 'fastest'"),
])
def test_an_unusable_input_is_one_line(inputs, tmp_path, capsys, broken, message):
    quality_path, speed_paths = inputs
    if broken == "quality_missing":
        quality_path = tmp_path / "missing.json"
    elif broken == "speed_missing":
        speed_paths = [tmp_path / "missing.json"]
    elif broken == "quality_mode":
        write(quality_path, {"summaries": [quality_row("fastest", 0.0, 0.0, 0.0)]})
    else:
        write(speed_paths[0], bench_doc("react", [bench_row("fastest", 8, 1.0, 1.0)]))
    assert st.main(["--quality", str(quality_path), "--speed", *map(str, speed_paths),
                    "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sharing_tradeoff: error: ")
    assert re.search(message, err)
