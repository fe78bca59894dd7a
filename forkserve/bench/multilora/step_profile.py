"""Where a react step's time goes: ``torch.profiler`` around a few engine ticks of each kind.

The run's figures say *that* a system's decode step or prefill is slow (disaggregated_base's
25 ms decode step against no_lora's 9; the residual prefill at 1.3x unified's); this says
*where*: per tick kind (``prefill``: the tick prefilled, maybe decoding too; ``decode``: a
decode-only tick; ``context_write``: the pass that writes the shared context before any
agent opens, base_activations' ``Engine.prefill_shared`` or neutral's base request), the
wall time, the device's busy time (the union of its kernels' intervals, so the rest of the
wall time is the device waiting on the host), and the kernel time by category (attention,
LoRA, GEMM, copies, sampling, other) with the top kernels by name, the host operators by
self time and our Python functions by cumulative time (``cProfile``: on a device that waits
on its host, where the host spends it). On a CPU device the kernel table is built from the
host's operator self times.

Profiling is not free: the profiled ticks are a handful per run, their wall time stays in the
run's tick totals, and the run's notes say how many were profiled. Ownership: a
``StepProfiler`` belongs to one run (one Driver); ``summary()`` is read after the run.
"""
from __future__ import annotations

import cProfile
import pstats
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

# First match wins, on the lower-cased kernel (or operator) name; our Triton kernels by
# their function names (forkserve/kernels/), library kernels by the usual name parts.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lora", ("_shrink_kernel", "_expand_kernel", "lora", "sgmv", "bgmv")),
    ("attention", ("_decode_partial", "_merge_kernel", "_prefill_kernel", "_residual_",
                   "_qfold_", "_pack_kernel", "flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::linear", "cublas")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "softmax")),
    ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "cat")),
)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, parts in CATEGORIES if any(p in low for p in parts)), "other")


@dataclass(frozen=True)
class KernelTime:
    name: str
    ms: float       # per profiled tick
    calls: float    # per profiled tick


@dataclass(frozen=True)
class TickKindProfile:
    """Means over the profiled ticks of one kind."""

    kind: str
    ticks: int
    wall_ms: float
    busy_ms: float                  # device (or host operator) time, overlaps counted once
    by_category_ms: dict[str, float]
    top: tuple[KernelTime, ...]
    host_top: tuple[KernelTime, ...] = ()  # host operators by self CPU time
    python_top: tuple[KernelTime, ...] = ()  # our Python functions by cumulative time

    @property
    def idle_share(self) -> float:
        """Share of the tick's wall time the device had no kernel running."""
        return max(0.0, 1.0 - self.busy_ms / self.wall_ms) if self.wall_ms else 0.0


@dataclass
class _Acc:
    ticks: int = 0
    wall_us: float = 0.0
    busy_us: float = 0.0
    by_name: dict[str, list[float]] = field(default_factory=dict)  # name -> [us, calls]
    host: dict[str, list[float]] = field(default_factory=dict)     # host operators, the same
    python: dict[str, list[float]] = field(default_factory=dict)   # forkserve functions


