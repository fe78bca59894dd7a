"""Issue 15's goals against the committed H200 figures, one row per goal.

    python3 -m benchmarks.issue15_goals --out benchmarks/results
    python3 -m benchmarks.issue15_goals --card H100 --results benchmarks/results/h100 \
        --out benchmarks/results/h100    # the same goals over an H100's runs, for reference

reads the result JSONs under ``benchmarks/results`` (``--results`` names another folder):
``kernel_bench*.json`` (``kernel_bench.py``: decode variants, prefill routes),
``decode_bench*.json`` (``decode_bench.py``: ms per decode step, 8K prefill) and
``react_multilora*.json`` (``forkserve bench react``: tasks/s), and writes
``issue15_goals.{md,json,png}``: per goal the measured value, the goal, met or missed (the
value as a ratio to the goal), the source file and its commit.

Every figure is read from a file, none is typed in here. Where several files hold a figure
(rounds of the same call), the newest wins: its commit's date in git
(``sharing_tradeoff.commit_time``); a file whose commit git does not know, or that has none,
ranks oldest, then the later file in name order. Only the folder's own files are read: a
kernel's figures kept after the kernel was reverted live under ``reverted/`` there, so a
later run of a lost experiment can never stand for the kernel main ships, and a run on an
H100 while no H200 was lent under ``h100/`` (react files before round 35 do not name their
card; a react file that names another card than the H200, or ``--card``, is left out). The
issue's goals are the H200's: ``--card`` reads another card's folder beside them, its files
named for the card (``issue15_goals_h100.*``). A goal no file holds
says "not measured" and names the file that would hold it. A missing folder, or a file that
is not readable JSON or not the bench's shape, is a one-line error (exit 2). A kernel_bench
run at another attention shape than the issue's (Llama-3-8B's, rank-16 residuals:
``--group``, ``--rank``) is left out.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.sharing_tradeoff import (
    RESULTS,
    Setting,
    SpeedRow,
    TradeoffError,
    bench_rows,
    commit_time,
    read_json,
)
from forkserve.bench.output import add_out_argument, new_figure, save_figure, write_tables

NOT_MEASURED = "not measured"
ISSUE15_W = 32           # the react goals' W
ISSUE15_KV_GIB = 24.0    # the react goals' KV budget
ADAPTIVE_WS = (1, 8, 32)
CARD = "H200"            # the issue's card
LONG_CTX = 4096          # ">= 4K"
PREFILL_CTX = (1024, 32768)  # "1K-32K"
PREFILL_TOKENS = 8192    # decode_bench's 8K prefill


class GoalsError(ValueError):
    """An input the table cannot use; the message is the one line the command prints."""


@dataclass(frozen=True)
class Goal:
    number: str
    name: str
    op: str        # "<=" or ">="
    target: float
    unit: str      # "x", "tok/s", "tasks/s", "ms"
    wants: str     # the file (and field) that would hold the figure


@dataclass(frozen=True)
class Found:
    """One goal's measured value and where it came from."""

    value: float
    source: str
    commit: str
    detail: str                       # which point / system / route the value is
    rank: tuple[float, int] = (-1.0, 0)


@dataclass
class Row:
    goal: Goal
    found: Found | None
    met: bool | None = field(default=None)
    ratio: float | None = field(default=None)  # value / goal

    def __post_init__(self) -> None:
        if self.found is not None:
            self.ratio = self.found.value / self.goal.target
            self.met = (self.found.value <= self.goal.target if self.goal.op == "<="
                        else self.found.value >= self.goal.target)


# ---------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Doc:
    path: Path
    data: dict
    commit: str
    rank: tuple[float, int]


def load_docs(paths: Sequence[Path], what: str) -> list[Doc]:
    docs = []
    for f, path in enumerate(paths):
        data = _read(path, what)
        if not isinstance(data, dict):
            raise GoalsError(f"{what} {path} is not a JSON object")
        commit = str(data.get("commit") or "")
        docs.append(Doc(path, data, commit, (commit_time(commit), f)))
    return docs


