"""Speed and quality of every sharing mode in one table (issue 16 item 5).

    python3 -m benchmarks.sharing_tradeoff --out benchmarks/results

joins the quality benchmark's reports (``benchmarks/quality/report.py``: ``quality_*.json``,
ΔF1 on readers against unified with its 95% CI, context KV against unified) with the
multi-LoRA bench's results (``forkserve bench react|mapreduce``: ``react_multilora*.json``,
``mapreduce_multilora*.json``, tasks/s) by mode. A bench row's mode is its system's
(``System.quality_mode``), a quality row's is its layout: both come from
``forkserve/sharing_mode.py``, the one mapping, so the two meet under one name. Writes
``sharing_tradeoff.{md,json,png}``: ΔF1 against tasks/s relative to unified (a panel per
speed column) and against context KV relative to unified.

Speed columns. A column is one bench setting (workload, W, context, turns, budget, engine
variant), so every figure in it is relative to unified's in the same setting. By default,
per workload and setting, the largest W that has a unified row and at least two other systems
(cascade on: the engine's default; ablations and pressure runs are left out, as are profiled
runs, whose wall time includes the profiler). Where several rows give one system in one
setting (calls repeated across commits), the newest source wins: its commit's date in git; a
row whose commit git does not know ranks oldest, then the later file given. Every cell names
its commit in the Markdown's notes.

A mode the bench has no system for, or whose system has no row in a column, says "not
measured"; a mode a quality report lacks says so too. Nothing is dropped and nothing is made
up. A missing or malformed file, or a mode or system the mapping does not know, is a
one-line error (exit 2).
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from benchmarks.quality import modes
from forkserve.bench.multilora.scale import FULL
from forkserve.bench.multilora.systems import SPECS, UnknownSystem, plot_order, spec
from forkserve.bench.output import (
    add_out_argument,
    legend_below,
    new_figure,
    save_figure,
    write_tables,
)
from forkserve.sharing_mode import NoQualityMode

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_QUALITY = (f"SmolLM2-135M={RESULTS / 'quality_h200.json'}",
                   f"Qwen2.5-Coder-0.5B={RESULTS / 'quality_h200_qwen.json'}")
SPEED_GLOBS = ("react_multilora*.json", "mapreduce_multilora*.json")
NOT_MEASURED = "not measured"
MIN_OTHERS = 2  # systems besides unified a default speed column needs


class TradeoffError(ValueError):
    """An input the join cannot use; the message is the one line the command prints."""


# ---------------------------------------------------------------- quality side

@dataclass(frozen=True)
class QualityCell:
    """One mode's paired figures in one quality report (F1 in points)."""

    delta_f1: float
    low: float
    high: float
    readers: int
    rounds: int
    reference: str
    kv_vs_unified: float | None


@dataclass(frozen=True)
class QualitySource:
    label: str
    path: Path
    cells: dict[str, QualityCell | str]  # mode -> figures, or why there are none


def load_quality(spec_arg: str) -> QualitySource:
    """``LABEL=PATH`` (or PATH: the file's stem labels it)."""
    label, _, path = spec_arg.rpartition("=")
    path = Path(path)
    data = read_json(path, "quality report")
    summaries = data.get("summaries") if isinstance(data, dict) else None
    if not isinstance(summaries, list):
        raise TradeoffError(f"{path} is not a quality report (no 'summaries' list: "
                            "benchmarks/quality/report.py writes quality_*.json)")
    cells: dict[str, QualityCell | str] = {}
    for s in summaries:
        name = _mode_name(s.get("layout"), path)
        delta = (s.get("paired") or {}).get("delta_f1")
        if name == s.get("reference", modes.REFERENCE):
            cells[name] = QualityCell(0.0, 0.0, 0.0, 0, int(s.get("rounds", 0)), name,
                                      s.get("kv_vs_unified"))
        elif not s.get("available", True) or not isinstance(delta, dict):
            cells[name] = f"not available ({s.get('note') or 'no paired readers'})"
        else:
            cells[name] = QualityCell(*(100 * delta[k] for k in ("mean", "low", "high")),
                                      int(delta["n"]), int(s.get("rounds", 0)),
                                      str(s.get("reference", modes.REFERENCE)),
                                      s.get("kv_vs_unified"))
    return QualitySource(label or path.stem, path, cells)


