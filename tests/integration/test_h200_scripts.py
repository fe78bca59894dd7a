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


def _run_step(tmp_path: Path, step: str, **env: str) -> list[list[str]]:
    """``h200_issue15.sh <step>`` with python3 and nvidia-smi faked on the PATH: the argument
    words of each python3 call."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(parents=True)
    out.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "python3").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" ---- >> {calls}\n')
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho fake\n")
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
    run = subprocess.run(["bash", str(BENCH / "h200_issue15.sh"), step], cwd=BENCH.parent,
                         env={**os.environ, "OUT": str(out), "K": "", "SKIP": "", "TAG": "",
                              "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return [c.splitlines() for c in calls.read_text().split("----\n") if c]


def test_the_cuda_tests_run_over_xdist_workers_each_test_timed(tmp_path: Path) -> None:
    """Step 75's second run and the suite hand pytest the workers and the per-test limit as
    words (JOBS, PER_TEST); step 75's first, short case stays in one process, where -v names
    a hung launch as it starts."""
    first, rest = _run_step(tmp_path, "75", JOBS="3", PER_TEST="9")
    assert "-n" not in first and "--timeout" not in first
    for words in (rest, *_run_step(tmp_path / "suite", "suite", JOBS="3", PER_TEST="9",
                                   IGNORE="tests/kernels/x.py")):
        i = words.index("-n")
        assert words[i:i + 5] == ["-n", "3", "--timeout", "9", "--timeout-method=thread"]
    assert "--ignore=tests/kernels/x.py" in words and words[-1] == "tests/cascade"


def test_the_prefill_bench_step_builds_its_kernels_in_workers_first(tmp_path: Path) -> None:
    (bench,) = _run_step(tmp_path, "76", JOBS="5", SKIP="wide_m64_r232_c64_bf16_ta")
    i = bench.index("--warm-jobs")
    assert bench[i + 1] == "5" and bench[-3:] == ["wide_m64_r232_c64_bf16_ta", "--out",
                                                  str(tmp_path / "out")]
    assert "--group" not in bench
    (bench,) = _run_step(tmp_path / "g8", "76", GROUP="8")  # GQA 8's measure
    assert bench[bench.index("--group") + 1] == "8"


def test_the_default_route_step_names_tests_that_exist(tmp_path: Path) -> None:
    """Step 77 names test files and functions; a rename would leave the call collecting
    nothing (pytest: exit 4) and the machine's minutes spent."""
    (words,) = _run_step(tmp_path, "77", JOBS="3")
    targets = [w for w in words if w.startswith("tests/")]
    assert len(targets) == 7 and "-n" in words
    root = BENCH.parent
    for target in targets:
        path, _, func = target.partition("::")
        assert (root / path).is_file(), path
        assert not func or f"def {func}(" in (root / path).read_text(), target