class StepProfiler:
    """Profiles ticks until ``ticks_per_kind`` of each kind are kept, after the run's first
    ``skip`` ticks (the first agent's prefill of the shared context is not the steady state)."""

    TICK_KINDS = ("prefill", "decode")
    KINDS = ("context_write", *TICK_KINDS)  # the context write is profiled whole, once

    def __init__(self, ticks_per_kind: int = 3, skip: int = 2, top: int = 8) -> None:
        if ticks_per_kind < 1:
            raise ValueError(f"ticks_per_kind must be >= 1, got {ticks_per_kind}")
        self.ticks_per_kind, self.skip, self.top = ticks_per_kind, skip, top
        self._seen = 0
        self._acc = {k: _Acc() for k in self.KINDS}
        self.profiled = 0

    def wants(self) -> bool:
        self._seen += 1
        return self._seen > self.skip and any(
            self._acc[k].ticks < self.ticks_per_kind for k in self.TICK_KINDS)

    def run(self, tick: Callable[[], bool], kind_of: Callable[[], str | None]) -> bool:
        """Runs ``tick`` under the profiler; ``kind_of()`` (read after it) names the tick's
        kind, or None for a tick that did no step. The device is synchronized inside the
        profiled region so the tick's kernels are in it."""
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        functions = cProfile.Profile()
        with profile(activities=acts) as prof:
            functions.enable()
            try:
                did = tick()
            finally:
                functions.disable()
            if cuda:
                torch.cuda.synchronize()
        kind = kind_of()
        acc = self._acc.get(kind) if kind else None
        if acc is None or acc.ticks >= self.ticks_per_kind:
            return did
        self.profiled += 1
        acc.ticks += 1
        events = prof.events()
        start = min((e.time_range.start for e in events), default=0)
        end = max((e.time_range.end for e in events), default=0)
        acc.wall_us += end - start
        kernels = [e for e in events if _on_device(e)] if cuda else []
        host = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()
                if e.self_cpu_time_total > 0]
        for name, us, calls in host:
            _add(acc.host, name, us, calls)
        for name, us, calls in _our_functions(functions):
            _add(acc.python, name, us, calls)
        if kernels:
            acc.busy_us += _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
            for e in kernels:
                _add(acc.by_name, e.name, e.time_range.elapsed_us(), 1)
        else:  # host operators' self times: what the CPU device computed
            for name, us, calls in host:
                _add(acc.by_name, name, us, calls)
                acc.busy_us += us
        return did

    def summary(self) -> dict[str, dict]:
        """{kind: TickKindProfile as a dict, plus its idle_share}: JSON-ready."""
        out = {}
        for kind, a in self._acc.items():
            if not a.ticks:
                continue
            cats: dict[str, float] = {}
            for name, (us, _) in a.by_name.items():
                cats[category(name)] = cats.get(category(name), 0.0) + us / a.ticks / 1e3
            p = TickKindProfile(kind, a.ticks, a.wall_us / a.ticks / 1e3, a.busy_us / a.ticks / 1e3,
                                dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                                self._top(a.by_name, a.ticks), self._top(a.host, a.ticks),
                                self._top(a.python, a.ticks, 2 * self.top))
            out[kind] = asdict(p) | {"idle_share": p.idle_share}
        return out

    def _top(self, by_name: dict[str, list[float]], ticks: int,
             count: int | None = None) -> tuple[KernelTime, ...]:
        top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: count or self.top]
        return tuple(KernelTime(n, us / ticks / 1e3, c / ticks) for n, (us, c) in top)


def _add(by_name: dict[str, list[float]], name: str, us: float, calls: float) -> None:
    slot = by_name.setdefault(name, [0.0, 0.0])
    slot[0] += us
    slot[1] += calls


def _our_functions(functions: cProfile.Profile) -> list[tuple[str, float, float]]:
    """(module:function, cumulative us, calls) of the package's own functions: the host's
    time by where our code spends it, the tick's outer calls included (they hold the rest)."""
    package = Path(__file__).resolve().parents[2]
    out = []
    for (file, _, name), (_, calls, _, cumulative, _) in pstats.Stats(functions).stats.items():
        if file.startswith(str(package)):
            where = Path(file).relative_to(package.parent).with_suffix("")
            out.append((f"{'.'.join(where.parts)}:{name}", cumulative * 1e6, calls))
    return out


def _on_device(event) -> bool:
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (concurrent kernels counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def profile_lines(summary: dict[str, dict] | None) -> list[str]:
    """A run's step profile as a few printed lines (empty when none was taken)."""
    out = []
    for kind, p in (summary or {}).items():
        cats = ", ".join(f"{c} {ms:.2f}" for c, ms in p["by_category_ms"].items())
        out.append(f"  {kind} tick ({p['ticks']} profiled): wall {p['wall_ms']:.2f} ms, busy "
                   f"{p['busy_ms']:.2f} ms (idle {p['idle_share']:.0%}); ms by kind: {cats}")
        out.extend(f"    {k['ms']:8.3f} ms {k['calls']:6.1f}x {k['name'][:90]}" for k in p["top"])
        for entry, title in (("host_top", "host operators by self time"),
                             ("python_top", "our Python functions by cumulative time")):
            if p.get(entry) and p[entry] != p["top"]:
                out.append(f"    {title}:")
                out.extend(f"    {k['ms']:8.3f} ms {k['calls']:6.1f}x {k['name'][:90]}"
                           for k in p[entry])
    return out