def _read(path: Path, what: str) -> Any:
    try:
        return read_json(path, what)
    except TradeoffError as e:
        raise GoalsError(str(e)) from None


def _list(doc: Doc, key: str) -> list[dict]:
    rows = doc.data.get(key)
    if rows is None:
        return []
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise GoalsError(f"{doc.path}: '{key}' is not a list of rows")
    return rows


def _num(doc: Doc, row: dict, key: str) -> Any:
    try:
        return row[key]
    except KeyError:
        raise GoalsError(f"{doc.path}: a row without '{key}'") from None


def _newest(found: list[Found]) -> Found | None:
    return max(found, key=lambda x: x.rank, default=None)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# ---------------------------------------------------------------- kernel_bench

# The variant a decode call runs by default (kernel_bench's names for it, newest first: since
# round 20 "default", the policy's pick; before it "two_pass_default"): where a row has it,
# its ratio is the point's, not the best of the variants beside it (some were tried and
# reverted, and the best of several noisy readings is biased low).
DEFAULT_DECODE_VARIANTS = ("default", "two_pass_default")


def _decode_points(doc: Doc) -> list[tuple[int, int, str, float]]:
    """(ctx, batch, residual variant, its ratio to unified) per decode point of
    ``decode_variants``: the default variant's ratio where the row has it, else the best
    ``*_ratio`` (older files); or ``residual_over_unified`` of the older ``decode``."""
    points = []
    for r in _list(doc, "decode_variants"):
        ratios = {k.removesuffix("_ratio"): v for k, v in r.items()
                  if k.endswith("_ratio") and _finite(v)}
        if ratios:
            best = next((v for v in DEFAULT_DECODE_VARIANTS if v in ratios),
                        min(ratios, key=ratios.get))
            points.append((int(_num(doc, r, "ctx")), int(_num(doc, r, "batch")), best,
                           ratios[best]))
    for r in _list(doc, "decode"):
        v = r.get("residual_over_unified")
        if _finite(v):
            points.append((int(_num(doc, r, "ctx")), int(_num(doc, r, "batch")), "residual", v))
    return points


def residual_decode(kernel: list[Doc], batch_ok: Callable[[int], bool]) -> Found | None:
    """Worst (ctx >= 4K, batch) point of the newest kernel_bench file with such points, each
    point's ratio the default variant's (``_decode_points``)."""
    found = []
    for doc in kernel:
        points = [p for p in _decode_points(doc) if p[0] >= LONG_CTX and batch_ok(p[1])]
        if points:
            ctx, batch, variant, ratio = max(points, key=lambda p: p[3])
            found.append(Found(ratio, doc.path.name, doc.commit,
                               f"worst of {len(points)} points: ctx {ctx}, batch {batch} "
                               f"({variant})", doc.rank))
    return _newest(found)


def policy_route(row: dict) -> str:
    """The residual route the default policy takes for a residual_prefill_bench case: the
    row's own record (``policy_route``), else the policy asked again with the case's counts
    and the kernels the row ran (rows written before the bench recorded it)."""
    if "policy_route" in row:
        return str(row["policy_route"])
    from forkserve.kernels.prefill_policy import CostPrefillPolicy, PrefillCounts, PrefillKernels
    batch, new, keys = int(row["batch"]), int(row["new"]), int(row["keys"])
    flash = str(row.get("flash_kernel") or "")
    found = PrefillKernels(varlen=bool(flash), paged=flash == "fa4",
                           residual_ws="ws" in row.get("residual", {}))
    return CostPrefillPolicy().route(PrefillCounts((new,) * batch, (keys,) * batch), True,
                                     found).value


