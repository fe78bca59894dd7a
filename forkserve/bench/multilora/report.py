"""What a multi-LoRA run prints and draws: the side-by-side table, the failed rows, the
throughput and per-agent KV plot."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forkserve.bench.gpu_clocks import ClockSummary
from forkserve.bench.multilora.systems import plot_order
from forkserve.bench.multilora.workload import RunResult
from forkserve.bench.output import legend_below, new_figure, save_figure, titled


@dataclass(frozen=True)
class FailedRun:
    system: str
    workflows: int
    error: str          # "ExceptionType: message"
    cascade: bool = True
    overlap: bool = False
    round: int | None = None  # --rounds: which one (0-based); None: one round run

    def line(self) -> str:
        how = variant(self.cascade, self.overlap)
        at = "" if self.round is None else f" (round {self.round + 1})"
        return f"FAILED {self.system} W={self.workflows}{how}{at}: {self.error}"


def variant(cascade: bool, overlap: bool) -> str:
    """How a run's engine differed from the default (cascade on, overlap off), for labels."""
    return ("" if cascade else " (cascade off)") + (" (overlap)" if overlap else "")


def format_table(results: list[RunResult], workload: str) -> str:
    head = (f"{'system':<18} {'cascade':>7} {'overlap':>7} {'W':>3} {'tasks/s':>8} {'p50 s':>6} "
            f"{'p99 s':>6} "
            f"{'peak GiB':>8} {'agent MiB':>9} {'ctx MiB/agent':>13} {'hit':>5} "
            f"{'prefill tok':>11} {'pf ticks':>8} {'batch':>5} "
            f"{'prefill s':>9} {'decode s':>8} {'ms/step':>7}")
    lines = [f"{workload}-multilora", head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.system:<18} {'on' if r.cascade else 'off':>7} "
                     f"{'on' if r.overlap else 'off':>7} {r.workflows:>3} "
                     f"{r.tasks_per_s:>8.3f} "
                     f"{r.turn_latency_p50_s:>6.2f} {r.turn_latency_p99_s:>6.2f} "
                     f"{r.peak_kv_bytes / 2**30:>8.2f} {r.per_agent_kv_bytes / 2**20:>9.1f} "
                     f"{r.context_kv_per_agent_bytes / 2**20:>13.2f} {r.prefix_hit_rate:>5.2f} "
                     f"{r.prefill_tokens:>11} {r.prefill_ticks:>8} {r.mean_decode_batch:>5.1f} "
                     f"{r.prefill_tick_s:>9.2f} "
                     f"{r.decode_tick_s:>8.2f} {r.decode_ms_per_step:>7.2f}")
    # The shared context's writing pass sits in neither tick column: said beneath the rows.
    lines += [f"{r.system} W={r.workflows}: {r.context_write_s:.2f} s writing the shared "
              f"context before the agents opened (in the makespan, not in prefill s)"
              for r in results if r.context_write_s > 0]
    lines += [f"{r.system} W={r.workflows}: {r.gc_pause_s_in_run:.2f} s in the cycle collector "
              f"({r.gc_full_passes_in_run} full passes)"
              for r in results if r.gc_pause_s_in_run >= 0.01]
    lines += [f"{r.system} W={r.workflows}: the card through the run: "
              f"{ClockSummary(**r.gpu_clocks).line()}" for r in results if r.gpu_clocks]
    lines += [f"{r.system} W={r.workflows}: tasks/s by round "
              + ", ".join("failed" if x is None else f"{x:.3f}" for x in r.round_tasks_per_s)
              for r in results if r.round_tasks_per_s]
    return "\n".join(lines)


def _span(r: RunResult) -> tuple[float, float] | None:
    """The lowest and highest tasks/s of a row's rounds; None for one round."""
    done = [x for x in r.round_tasks_per_s if x is not None]
    return (min(done), max(done)) if len(done) > 1 else None


def plot(results: list[RunResult], failed: list[FailedRun], path: Path, workload: str,
         tiny: bool, source: str = "") -> None:
    """Throughput and per-agent KV against W, one line per system (its color fixed, so
    plots compare; a bar spans the rounds of a --rounds run), ``source`` (the card and
    commit: ``provenance.measured_on``) above them. A failed run is an x in its system's
    color on the W axis and is named above the plot, never left out silently."""
    fig, (tput, kv) = new_figure(2, width=11, height=4.6)
    for i, system in enumerate(plot_order([r.system for r in results]
                                          + [f.system for f in failed])):
        # Variants (cascade off, overlap on: if run) in the system's color, each its own style.
        for k, how in enumerate(((True, False), (False, False), (True, True), (False, True))):
            cascade, overlap = how
            rows = [r for r in results if r.system == system and (r.cascade, r.overlap) == how]
            if rows:
                label = system + variant(cascade, overlap)
                style = ("o-", "x--", "s:", "d-.")[k]
                ws = [r.workflows for r in rows]
                tput.plot(ws, [r.tasks_per_s for r in rows], style, color=f"C{i}", label=label)
                for r in rows:
                    if span := _span(r):  # --rounds: a bar from the lowest round to the highest
                        tput.vlines(r.workflows, *span, color=f"C{i}")
                kv.plot(ws, [r.per_agent_kv_bytes / 2**20 for r in rows], style, color=f"C{i}",
                        label=label)
        lost = [f.workflows for f in failed if f.system == system]
        if lost:
            tput.plot(lost, [0] * len(lost), "x", color=f"C{i}", markersize=12, mew=2,
                      label=f"{system} FAILED")
    above = []
    if failed:
        above.append("FAILED: " + "; ".join(f"{f.system} W={f.workflows}" for f in failed))
    if source:
        above.append(source)
    if above:
        fig.suptitle("\n".join(above), fontsize=10, color="red" if failed else "black")
    tput.set(xlabel="workflows W", ylabel="tasks/s",
             title=titled(f"{workload}-multilora throughput", tiny))
    kv.set(xlabel="workflows W", ylabel="MiB per agent", title=titled("per-agent KV", tiny),
           yscale="log")
    legend_below(fig, tput)
    save_figure(fig, path)
