"""Nsight Compute raw pages of kernels that do the same work, side by side: where one
kernel's time goes against another's (row 3 of issue 15: the ws residual prefill against
FlashAttention-4's paged read over the same keys).

    python3 benchmarks/ncu_compare.py fa4=ncu_fa4.csv ws=ncu_ws.csv --out ncu_prefill.json

Each input is what ``ncu --csv --page raw ...`` printed for one profiled launch (the
application's own lines before it are skipped; ``h200_issue15.sh`` 73 writes them). Prints
a table of the metrics below (each column beside the first input's) and writes a JSON with
every metric of every input, so a question the table does not answer needs no rerun.

``--source`` reads ``ncu --page source --print-source sass --csv`` instead (step 74): each
SASS instruction with its executed count and stall samples, summed by instruction class
(``sass_classes``) and by opcode, ``--per N`` dividing the counts (e.g. by the key tiles a
launch ran). Samples of warps parked at ``USETMAXREG`` (a warp-specialized kernel's idle
padding warps, which ncu samples as waiting at a barrier for the whole launch) are counted
apart from the rest. Each mbarrier wait is listed too (``waits``): a try-wait that finds its
phase incomplete branches to a retry of the same instruction placed after the kernel's
body, so the retries' executed count over the wait's own says how long its warps waited on
that barrier (who waits on whom: round 32 found the consumers retrying the rebuilt key's
barrier ~11 times a tile and the rebuild never its inputs').
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.sass_classes import ALL_CLASSES, op_class, opcode  # noqa: E402

# What the table shows: its label -> ncu's metric.
TABLE = {
    "time (us)": "gpu__time_duration.sum",
    "GPC cycles": "gpc__cycles_elapsed.max",
    "warp instructions": "smsp__inst_executed.sum",
    "tensor pipe (%)": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "XU pipe (%)": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "FMA pipe (%)": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "ALU pipe (%)": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "uniform pipe (%)": "sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active",
    "issue active (%)": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warps per scheduler": "smsp__warps_active.avg.per_cycle_active",
    "eligible per scheduler": "smsp__warps_eligible.avg.per_cycle_active",
    "cycles per instruction": "smsp__average_warp_latency_per_inst_issued.ratio",
    "registers a thread": "launch__registers_per_thread",
    "shared memory a block": "launch__shared_mem_per_block",
    "blocks": "launch__grid_size",
    "DRAM (%)": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
}
# ncu's time units, to microseconds (the table's).
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


class NcuError(ValueError):
    """An input that is not one ncu raw page (one line, exit 2)."""


def _number(cell: str) -> float | None:
    """A cell as ncu prints a number (thousands separated by commas), else None."""
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def parse_raw(text: str, name: str) -> dict[str, float | str]:
    """The first profiled launch of an ``ncu --csv --page raw`` output: metric -> value
    (numbers as floats, their thousands separators dropped, times in microseconds)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise NcuError(f"{name}: no ncu raw page (a line starting \"ID\"); was a kernel profiled?")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, values = rows[0], rows[1] if len(rows) > 1 else [], None
    for row in rows[1:]:  # the units row has an empty ID, each launch a number
        if row and row[0].strip().isdigit():
            values = row
            break
    if values is None or len(values) != len(header):
        raise NcuError(f"{name}: the ncu raw page has no launch row matching its header")
    out: dict[str, float | str] = {}
    units = units if len(units) == len(header) else [""] * len(header)
    for key, unit, value in zip(header, units, values, strict=True):
        number = _number(value)
        out[key] = value if number is None else number * TO_US.get(unit, 1.0)
    return out


def parse_source(text: str, name: str, per: float = 1.0) -> dict:
    """One launch's source page: warp instructions executed by class and by opcode (over
    ``per``, rounded), stall samples by class and by reason, and the samples of warps
    parked at ``USETMAXREG``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise NcuError(f"{name}: no ncu source page (a line starting \"Address\")")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    try:
        src, executed = header.index("Source"), header.index("Instructions Executed")
        sampled = header.index("Warp Stall Sampling (All Samples)")
    except ValueError as e:
        raise NcuError(f"{name}: the source page lacks a column ({e})") from None
    reasons = [(j, c[len("stall_"):]) for j, c in enumerate(header)
               if c.startswith("stall_") and "Not Issued" not in c]
    by_class, by_op, samples, stall, parked = Counter(), Counter(), Counter(), Counter(), 0.0
    waits: dict[str, dict] = {}  # a try-wait's text -> its first address, tries, retries
    waiting = None  # the wait just read: the branch after it samples its warps too

    def num(cell: str) -> float:
        return _number(cell) or 0.0

    for row in rows[1:]:
        if len(row) != len(header) or not row[0].startswith("0x"):
            continue
        op = opcode(row[src])
        if op == "USETMAXREG":
            parked += num(row[sampled])
            continue
        n, cls = num(row[executed]), op_class(op)
        if "TRYWAIT" in row[src]:
            waiting = _wait(waits, row[src], row[0], n, num(row[sampled]))
        elif waiting is not None and op == "BRA":
            waiting["samples"] += num(row[sampled])
            waiting = None
        else:
            waiting = None
        by_class[cls] += n
        by_op[op] += n
        samples[cls] += num(row[sampled])
        for j, reason in reasons:
            stall[reason] += num(row[j])
    scale = 1.0 / per
    return {"instructions": round(sum(by_class.values()) * scale, 1),
            "by_class": {c: round(by_class[c] * scale, 1) for c in ALL_CLASSES},
            "top_opcodes": {o: round(n * scale, 1) for o, n in by_op.most_common(16)},
            "samples_by_class": {c: samples[c] for c in ALL_CLASSES},
            "stall_samples": dict(stall.most_common()), "parked_samples": parked,
            "waits": [w | {"retries_per_try": round(w["retries"] / w["tries"], 2)
                           if w["tries"] else None}
                      for w in sorted(waits.values(), key=lambda w: -w["retries"])]}


def _wait(waits: dict[str, dict], text: str, address: str, n: float, samples: float) -> dict:
    """Adds a try-wait row to ``waits``: the first row of a text is the wait (its address
    and tries), a later one its retry; returns the wait's entry."""
    key = " ".join(w for w in text.split() if not w.startswith("@"))
    if key not in waits:
        waits[key] = {"wait": key, "address": address, "tries": n, "retries": 0.0,
                      "samples": 0.0}
    else:
        waits[key]["retries"] += n
    waits[key]["samples"] += samples
    return waits[key]


