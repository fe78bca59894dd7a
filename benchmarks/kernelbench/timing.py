"""How the kernel bench times a call: CUDA-graph replay or eager, L2 flushed, CUDA events;
a failing call is NaN with its error recorded, so one case keeps the rest."""
from __future__ import annotations

import math
import time
from typing import Callable

import torch


def bench(fn: Callable[[], object], smoke: bool) -> float:
    """Median milliseconds of ``fn`` on the GPU.

    ``fn`` is captured in a CUDA graph (after a warm-up call that compiles it), so Python
    and launch overhead stay out of the numbers; L2 is flushed (a 256 MiB write) before
    each timed replay, so a small cache is not measured from L2. Timed with CUDA events.
    """
    if smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    graph = captured(fn)
    ms = timed_median(graph.replay, most=100)
    del graph
    return ms


def captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` in a CUDA graph, after a warm-up call (compiles) and one on a side stream."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timed_interleaved(runs: dict[str, Callable[[], object]], rounds: int = 30) -> dict[str, float]:
    """Median ms of each of ``runs`` by CUDA-graph replay, the graphs replayed in turn
    (A, B, C, A, B, C, ...) so a drift of the clock or the board's temperature over the
    measurement falls on every column alike: for ratios near 1. L2 flushed before each."""
    return replayed_in_turn({name: captured(fn) for name, fn in runs.items()}, rounds)


def replayed_in_turn(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int) -> dict[str, float]:
    """``timed_interleaved`` over graphs already captured."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    pairs: dict[str, list] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            pairs[name].append((start, end))
    torch.cuda.synchronize()
    out = {}
    for name, events in pairs.items():
        times = sorted(a.elapsed_time(b) for a, b in events)
        out[name] = times[len(times) // 2]
    return out


def timed_median(run: Callable[[], object], most: int) -> float:
    """Median ms of ``run()`` by CUDA events, L2 flushed (a 256 MiB write) before each call;
    ~200 ms worth of calls, 5 to ``most`` of them."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def timed(n: int) -> list[float]:
        pairs = []
        for _ in range(n):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in pairs]

    first = sorted(timed(3))[1]
    times = sorted(timed(int(min(most, max(5, 200.0 / max(first, 1e-3))))))
    return times[len(times) // 2]


def measure(res: dict, what: str, fn: Callable[[], object], smoke: bool,
            timer: Callable[[Callable[[], object], bool], float] | None = None) -> float:
    """``timer(fn)`` (``bench``: CUDA-graph replays; ``bench_eager`` for what the engine runs
    eagerly), or NaN with the error recorded, so one failing case keeps the rest."""
    try:
        return (timer or bench)(fn, smoke)
    except Exception as exc:
        res.setdefault("errors", []).append(f"{what}: {exc!r}"[:600])
        print(f"ERROR {what}: {exc!r}"[:300], flush=True)
        return math.nan


def measure_interleaved(res: dict, what: str, runs: dict[str, Callable[[], object]],
                        smoke: bool, rounds: int = 30) -> dict[str, float]:
    """Each of ``runs`` timed as ``timed_interleaved`` does (graphs replayed in turn, so no
    column pays for the clock or temperature it met by its place in the order), after one
    call each: a run that fails there, or whose capture fails, is NaN with its error
    recorded, the rest still timed. In smoke mode, ``bench`` each (no GPU to replay on)."""
    out, ready = {}, {}
    for name, fn in runs.items():
        if runs_once(res, f"{what} {name}", fn):
            ready[name] = fn
        else:
            out[name] = math.nan
    if smoke:
        return out | {name: bench(fn, smoke) for name, fn in ready.items()}
    graphs = {}
    for name, fn in ready.items():
        try:
            graphs[name] = captured(fn)
        except Exception as exc:  # this column alone: its eager call ran, its capture did not
            res.setdefault("errors", []).append(f"{what} {name} capture: {exc!r}"[:600])
            out[name] = math.nan
    return out | replayed_in_turn(graphs, rounds)


def runs_once(res: dict, what: str, fn: Callable[[], object]) -> bool:
    """Whether ``fn()`` returns; where it raises, its error recorded (``check``)."""
    return not math.isnan(check(res, what, lambda: (fn(), 0.0)[1]))


def check(res: dict, what: str, fn: Callable[[], float]) -> float:
    """An accuracy figure, or NaN with the error recorded."""
    try:
        return fn()
    except Exception as exc:
        res.setdefault("errors", []).append(f"{what}: {exc!r}"[:600])
        return math.nan


def bench_eager(fn: Callable[[], object], smoke: bool) -> float:
    """Median ms of ``fn`` run eagerly, as the engine runs prefill (no CUDA graph: launch and
    host overhead of a route count), L2 flushed before each call, CUDA events."""
    if smoke:
        return bench(fn, smoke)
    fn()
    return timed_median(fn, most=50)


def measure_eager(res: dict, what: str, fn: Callable[[], object], smoke: bool) -> float:
    return measure(res, what, fn, smoke, bench_eager)