def ws_default_column(doc: Doc, row: dict) -> str:
    """The column of a residual_prefill_bench row that times the ws launch the kernel takes
    by default now (``default_launch`` of the case's chunk and GQA group): a run times every
    launch, and its ``ws`` column is the default of its own commit, which a later one may
    have replaced by a launch the same run measured. ``ws`` where the row has no such
    column."""
    from forkserve.kernels.residual_prefill_gluon import default_launch
    shape = doc.data.get("shape") or {}
    group = int(shape.get("n_heads", 32)) // int(shape.get("n_kv", 8))
    name = default_launch(int(_num(doc, row, "new")), group).name
    return name if f"residual_{name}" in (row.get("device_over_best_unified") or {}) else "ws"


def residual_prefill_routes(docs: list[Doc], card: str) -> list[Found]:
    """Per residual_prefill_bench file: the worst case of the route the policy takes over
    the best unified route, by device time where a graph held both (the Triton and ws
    kernels), else eagerly (the packed route). Cold prompts are left out: the engine takes
    FRESH there, kernel_bench's rows."""
    found = []
    for doc in docs:
        points = []
        for r in _list(doc, "rows"):
            new, keys = int(_num(doc, r, "new")), int(_num(doc, r, "keys"))
            if new == keys or not PREFILL_CTX[0] <= keys - new <= PREFILL_CTX[1]:
                continue
            route = policy_route(r)
            column = ws_default_column(doc, r) if route == "ws" else route
            ratio = (r.get("device_over_best_unified") or {}).get(f"residual_{column}")
            how = "device time" if column == route else f"device time of {column}"
            if not _finite(ratio):
                ratio, how = (r.get("over_baseline") or {}).get(route), "eager"
            if _finite(ratio):
                points.append((ratio, keys - new, int(_num(doc, r, "batch")), new,
                               f"{route}, {how}"))
        if points:
            ratio, ctx, batch, new, route = max(points)
            # A run on another card than the table's says which.
            device = str(doc.data.get("device") or "")
            other = f"; on an {device}" if not on_card(device, card) else ""
            found.append(Found(ratio, doc.path.name, doc.commit,
                               f"worst of {len(points)} points: {batch} x {new} over ctx {ctx} "
                               f"(the policy's route {route}{other})", doc.rank))
    return found


def residual_prefill(kernel: list[Doc], routes: list[Doc], card: str) -> Found | None:
    """Worst 1K-32K point of the best residual route over the best unified route; where a row
    has device times (graph replays, kernelbench.prefill ``DEVICE_COLUMNS``), the FRESH routes'
    ratio by them, as the decode rows are timed. The newest of kernel_bench's and
    residual_prefill_bench's files (``residual_prefill_routes``)."""
    found = residual_prefill_routes(routes, card)
    for doc in kernel:
        points = []
        for r in _list(doc, "prefill"):
            ctx = int(_num(doc, r, "ctx"))
            if not PREFILL_CTX[0] <= ctx <= PREFILL_CTX[1]:
                continue
            device = r.get("residual_fresh_device_over_best_unified")
            if _finite(device):
                points.append((device, ctx, int(_num(doc, r, "batch")), "fresh, device time"))
                continue
            ratios = {k.removeprefix("residual_").removesuffix("_over_best_unified"): v
                      for k, v in r.items()
                      if k.startswith("residual_") and k.endswith("_over_best_unified")
                      and _finite(v)}
            if ratios:
                best = min(ratios, key=ratios.get)
                points.append((ratios[best], ctx, int(_num(doc, r, "batch")), best))
        if points:
            ratio, ctx, batch, route = max(points)
            found.append(Found(ratio, doc.path.name, doc.commit,
                               f"worst of {len(points)} points: batch {batch} x ctx {ctx} "
                               f"(best residual route {route})", doc.rank))
    return _newest(found)