def _mode_name(layout: Any, path: Path) -> str:
    try:
        return modes.mode(str(layout)).name
    except ValueError as e:
        raise TradeoffError(f"{path}: {e}") from None


# ---------------------------------------------------------------- speed side

@dataclass(frozen=True)
class Setting:
    """What makes two bench rows comparable: everything but the system."""

    workload: str
    workflows: int
    model: str
    device: str
    driver: str
    context: int
    turns: int
    gen: int
    kv_budget_gib: float
    residual_share: float
    overlap: bool
    cascade: bool = True
    host_residual_gib: float = 0.0
    pause_pin: bool = False
    reopen: bool = False
    # Where a row ran, not what it ran: rows of one setting on different cards still meet
    # in one column (files from before the card was recorded have ""; issue15_goals reads
    # the H200's alone).
    gpu: str = field(default="", compare=False)

    def label(self) -> str:
        return (f"{self.workload} W={self.workflows} (C={self.context}, T={self.turns}, "
                f"G={self.gen}, {self.kv_budget_gib:g} GiB, overlap "
                f"{'on' if self.overlap else 'off'})")

    def group(self) -> Setting:
        """The setting at every W (a default column takes the group's largest)."""
        return Setting(**{**asdict(self), "workflows": 0})

    @property
    def default_engine(self) -> bool:
        """Cascade on and no memory-pressure features: the engine as it serves by default."""
        return self.cascade and not (self.host_residual_gib or self.pause_pin or self.reopen)


@dataclass(frozen=True)
class SpeedRow:
    system: str
    mode: str
    tasks_per_s: float
    context_kv_per_agent_bytes: float | None  # None in rows from before it was measured
    commit: str
    source: str
    rank: tuple[float, int, int]  # newest last: (commit time, file order, row order)
    # A --rounds run's tasks/s by round (None: that round failed); empty for one round.
    per_round: tuple[float | None, ...] = ()


def load_speed(paths: Sequence[Path]) -> dict[Setting, dict[str, SpeedRow]]:
    """Every usable bench row by setting and system, the newest source of each."""
    out: dict[Setting, dict[str, SpeedRow]] = {}
    for setting, row in bench_rows(paths):
        kept = out.setdefault(setting, {}).get(row.system)
        if kept is None or row.rank > kept.rank:
            out[setting][row.system] = row
    return out


def bench_rows(paths: Sequence[Path]) -> Iterator[tuple[Setting, SpeedRow]]:
    """Every usable bench row of ``paths`` with its setting, in file order; ``SpeedRow.rank``
    orders them by age (``commit_time``, then file and row order). Profiled rows are left out,
    and rows that built kernels inside their timed run (Triton specializations or
    FlashAttention-4 kernels the warm-up missed: seconds each, not the system's speed)."""
    for f, path in enumerate(paths):
        doc = read_json(path, "bench result")
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise TradeoffError(f"{path} is not a result of forkserve bench react|mapreduce "
                                "(no 'results' list)")
        for i, r in enumerate(doc["results"]):
            if r.get("step_profile") is not None:
                continue  # its wall time includes the profiler
            if r.get("kernels_built_in_run") or r.get("fa4_compiled_in_run"):
                continue  # its wall time includes kernel builds
            setting = _setting(doc, r, path)
            commit = str(r.get("commit") or doc.get("commit") or "")
            try:
                kv = r.get("context_kv_per_agent_bytes")
                row = SpeedRow(str(r["system"]), _system_mode(r, path), float(r["tasks_per_s"]),
                               None if kv is None else float(kv), commit, path.name,
                               (commit_time(commit), f, i),
                               tuple(r.get("round_tasks_per_s") or ()))
            except (KeyError, TypeError, ValueError) as e:
                raise TradeoffError(f"{path}: row {i} is not a bench row ({e!r})") from None
            yield setting, row


