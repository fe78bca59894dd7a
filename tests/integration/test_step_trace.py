"""benchmarks/step_trace.py: a profiler trace cut into a synchronous step's intervals."""
from __future__ import annotations

import pytest

from tests.benchmark_script import load_script


def _x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def _step(t: float) -> list[dict]:
    """One step from ``t`` (us): items 10, launch 40 (the graph launched at +30 for 15), two
    kernels with a gap, the tokens' copy, a wait that returns 3 us after it, 5 us of host."""
    return [_x("step.items", "user_annotation", t, 10),
            _x("step.launch", "user_annotation", t + 10, 40),
            _x("cudaGraphLaunch", "cuda_runtime", t + 30, 15),
            _x("step.result", "user_annotation", t + 50, 108),
            _x("cudaEventSynchronize", "cuda_runtime", t + 55, 100),
            _x("gemm", "kernel", t + 40, 60),
            _x("attn", "kernel", t + 110, 40),
            _x("Memcpy DtoH", "gpu_memcpy", t + 150, 2)]


def test_intervals_of_each_step() -> None:
    st = load_script("step_trace")
    events = sorted(_step(0.0) + _step(200.0) + _step(400.0), key=lambda e: e["ts"])
    res = st.summarize(events)
    assert res["steps"] == 3
    m = res["median"]
    assert m["items_ms"] == pytest.approx(0.010)
    assert m["before_graph_ms"] == pytest.approx(0.020)
    assert m["graph_launch_call_ms"] == pytest.approx(0.015)
    assert m["graph_start_ms"] == pytest.approx(0.010)
    assert m["device_span_ms"] == pytest.approx(0.112)     # 40 .. 152
    assert m["device_busy_ms"] == pytest.approx(0.102)     # less the 10 us gap
    assert m["wake_ms"] == pytest.approx(0.003)            # 152 .. 155
    assert m["after_wake_ms"] == pytest.approx(0.003)      # 155 .. 158
    assert m["idle_ms"] == pytest.approx(0.088)            # 152 .. next step's 240
    assert m["step_ms"] == pytest.approx(0.158)


def test_a_trace_without_device_events_keeps_the_phases() -> None:
    st = load_script("step_trace")
    events = [e for e in _step(0.0) if e["cat"] == "user_annotation"]
    m = st.summarize(events)["median"]
    assert set(m) == {"items_ms", "launch_ms", "result_ms", "step_ms"}