def unified_prefill_vs_sdpa(kernel: list[Doc]) -> Found | None:
    """Worst ctx >= 4K point of unified prefill on the route the policy takes over torch SDPA
    (the rows whose baseline is ``sdpa_default``); by device time where the row has it for
    that route (FRESH)."""
    found = []
    for doc in kernel:
        points = []
        for r in _list(doc, "prefill"):
            route = r.get("policy_unified")
            v, how = r.get(f"unified_{route}_over_baseline"), route
            device = r.get(f"unified_{route}_device_over_baseline")
            if _finite(device):
                v, how = device, f"{route}, device time"
            if r.get("baseline") == "sdpa_default" and _finite(v) \
                    and int(_num(doc, r, "ctx")) >= LONG_CTX:
                points.append((v, int(r["ctx"]), how))
        if points:
            ratio, ctx, route = max(points)
            found.append(Found(ratio, doc.path.name, doc.commit,
                               f"worst of {len(points)} points: ctx {ctx} ({route} route, "
                               "the policy's)", doc.rank))
    return _newest(found)


# ---------------------------------------------------------------- decode_bench

def decode_figure(decode: list[Doc], key: str, field_: str, detail: str,
                  ok: Callable[[dict], bool] = lambda _: True) -> Found | None:
    found = []
    for doc in decode:
        part = doc.data.get(key)
        if isinstance(part, dict) and _finite(part.get(field_)) and ok(part):
            found.append(Found(float(part[field_]), doc.path.name, doc.commit,
                               f"{key}.{field_}{detail}", doc.rank))
    return _newest(found)


def engine_decode(decode: list[Doc], batch: int) -> Found | None:
    """The Engine's decode row (``engine_decode``: host work included) of ``batch`` without
    LoRA, overlap on: the step as the server runs it."""
    found = []
    for doc in decode:
        for row in _list(doc, "engine_decode"):
            if (row.get("batch") == batch and not row.get("lora") and row.get("overlap")
                    and _finite(row.get("ms_per_step"))):
                found.append(Found(float(row["ms_per_step"]), doc.path.name, doc.commit,
                                   f"engine_decode b{batch}, overlap on", doc.rank))
    return _newest(found)


# ---------------------------------------------------------------- react

def _issue15(setting: Setting) -> bool:
    """The issue's react setting (its card is chosen in ``build``)."""
    return (setting.workload == "react" and setting.kv_budget_gib == ISSUE15_KV_GIB
            and setting.default_engine)


def on_card(named: str | None, card: str) -> bool:
    """A file that names its card ran on ``card`` if the name says so; one that names none
    ran on the card of its folder (the H200's before cards were recorded, or ``h100/``)."""
    return not named or card in named


def react_system(rows: list[tuple[Setting, SpeedRow]], system: str) -> Found | None:
    """The system's W = 32 tasks/s from the newest commit; overlap on or off, the better."""
    cands = [(s, r) for s, r in rows
             if _issue15(s) and s.workflows == ISSUE15_W and r.system == system]
    if not cands:
        return None
    newest = max(r.rank[0] for _, r in cands)
    s, r = max(((s, r) for s, r in cands if r.rank[0] == newest),
               key=lambda sr: (sr[1].tasks_per_s, sr[1].rank))
    both = {x.overlap for x, y in cands if y.rank[0] == newest}
    note = f"overlap {'on' if s.overlap else 'off'}" + (
        " (the better of on and off)" if len(both) > 1 else " (the only one run)")
    return Found(r.tasks_per_s, r.source, r.commit, f"W={s.workflows}, {note}",
                 (r.rank[0], r.rank[1]))


def _groups(rows: list[tuple[Setting, SpeedRow]], ws: Sequence[int]
            ) -> dict[tuple[str, Setting], dict[tuple[int, str], SpeedRow]]:
    """Rows of one file and setting (any W), by (W, system)."""
    out: dict[tuple[str, Setting], dict[tuple[int, str], SpeedRow]] = {}
    for s, r in rows:
        if _issue15(s) and s.workflows in ws:
            out.setdefault((r.source, s.group()), {})[(s.workflows, r.system)] = r
    return out