def _setting(doc: dict, r: dict, path: Path) -> Setting:
    try:
        return Setting(workload=str(doc["workload"]).removesuffix("-multilora"),
                       workflows=int(r["workflows"]), model=str(doc["model"]),
                       device=str(doc["device"]), driver=str(doc["driver"]),
                       context=int(doc["context"]), turns=int(doc["turns"]), gen=int(doc["gen"]),
                       kv_budget_gib=float(doc["kv_budget_gib"]),
                       # Rows from before these fields existed ran the defaults of their day.
                       residual_share=float(doc.get("residual_share", FULL.residual_share)),
                       overlap=bool(r.get("overlap") or False),
                       cascade=r.get("cascade") is not False,
                       host_residual_gib=float(doc.get("host_residual_gib") or 0.0),
                       pause_pin=bool(doc.get("pause_pin")), reopen=bool(doc.get("reopen")),
                       gpu=str(doc.get("gpu") or ""))
    except (KeyError, TypeError, ValueError) as e:
        raise TradeoffError(f"{path}: a row without its setting ({e!r})") from None


def _system_mode(r: dict, path: Path) -> str:
    """The quality mode a bench row ran as: its system's, through the one mapping."""
    try:
        return spec(str(r.get("system"))).quality_mode(tuple(r.get("recompute_layers") or ()))
    except (UnknownSystem, NoQualityMode) as e:
        raise TradeoffError(f"{path}: {e}") from None


