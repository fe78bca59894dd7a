"""The react bench's prefill ticks on a MockBackend: the engine's CPU ms per prefill tick by
phase, per system and W agents over one shared context (CPU figures).

    python benchmarks/prefill_tick_bench.py --label after --out benchmarks/results
    PYTHONPATH=<an export of an older commit> FORKSERVE_COMMIT=<its hash> \\
        python benchmarks/prefill_tick_bench.py --label before --out benchmarks/results

The workload of ``forkserve bench react --kv-budget-gib 100 --overlap on`` at the Llama-3-8B
page shape, timed as ``pressure_tick_bench.py`` times it (its ``measure``: the mock's own work
left out, this process's CPU). A prefill tick's engine time is split by phase, each the CPU
time inside one call per tick or per item (timed in a second run, so the timers never weigh
on the totals): ``dedup`` (``InflightDedup.admit``: every prefill's page claims),
``publish`` (``Stepper.publish``: the prefix index's inserts of what was written),
``schedule`` (``TickScheduler.plan``) and ``other`` (the rest: demands, page preparation,
steady rows, sampling). ``--profile N``: cProfile's top N functions (by own time) of the
prefill ticks alone of one more run per system at the largest W, kept in the JSON. Each run
adds its rows under ``--label`` to ``prefill_tick_<machine>.json`` (other labels are kept:
labels measured back to back compare).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from pressure_tick_bench import add_tick_arguments, measure, other_labels, react_params
from tqdm import tqdm

from forkserve.bench.multilora.systems import SPECS
from forkserve.bench.multilora.workload import MultiLoraParams
from forkserve.bench.output import (
    legend_below,
    new_figure,
    save_figure,
    write_json,
)
from forkserve.bench.provenance import source_commit
from forkserve.control.inflight import InflightDedup
from forkserve.control.scheduler import TickScheduler
from forkserve.engine.stepper import Stepper

# Phase -> the method whose calls it times (each called outside the others).
PHASES: dict[str, tuple[type, str]] = {
    "dedup": (InflightDedup, "admit"),
    "publish": (Stepper, "publish"),
    "schedule": (TickScheduler, "plan"),
}


class PrefillPhases:
    """CPU seconds per phase summed over the prefill ticks (a tick that prefilled tokens, as
    ``measure`` counts them), and optionally a cProfile of those ticks alone."""

    def __init__(self, profile: bool = False) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.ticks = 0
        self.stats: pstats.Stats | None = None
        self._tick = dict.fromkeys(PHASES, 0.0)  # the tick in progress
        self._profile = profile

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Time every phase's method and classify ``Stepper.tick``s while inside."""
        saved = {(cls, name): getattr(cls, name) for cls, name in PHASES.values()}
        saved[Stepper, "tick"] = Stepper.tick
        for phase, (cls, name) in PHASES.items():
            setattr(cls, name, self._timed(phase, getattr(cls, name)))
        Stepper.tick = self._classified(Stepper.tick)
        try:
            yield
        finally:
            for (cls, name), fn in saved.items():
                setattr(cls, name, fn)

    def _timed(self, phase: str, fn: Callable) -> Callable:
        acc = self._tick

        def timed(*args, **kwargs):
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[phase] += time.process_time() - t0
        return timed

    def _classified(self, tick: Callable[[Stepper], bool]) -> Callable[[Stepper], bool]:
        def classified(stepper: Stepper) -> bool:
            for phase in self._tick:
                self._tick[phase] = 0.0
            prefill = stepper.metrics.prefill_tokens
            profile = cProfile.Profile() if self._profile else None
            if profile is not None:
                profile.enable()
            did = tick(stepper)
            if profile is not None:
                profile.disable()
            if stepper.metrics.prefill_tokens > prefill:
                self.ticks += 1
                for phase, s in self._tick.items():
                    self.seconds[phase] += s
                if profile is not None:
                    if self.stats is None:
                        self.stats = pstats.Stats(profile)
                    else:
                        self.stats.add(profile)
            return did
        return classified

    def per_tick_ms(self) -> dict[str, float]:
        return {f"{phase}_cpu_ms": s * 1e3 / max(1, self.ticks)
                for phase, s in self.seconds.items()}

    def top(self, n: int) -> list[dict]:
        """The profile's top ``n`` functions by own time, ms per prefill tick."""
        if self.stats is None:
            return []
        rows = sorted(self.stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
        return [{"function": f"{Path(file).name}:{line}({name})", "calls": nc,
                 "tottime_ms": tt * 1e3 / max(1, self.ticks),
                 "cumtime_ms": ct * 1e3 / max(1, self.ticks)}
                for (file, line, name), (_, nc, tt, ct, _) in rows]


def run_point(params: MultiLoraParams, system: str, repeats: int) -> dict:
    """The median (by prefill CPU ms) of ``repeats`` timed runs, with the phases of one more."""
    runs = sorted((measure(params, system, overlap=True) for _ in range(repeats)),
                  key=lambda run: run["prefill_cpu_ms"])
    row = runs[len(runs) // 2]
    phases = PrefillPhases()
    with phases.installed():
        timed = measure(params, system, overlap=True)
    if timed["outputs_sha256"] != row["outputs_sha256"]:
        raise AssertionError(f"{system}: the timed run's outputs differ from the measured run's")
    split = phases.per_tick_ms()
    # The phases' share of this run, scaled to the median run's total.
    scale = row["prefill_cpu_ms"] / max(1e-9, timed["prefill_cpu_ms"])
    split = {k: v * scale for k, v in split.items()}
    split["other_cpu_ms"] = max(0.0, row["prefill_cpu_ms"] - sum(split.values()))
    keep = ("system", "workflows", "prefill_ticks", "prefill_ms", "prefill_cpu_ms",
            "decode_cpu_ms", "outputs_sha256")
    return {k: row[k] for k in keep} | split


def plot(rows: Sequence[Mapping], path: Path, title: str) -> None:
    """Engine CPU ms per prefill tick, one stacked bar (by phase) per label in each system x W."""
    groups = list(dict.fromkeys(f"{r['system']} W={r['workflows']}" for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.8 / len(labels)
    fig, (ax,) = new_figure(1, width=max(8.0, 0.9 * len(groups) + 4), height=4.8)
    phases = [*PHASES, "other"]
    hatches = ["", "//", "..", "xx"]
    for j, label in enumerate(labels):
        by = {f"{r['system']} W={r['workflows']}": r for r in rows if r["label"] == label}
        xs = [g for g in range(len(groups)) if groups[g] in by]
        bottom = [0.0] * len(xs)
        for phase, hatch in zip(phases, hatches, strict=True):
            vals = [by[groups[x]][f"{phase}_cpu_ms"] for x in xs]
            ax.bar([x + (j - (len(labels) - 1) / 2) * width for x in xs], vals, width,
                   bottom=bottom, color=f"C{j}", hatch=hatch, edgecolor="black", linewidth=0.3,
                   label=f"{label}: {phase}")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("engine CPU ms per prefill tick (mock excluded)")
    ax.grid(axis="y", alpha=0.3)
    legend_below(fig, ax, max_cols=4)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workflows", type=int, nargs="+", default=[64, 128, 256], help="agents W")
    ap.add_argument("--systems", nargs="+", choices=list(SPECS), default=list(SPECS))
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per system and W; the row of the median prefill CPU ms")
    ap.add_argument("--profile", type=int, default=25, metavar="N",
                    help="keep cProfile's top N functions of each system's prefill ticks at "
                         "the largest W (0: none)")
    add_tick_arguments(ap, kv_budget_gib=100.0)
    args = ap.parse_args(argv)
    path = args.out / f"prefill_tick_{args.machine}.json"
    rows = other_labels(path, args.label)
    old = json.loads(path.read_text()) if path.exists() else {}
    profiles = {k: v for k, v in old.get("profiles", {}).items() if k != args.label}
    commit = source_commit()

    for system, w in tqdm([(s, w) for s in args.systems for w in args.workflows],
                          desc="systems x W", unit="point"):
        rows.append({"label": args.label, "commit": commit, "repeats": args.repeats}
                    | run_point(react_params(args, w), system, args.repeats))
    if args.profile:
        profiles[args.label] = {}
        for system in tqdm(args.systems, desc="profiles", unit="system"):
            phases = PrefillPhases(profile=True)
            with phases.installed():
                measure(react_params(args, max(args.workflows)), system, overlap=True)
            profiles[args.label][system] = phases.top(args.profile)
    print(f"react on a MockBackend at the 8B page shape, overlap on, CPU: engine CPU ms per "
          f"prefill tick (mock excluded), median of {args.repeats}, by phase")
    print(f"{'label':>8} {'commit':>8} {'system':>18} {'W':>4} {'ticks':>5} {'total':>7} "
          f"{'dedup':>7} {'publish':>7} {'sched':>6} {'other':>7}")
    for r in rows:
        print(f"{r['label']:>8} {r['commit'][:8]:>8} {r['system']:>18} {r['workflows']:>4} "
              f"{r['prefill_ticks']:>5} {r['prefill_cpu_ms']:>7.1f} {r['dedup_cpu_ms']:>7.1f} "
              f"{r['publish_cpu_ms']:>7.1f} {r['schedule_cpu_ms']:>6.2f} "
              f"{r['other_cpu_ms']:>7.1f}")
    for label, by_system in profiles.items():
        for system, top in by_system.items():
            print(f"{label} {system} W={max(args.workflows)}: top functions, own ms per "
                  f"prefill tick (cumulative)")
            for f in top[:8]:
                print(f"  {f['tottime_ms']:>7.2f} ({f['cumtime_ms']:>7.2f}) {f['calls']:>7} "
                      f"{f['function']}")
    write_json(path, {"machine": args.machine, "device": "cpu",
                      "backend": "MockBackend (engine only)", "context": args.context,
                      "turns": args.turns, "gen": args.gen, "kv_budget_gib": args.kv_budget_gib,
                      "overlap": True, "profile_workflows": max(args.workflows),
                      "rows": rows, "profiles": profiles})
    plot(rows, path.with_suffix(".png"),
         "react prefill ticks, overlap on, MockBackend at the 8B page shape (CPU), by phase")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