def paired(top: SpeedRow, others: Sequence[SpeedRow]) -> tuple[float, str]:
    """``top``'s tasks/s over the best of ``others``. Rows of one --rounds run are paired
    round by round (the card's drift through the run cancels within a round): the median
    of the rounds' ratios (of two, their mean), each round's ratio in the detail; otherwise
    the rows' own figures."""
    rounds = [r.per_round for r in (top, *others)]
    if len(rounds[0]) > 1 and len({len(x) for x in rounds}) == 1:
        ratios = [a / max(rest) for a, *rest in zip(*rounds, strict=True)
                  if a is not None and None not in rest]
        if ratios:
            return statistics.median(ratios), (
                f"; median of {len(ratios)} rounds, each paired: "
                + ", ".join(f"{x:.3f}" for x in ratios))
    return top.tasks_per_s / max(r.tasks_per_s for r in others), ""


def disaggregated_vs_unified(rows: list[tuple[Setting, SpeedRow]]) -> Found | None:
    found = []
    for (source, _), g in _groups(rows, (ISSUE15_W,)).items():
        d, u = g.get((ISSUE15_W, "disaggregated")), g.get((ISSUE15_W, "unified"))
        if d and u:
            rank = max(d.rank, u.rank)
            value, rounds = paired(d, [u])
            found.append(Found(value, source, d.commit,
                               f"W={ISSUE15_W}: disaggregated {d.tasks_per_s:.3f} / unified "
                               f"{u.tasks_per_s:.3f} tasks/s{rounds}", (rank[0], rank[1])))
    return _newest(found)


def adaptive_vs_better(rows: list[tuple[Setting, SpeedRow]]) -> Found | None:
    """Per W, adaptive over the better of unified and disaggregated from the newest file that
    ran all three side by side at that W (a change that moves one W is rerun at that W
    alone); the worst W's ratio, each W's file named."""
    per_w: dict[int, Found] = {}
    for w in ADAPTIVE_WS:
        found = []
        for (source, _), g in _groups(rows, (w,)).items():
            trio = [g.get((w, s)) for s in ("unified", "disaggregated", "adaptive")]
            if all(trio):
                u, d, a = trio
                rank = max(r.rank for r in trio)
                value, rounds = paired(a, [u, d])
                found.append(Found(value, source, a.commit, rounds, (rank[0], rank[1])))
        newest = _newest(found)
        if newest is None:
            return None
        per_w[w] = newest
    worst = min(per_w, key=lambda w: per_w[w].value)
    return replace(per_w[worst], detail=f"worst W={worst}; per W: " + ", ".join(
        f"{w}: {f.value:.3f} ({f.source}, {f.commit[:8]}{f.detail})"
        for w, f in per_w.items()))


# ---------------------------------------------------------------- the table

GOALS = (
    Goal("1", "ResidualAttention decode / unified, ctx >= 4K, batch >= 8", "<=", 1.15, "x",
         "kernel_bench*.json (kernel_bench.py --decode-variants: decode_variants *_ratio)"),
    Goal("2", "ResidualAttention decode / unified, ctx >= 4K, batch 1", "<=", 1.3, "x",
         "kernel_bench*.json (kernel_bench.py --decode-variants: decode_variants *_ratio)"),
    Goal("3", "residual prefill / unified prefill, ctx 1K-32K", "<=", 1.3, "x",
         "kernel_bench_prefill.json (prefill residual_*_over_best_unified)"),
    Goal("4", "unified prefill / torch SDPA, ctx >= 4K", "<=", 1.0, "x",
         "kernel_bench_prefill.json (prefill unified_<policy>_over_baseline)"),
    Goal("5", "8K LoRA prefill (decode_bench)", ">=", 35000.0, "tok/s",
         "decode_bench*.json (prefill_lora.tokens_per_s)"),
    Goal("6", "react W=32, 24 GiB, no_lora", ">=", 10.3, "tasks/s",
         "react_multilora*.json (system no_lora, workflows 32)"),
    Goal("7", "react W=32, 24 GiB, disaggregated_base", ">=", 7.0, "tasks/s",
         "react_multilora*.json (system disaggregated_base, workflows 32)"),
    Goal("8", "react W=32 disaggregated / unified (one file)", ">=", 1.3, "x",
         "react_multilora*.json (unified and disaggregated, workflows 32, one file)"),
    Goal("9", "react adaptive / better of unified, disaggregated, W=1, 8, 32 (worst W)", ">=",
         0.95, "x", "react_multilora*.json (unified, disaggregated, adaptive at W 1, 8, 32)"),
    Goal("10a", "decode ms/step, batch 1, no LoRA", "<=", 4.9, "ms",
         "decode_bench*.json (decode_b1.ms_per_step)"),
    Goal("10b", "decode ms/step, batch 64, no LoRA", "<=", 6.7, "ms",
         "decode_bench*.json (decode_b64.ms_per_step)"),
    Goal("10c", "decode ms/step through the Engine, batch 1, no LoRA, overlap on", "<=", 4.9,
         "ms", "decode_bench*.json (engine_decode, batch 1, overlap on)"),
    Goal("10d", "decode ms/step through the Engine, batch 64, no LoRA, overlap on", "<=", 6.7,
         "ms", "decode_bench*.json (engine_decode, batch 64, overlap on)"),
)


