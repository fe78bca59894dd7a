"""The device call scripts (benchmarks/h200_*.sh) on the CPU: they parse, and the ncu steps
of h200_issue15.sh hand ncu one kernel regex and their options as words (a fake ncu on the
PATH records its arguments)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("h200_*.sh")))
def test_the_script_parses(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(BENCH / script)]).returncode == 0


def test_ncu_steps_call_ncu_once_a_launch(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@"\necho "x: 0.2 ms (graph replay)"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    script = BENCH / "h200_issue15.sh"
    # The function alone: the script's steps need the GPU machine's FA4 parts.
    body = subprocess.run(["sed", "-n", "/^ncu_prefill_runs() {/,/^}/p", str(script)],
                          capture_output=True, text=True, check=True).stdout
    assert body.startswith("ncu_prefill_runs() {")
    env = dict(os.environ, OUT=str(out), PATH=f"{fake.parent}:{os.environ['PATH']}")
    run = subprocess.run(["bash", "-c", body + "\nncu_prefill_runs pre --page source --csv2"],
                         env=env, capture_output=True, text=True, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("graph replay") == 3
    args = {p.stem: p.read_text().splitlines() for p in out.glob("pre_*.csv")}
    assert sorted(args) == ["pre_fa4", "pre_ws", "pre_ws_no_adapter"]
    assert "regex:[Ff]lash|[Ff]wd" in args["pre_fa4"]
    assert args["pre_ws_no_adapter"][:-1] == [
        "--clock-control", "none", "--kernel-name", "regex:_residual_prefill_(ws|wide)_kernel",
        "--launch-skip", "2", "--launch-count", "1", "--page", "source", "--csv2", "--csv",
        "python3", "benchmarks/ws_prefill_profile.py", "--route", "ws", "--no-adapter"]
    # $LAUNCH: a named launch (the 128-key kernel's) in both ws runs.
    env["LAUNCH"] = "wide_m128_r200_c16_bf16"
    run = subprocess.run(["bash", "-c", body + "\nncu_prefill_runs named --page raw"],
                         env=env, capture_output=True, text=True, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr
    for name in ("named_ws", "named_ws_no_adapter"):
        words = (out / f"{name}.csv").read_text().splitlines()
        assert words[-3:-1] == ["--launch", "wide_m128_r200_c16_bf16"], words
