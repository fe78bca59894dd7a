"""Where a synchronous decode step's wall time goes, read from one ``torch.profiler`` trace.

``decode_bench --step-only`` times the backend step from the caller's side: items built,
``launch`` (validation, rows, the input copy, the graph's launch, the sampling queued) and
``result`` (the wait for the tokens and the host's half). ``GpuTimeline`` adds the device's
busy and idle time, but not which host call the device waits on. A profiler trace holds both
clocks on one axis: the caller's phases (``record_function`` marks named ``step.<phase>``),
the CUDA runtime calls the host made (``cudaGraphLaunch``, ``cudaMemcpyAsync``,
``cudaEventSynchronize``) and the device's kernels and copies. ``summarize`` cuts the trace
step by step into the intervals that add up to a step:

- ``before_graph_ms``: the launch phase's start to ``cudaGraphLaunch``'s (validation, rows,
  kept tables, the input buffer's fill and copy),
- ``graph_launch_call_ms``: the host's time inside ``cudaGraphLaunch``,
- ``graph_start_ms``: ``cudaGraphLaunch``'s start to the graph's first kernel on the device,
- ``device_span_ms``: the graph's first kernel to the step's last device work (the tokens'
  copy), ``device_busy_ms`` the time inside that span some kernel or copy ran,
- ``wake_ms``: the step's last device work to the return of the host's wait for it,
- ``after_wake_ms``: that return to the step's end (the host's half of sampling),
- ``idle_ms``: the step's last device work to the next step's first (what the device waits).

Medians over the traced steps; a CPU device has only the phases (no device events).
The profiler slows the host (its own bookkeeping per runtime call): read the intervals
against each other, and the untraced rows for the step's time. Its CUDA tracing also
changes what follows it in the process: a decode graph's ``cudaGraphLaunch``, 0.006-0.027
ms before any trace, took 0.08-0.21 ms in every later call, with the device idle that long
(decode_bench's ``graph_launch`` and ``graph_launch_*_after_trace`` rows, H200, round 19),
and a traced step's kernels start only when the launch returns. So a benchmark traces last,
and reads a traced launch as the profiler's cost, not the step's.
"""
from __future__ import annotations

import gzip
import json
import statistics
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

import torch

PREFIX = "step."
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def mark(phase: str, tracing: bool) -> AbstractContextManager:
    """The caller's phase as a trace annotation while tracing; nothing otherwise."""
    return torch.profiler.record_function(PREFIX + phase) if tracing else nullcontext()


def record(run: Callable[[], None], device: torch.device) -> list[dict]:
    """Run ``run`` under the profiler; the trace's complete events ("X"), in time order."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return sorted((e for e in events if e.get("ph") == "X"), key=lambda e: float(e["ts"]))


def save(events: list[dict], path: Path) -> None:
    """The trace as Perfetto / chrome://tracing read it, gzipped."""
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def _end(e: dict) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def _busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans sorted by start."""
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _steps(events: list[dict]) -> list[dict[str, dict]]:
    """The traced steps: each a mapping phase -> its annotation, in order. A step starts at
    its ``items`` phase."""
    steps: list[dict[str, dict]] = []
    for e in events:
        if e.get("cat") != "user_annotation" or not str(e.get("name", "")).startswith(PREFIX):
            continue
        phase = e["name"][len(PREFIX):]
        if phase == "items" or not steps:
            steps.append({})
        steps[-1][phase] = e
    return steps


def summarize(events: list[dict]) -> dict:
    """Per-step intervals (module docstring), their medians, and the step count."""
    steps = _steps(events)
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    rows = []
    bounds = [float(s["items"]["ts"]) if "items" in s else float(next(iter(s.values()))["ts"])
              for s in steps] + [float("inf")]
    for k, step in enumerate(steps):
        lo, hi = bounds[k], bounds[k + 1]
        row = {f"{p}_ms": float(e.get("dur", 0.0)) / 1e3 for p, e in step.items()}
        end = max(_end(e) for e in step.values())
        calls = [e for e in runtime if lo <= float(e["ts"]) < hi]
        launch = next((e for e in calls if e["name"] == "cudaGraphLaunch"), None)
        work = [e for e in device if lo <= float(e["ts"]) < hi]
        if launch is not None and work and "launch" in step:
            t_launch = float(launch["ts"])
            graph = [e for e in work if float(e["ts"]) >= t_launch and e.get("cat") == "kernel"]
            waits = [e for e in calls if e["name"] == "cudaEventSynchronize"
                     and "result" in step and float(e["ts"]) >= float(step["result"]["ts"])]
            last = max(_end(e) for e in work)
            if graph:
                first = float(graph[0]["ts"])
                tail = sorted((float(e["ts"]), _end(e)) for e in work if float(e["ts"]) >= first)
                row |= {"before_graph_ms": (t_launch - float(step["launch"]["ts"])) / 1e3,
                        "graph_launch_call_ms": float(launch.get("dur", 0.0)) / 1e3,
                        "graph_start_ms": (first - t_launch) / 1e3,
                        "device_span_ms": (last - first) / 1e3,
                        "device_busy_ms": _busy(tail) / 1e3}
            if waits:
                row |= {"wake_ms": (_end(waits[-1]) - last) / 1e3,
                        "after_wake_ms": (end - _end(waits[-1])) / 1e3}
            following = [float(e["ts"]) for e in device if float(e["ts"]) >= hi]
            if following:
                row["idle_ms"] = (min(following) - last) / 1e3
        row["step_ms"] = (end - lo) / 1e3
        rows.append(row)
    keys = sorted({key for row in rows for key in row})
    return {"steps": len(rows),
            "median": {key: statistics.median(v) if (v := [r[key] for r in rows if key in r])
                       else None for key in keys}}