@functools.cache
def commit_time(commit: str | None) -> float:
    """The commit's date (seconds); -1 where git does not know it (a row without a commit,
    another clone's)."""
    if not commit:
        return -1.0
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", commit], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return -1.0
    return float(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else -1.0


def default_columns(speed: dict[Setting, dict[str, SpeedRow]]) -> list[Setting]:
    """Per workload and setting, the largest W with unified and MIN_OTHERS other systems."""
    best: dict[Setting, Setting] = {}
    for s, rows in speed.items():
        if s.default_engine and "unified" in rows and len(rows) > MIN_OTHERS:
            if s.group() not in best or s.workflows > best[s.group()].workflows:
                best[s.group()] = s
    return sorted(best.values(), key=lambda s: (s.workload != "react", s.workload, s.kv_budget_gib,
                                                s.workflows))


@dataclass(frozen=True)
class SpeedCell:
    tasks_per_s: float
    vs_unified: float
    context_kv_vs_unified: float | None
    commit: str
    source: str


# ---------------------------------------------------------------- the join

@dataclass(frozen=True)
class Row:
    mode: str
    system: str  # the bench system that runs as ``mode``; "" where the bench has none
    quality: dict[str, QualityCell | str]   # by source label
    speed: dict[str, SpeedCell | str]       # by column label


@dataclass(frozen=True)
class Tradeoff:
    quality: list[QualitySource]
    columns: list[Setting]
    speed: dict[Setting, dict[str, SpeedRow]]
    rows: list[Row]


def join(quality: Sequence[QualitySource], speed: dict[Setting, dict[str, SpeedRow]],
         columns: Sequence[Setting]) -> Tradeoff:
    """A row per (mode, bench system running as it); a mode no system runs as gets one row."""
    names = {m for q in quality for m in q.cells}
    names |= {r.mode for c in columns for r in speed.get(c, {}).values()}
    rows = []
    for name in sorted(names, key=modes.order_key):
        systems = _systems_of(name, {r.system for c in columns
                                     for r in speed.get(c, {}).values() if r.mode == name})
        for system in systems or [""]:
            rows.append(Row(name, system,
                            {q.label: q.cells.get(name, NOT_MEASURED) for q in quality},
                            {c.label(): _speed_cell(speed[c], system) for c in columns}))
    return Tradeoff(list(quality), list(columns), speed, rows)


def _systems_of(mode: str, measured: set[str]) -> list[str]:
    """The bench systems that run as ``mode``: those measured, and those the bench could run
    (every SPECS system, and ``recompute<N>`` for its mode), in plot order."""
    candidates = set(SPECS) | ({mode} if mode.startswith("recompute") else set())
    able = {s for s in candidates if spec(s).quality_mode(range(spec(s).recompute)) == mode}
    return [s for s in plot_order(sorted(able | measured)) if s in able | measured]


def _speed_cell(rows: dict[str, SpeedRow], system: str) -> SpeedCell | str:
    row, unified = rows.get(system), rows["unified"]
    if row is None:
        return NOT_MEASURED
    kv = None if row.context_kv_per_agent_bytes is None or not \
        unified.context_kv_per_agent_bytes else \
        row.context_kv_per_agent_bytes / unified.context_kv_per_agent_bytes
    return SpeedCell(row.tasks_per_s, row.tasks_per_s / unified.tasks_per_s, kv, row.commit,
                     row.source)


# ---------------------------------------------------------------- outputs

def markdown(t: Tradeoff) -> str:
    head = ["mode", "bench system"]
    for q in t.quality:
        head += [f"{q.label} ΔF1 [95% CI]", f"{q.label} KV ×unified"]
    head += [f"{c.label()}: tasks/s ×unified (context KV)" for c in t.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in t.rows:
        cells = [r.mode, r.system or "—"]
        for q in t.quality:
            cells += _quality_text(r.quality[q.label])
        for c in t.columns:
            s = r.speed[c.label()]
            cells.append(s if isinstance(s, str) else f"{s.vs_unified:.2f}x ("
                         + ("—" if s.context_kv_vs_unified is None
                            else f"{s.context_kv_vs_unified:.2f}x") + ")")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Quality: readers' ΔF1 in F1 points against each mode's reference (unified; "
              "alora: alora_unified), bootstrap 95% CI over rounds; KV: the shared context's "
              "KV per reader against unified. Sources:"]
    lines += [f"* {q.label}: `{_shown(q.path)}`" for q in t.quality]
    lines += ["", "Speed: tasks/s against unified's in the same setting (the bench's context KV "
              "per agent against unified's in parentheses), newest source per system:"]
    for c in t.columns:
        order = plot_order(list(t.speed[c]))
        rows = sorted(t.speed[c].values(), key=lambda r: order.index(r.system))
        lines.append(f"* {c.label()}: " + "; ".join(
            f"{r.system} {r.tasks_per_s:.3f}/s @{r.commit[:8] or '?'} ({r.source})" for r in rows))
    return "\n".join(lines)


def _quality_text(cell: QualityCell | str) -> list[str]:
    if isinstance(cell, str):
        return [cell, "—"]
    kv = "—" if cell.kv_vs_unified is None else f"{cell.kv_vs_unified:.2f}"
    if not cell.readers:
        return ["reference", kv]
    return [f"{cell.delta_f1:+.1f} [{cell.low:+.1f}, {cell.high:+.1f}] ({cell.readers} readers)",
            kv]


def to_json(t: Tradeoff) -> dict[str, Any]:
    def cell(c: QualityCell | SpeedCell | str) -> dict | str:
        return c if isinstance(c, str) else asdict(c)

    return {"quality": [{"label": q.label, "path": _shown(q.path)} for q in t.quality],
            "columns": [{"label": c.label(), **asdict(c)} for c in t.columns],
            "rows": [{"mode": r.mode, "system": r.system,
                      "quality": {k: cell(v) for k, v in r.quality.items()},
                      "speed": {k: cell(v) for k, v in r.speed.items()}} for r in t.rows]}


def plot(t: Tradeoff, path: Path) -> None:
    """ΔF1 (with its CI) against tasks/s ×unified, a panel per speed column, and against the
    context KV ×unified of the quality run. Color: the mode; marker: the quality source. The
    ΔF1 axis is linear within ±10 points and logarithmic past them, so no_lora's loss does
    not flatten the rest."""
    fig, axes = new_figure(len(t.columns) + 1, width=5.2 * (len(t.columns) + 1), height=5.6)
    import matplotlib
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    colors = matplotlib.colormaps["tab20"]
    order = list(dict.fromkeys(r.mode for r in t.rows))
    markers = "os^Dv"
    for panel, ax in enumerate(axes):
        column = t.columns[panel] if panel < len(t.columns) else None
        for r in t.rows:
            for k, q in enumerate(t.quality):
                cell = r.quality[q.label]
                if isinstance(cell, str):
                    continue
                x = _x(r, column) if column is not None else cell.kv_vs_unified
                if x is None or (column is None and r.system != _first_system(t, r.mode)):
                    continue
                ax.errorbar(x, cell.delta_f1, yerr=[[cell.delta_f1 - cell.low],
                                                    [cell.high - cell.delta_f1]],
                            fmt=markers[k % len(markers)], capsize=2,
                            color=colors(order.index(r.mode) % colors.N))
                if k == 0:
                    ax.annotate(r.mode if r.system in ("", r.mode) else f"{r.mode} [{r.system}]",
                                (x, cell.delta_f1), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_yticks([-60, -40, -20, -10, -5, 0, 5])
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_formatter(FormatStrFormatter("%gx"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("ΔF1 on readers (points, 95% CI)")
        if column is None:
            ax.set(xlabel="context KV per reader ×unified (quality run)",
                   title="quality vs memory")
            continue
        missing = sorted({r.system for r in t.rows
                          if r.system and isinstance(r.speed[column.label()], str)})
        ax.set_xlabel("tasks/s ×unified (bench)")
        ax.set_title(textwrap.fill(f"{column.label()}; not measured: "
                                   f"{', '.join(missing) or 'none'}", 70), fontsize=8)
    for k, q in enumerate(t.quality):  # the sources' markers, in black: color is the mode
        axes[0].plot([], [], markers[k % len(markers)], color="black", label=q.label)
    legend_below(fig, axes[0])
    save_figure(fig, path)


def _x(r: Row, column: Setting) -> float | None:
    """The row's tasks/s ×unified in ``column`` (None: not measured there)."""
    s = r.speed[column.label()]
    return None if isinstance(s, str) else s.vs_unified


def _first_system(t: Tradeoff, mode: str) -> str:
    """A mode's quality point is drawn once on the KV panel, however many systems run as it."""
    return next(r.system for r in t.rows if r.mode == mode)


def _shown(path: Path) -> str:
    """A path inside the repository relative to it, so the committed outputs do not name the
    machine they were made on."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TradeoffError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TradeoffError(f"{what} {path} is not readable JSON: {e}") from None


def default_speed_files() -> list[Path]:
    return sorted(p for g in SPEED_GLOBS for p in RESULTS.glob(g))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.sharing_tradeoff",
                                 description=__doc__.split("\n\n")[2],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quality", nargs="+", default=list(DEFAULT_QUALITY), metavar="LABEL=JSON",
                    help="quality reports (benchmarks/quality/report.py), each its own columns")
    ap.add_argument("--speed", nargs="+", type=Path, metavar="JSON",
                    help="results of forkserve bench react|mapreduce (default: "
                         f"{', '.join(SPEED_GLOBS)} under benchmarks/results)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    try:
        quality = [load_quality(q) for q in args.quality]
        speed = load_speed(args.speed or default_speed_files())
        columns = default_columns(speed)
        if not columns:
            raise TradeoffError("no bench setting has unified and two other systems to compare "
                                "(--speed)")
        t = join(quality, speed, columns)
    except TradeoffError as e:
        print(f"sharing_tradeoff: error: {e}", file=sys.stderr)
        return 2
    write_tables(args.out, "sharing_tradeoff", markdown(t), to_json(t))
    plot(t, args.out / "sharing_tradeoff.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