# The issue's goals are at Llama-3-8B's attention with rank-16 residuals: a kernel_bench or
# residual_prefill_bench run whose recorded shape differs (``--group 8``, ``--rank 32``)
# answers another question.
ISSUE_SHAPE = {"n_heads": 32, "n_kv": 8, "head_dim": 128, "rank": 16}


def at_issue_shape(doc: Doc) -> bool:
    shape = doc.data.get("shape")
    return not isinstance(shape, dict) or all(
        shape.get(k, v) == v for k, v in ISSUE_SHAPE.items())


def build(results: Path, card: str = CARD) -> list[Row]:
    """The goals' rows from the files under ``results``; react files that name another card
    than ``card`` are left out."""
    if not results.is_dir():
        raise GoalsError(f"results folder {results} does not exist")
    kernel = [d for d in load_docs(sorted(results.glob("kernel_bench*.json")),
                                   "kernel_bench result") if at_issue_shape(d)]
    routes = [d for d in load_docs(sorted(results.glob("residual_prefill*.json")),
                                   "residual_prefill_bench result") if at_issue_shape(d)]
    # A baseline run (``decode_bench --no-skinny``: cuBLAS where the engine runs the skinny
    # GEMM) is the comparison, not the engine's figure.
    decode = [d for d in load_docs(sorted(results.glob("decode_bench*.json")),
                                   "decode_bench result") if "baseline" not in d.data]
    try:
        react = [(s, r) for s, r in bench_rows(sorted(results.glob("react_multilora*.json")))
                 if on_card(s.gpu, card)]
    except TradeoffError as e:
        raise GoalsError(str(e)) from None
    tokens = f" ({PREFILL_TOKENS} tokens)"
    found = {
        "1": residual_decode(kernel, lambda b: b >= 8),
        "2": residual_decode(kernel, lambda b: b == 1),
        "3": residual_prefill(kernel, routes, card),
        "4": unified_prefill_vs_sdpa(kernel),
        "5": decode_figure(decode, "prefill_lora", "tokens_per_s", tokens,
                           lambda p: p.get("tokens") == PREFILL_TOKENS),
        "6": react_system(react, "no_lora"),
        "7": react_system(react, "disaggregated_base"),
        "8": disaggregated_vs_unified(react),
        "9": adaptive_vs_better(react),
        "10a": decode_figure(decode, "decode_b1", "ms_per_step", ""),
        "10b": decode_figure(decode, "decode_b64", "ms_per_step", ""),
        "10c": engine_decode(decode, 1),
        "10d": engine_decode(decode, 64),
    }
    return [Row(g, found[g.number]) for g in GOALS]