def print_source(runs: dict[str, dict]) -> None:
    names = list(runs)
    first = names[0]
    print(f"{'executed':18}" + "".join(f"{n:>24}" for n in names))
    for label, key in [("all", None), *((c, c) for c in ALL_CLASSES)]:
        cells = []
        for n in names:
            v = runs[n]["instructions"] if key is None else runs[n]["by_class"][key]
            base = runs[first]["instructions"] if key is None else runs[first]["by_class"][key]
            ratio = f" ({v / base:.2f}x)" if base and n != first else ""
            cells.append(f"{v:>12,.0f}{ratio:>12}")
        print(f"{label:18}" + "".join(cells))
    for n in names:
        total = sum(runs[n]["samples_by_class"].values()) or 1.0
        shares = ", ".join(f"{c} {100 * v / total:.0f}%" for c, v in
                           sorted(runs[n]["samples_by_class"].items(), key=lambda kv: -kv[1]))
        print(f"  {n} stall samples by class: {shares}; parked at setmaxnreg: "
              f"{runs[n]['parked_samples']:,.0f} (apart)")
        for w in runs[n]["waits"][:6]:
            print(f"    wait at {w['address']}: {w['retries_per_try']} retries a try "
                  f"({w['tries']:,.0f} tries, {w['samples']:,.0f} samples) {w['wait']}")


def stalls(metrics: dict[str, float | str]) -> dict[str, float]:
    """Cycles a warp spends stalled per issued instruction, by reason (ncu's warp state
    statistics), the largest first."""
    found = {k[len(STALL_PREFIX):-len(STALL_SUFFIX)]: v for k, v in metrics.items()
             if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)
             and "not_issued" not in k and isinstance(v, float)}
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def compare(runs: dict[str, dict[str, float | str]]) -> dict:
    """The table's metrics and the stall reasons of every run, and each number over the
    first run's."""
    first = next(iter(runs))
    table = {}
    for label, metric in TABLE.items():
        row = {n: m.get(metric) for n, m in runs.items()}
        base = row[first]
        ratio = {n: (v / base if isinstance(v, float) and isinstance(base, float) and base
                     else None) for n, v in row.items()}
        table[label] = {"metric": metric, "values": row, "over_" + first: ratio}
    return {"baseline": first, "table": table,
            "stalls": {n: stalls(m) for n, m in runs.items()}, "raw": runs}


def print_table(result: dict) -> None:
    names = list(result["raw"])
    first = result["baseline"]
    print(f"{'':26}" + "".join(f"{n:>22}" for n in names))
    for label, row in result["table"].items():
        cells = []
        for n in names:
            v, r = row["values"][n], row["over_" + first][n]
            text = "-" if v is None else (f"{v:,.2f}" if isinstance(v, float) else str(v))
            if r is not None and n != first:
                text += f" ({r:.2f}x)"
            cells.append(f"{text:>22}")
        print(f"{label:26}" + "".join(cells))
    print("stalls, cycles per issued instruction (top 6 of each):")
    for n in names:
        top = list(result["stalls"][n].items())[:6]
        print(f"  {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in top))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", metavar="NAME=FILE",
                    help="an ncu raw page per run; the first is the baseline")
    ap.add_argument("--out", type=Path, help="write the comparison as JSON here")
    ap.add_argument("--source", action="store_true",
                    help="the inputs are ncu source pages (SASS with executed counts)")
    ap.add_argument("--per", type=float, default=1.0,
                    help="divide the source pages' counts by this (e.g. the key tiles run)")
    args = ap.parse_args(argv)
    if args.per <= 0:
        ap.error("--per must be positive")
    runs = {}
    try:
        for item in args.inputs:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise NcuError(f"{item}: expected NAME=FILE")
            try:
                text = Path(path).read_text(errors="replace")
            except OSError as e:
                raise NcuError(f"{path}: {e.strerror}") from None
            runs[name] = (parse_source(text, path, args.per) if args.source
                          else parse_raw(text, path))
    except NcuError as e:
        print(f"ncu_compare: {e}", file=sys.stderr)
        return 2
    if args.source:
        result = {"per": args.per, "runs": runs}
        print_source(runs)
    else:
        result = compare(runs)
        print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
