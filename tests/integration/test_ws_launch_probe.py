"""benchmarks/ws_launch_probe.py's case runner: how a child process ended (its JSON line, a
timeout, a non-zero exit with its last stderr line). The probe's CUDA side runs on the H200."""
from __future__ import annotations

import sys

from tests.benchmark_script import load_script

probe = load_script("ws_launch_probe")


def test_a_case_that_finishes_hangs_or_faults() -> None:
    py = [sys.executable, "-c"]
    assert probe.run_case(py + ['print("noise"); print(\'{"seconds": 1.5}\')'], 20) == {
        "status": "ok", "seconds": 1.5}
    assert probe.run_case(py + ["import time; time.sleep(30)"], 1) == {"status": "hang"}
    assert probe.run_case(py + ["import sys; sys.exit('unspecified launch failure')"], 20) == {
        "status": "fault", "error": "unspecified launch failure"}