def _value(x: float, unit: str) -> str:
    if unit == "x":
        return f"{x:.2f}x"
    if unit == "tok/s":
        return f"{x / 1000:.1f}K tok/s"
    return f"{x:.2f} {unit}"


def _status(r: Row) -> str:
    if r.found is None:
        return NOT_MEASURED
    return f"{'met' if r.met else '**missed**'} ({r.ratio:.2f}x the goal)"


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| # | goal | measured | target | status | source | commit |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        g, f = r.goal, r.found
        goal = f"{g.op} {_value(g.target, g.unit)}"
        if f is None:
            lines.append(f"| {g.number} | {g.name} | {NOT_MEASURED} | {goal} | "
                         f"{NOT_MEASURED} | would be in {g.wants} | — |")
        else:
            lines.append(f"| {g.number} | {g.name} | {_value(f.value, g.unit)} | {goal} | "
                         f"{_status(r)} | `{f.source}` | {f.commit[:8] or 'unknown'} |")
    lines += ["", "Status: the measured value as a ratio to the goal (below 1 meets a <= goal, "
              "at or above 1 a >= goal). Each figure is the newest file's that holds it (its "
              "commit's date in git; a file without a known commit ranks oldest). What each "
              "value is:"]
    lines += [f"* {r.goal.number}: {r.found.detail}" if r.found else
              f"* {r.goal.number}: {NOT_MEASURED}" for r in rows]
    return "\n".join(lines)


def to_json(rows: Sequence[Row]) -> dict[str, Any]:
    out = []
    for r in rows:
        f = r.found
        out.append({**asdict(r.goal), "value": f.value if f else None,
                    "status": ("met" if r.met else "missed") if f else NOT_MEASURED,
                    "ratio_to_goal": r.ratio, "source": f.source if f else None,
                    "commit": (f.commit or "unknown") if f else None,
                    "detail": f.detail if f else None})
    return {"issue": 15, "goals": out}


def plot(rows: Sequence[Row], path: Path, card: str = CARD) -> None:
    """One bar per goal: the value over the goal, so 1.0 is the goal line; green met, red
    missed; a goal not measured has no bar."""
    fig, (ax,) = new_figure(1, width=10, height=0.45 * len(rows) + 1.8)
    labels, ys = [], list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows, strict=True):
        g = r.goal
        labels.append(f"{g.number}. {g.name} ({g.op} {_value(g.target, g.unit)})")
        if r.found is None:
            ax.text(0.02, y, NOT_MEASURED, va="center", fontsize=8, color="grey")
            continue
        ax.barh(y, r.ratio, color="tab:green" if r.met else "tab:red")
        ax.text(r.ratio, y, f" {_value(r.found.value, g.unit)}", va="center", fontsize=7,
                bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})
    ax.axvline(1.0, color="black", linestyle="--", lw=1, label="goal")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel("measured / goal (1.0 = the goal; <= goals want less, >= goals more)")
    note = "" if card == CARD else f"\nfor reference: the issue's figures are the {CARD}'s"
    ax.set_title(f"issue 15's goals ({card}; green met, red missed){note}")
    ax.set_xlim(0, max([r.ratio for r in rows if r.ratio] + [1.0]) * 1.2)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.issue15_goals",
                                 description=__doc__.split("\n\n")[2],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="folder of the result JSONs to read")
    ap.add_argument("--card", default=CARD,
                    help="the card whose runs to read (as the files name it: H200, H100); the "
                         "issue's goals are the H200's")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    try:
        rows = build(args.results, args.card)
    except GoalsError as e:
        print(f"issue15_goals: error: {e}", file=sys.stderr)
        return 2
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong kind
        print(f"issue15_goals: error: a result under {args.results} is not the bench's shape "
              f"({e!r})", file=sys.stderr)
        return 2
    stem = "issue15_goals" + ("" if args.card == CARD else f"_{args.card.lower()}")
    write_tables(args.out, stem, markdown(rows), to_json(rows))
    plot(rows, args.out / f"{stem}.png", args.card)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
