"""The ws residual prefill's consumer counted instruction by instruction, every launch the
bench measures, on the CPU (no GPU: the sm_90a build, ``forkserve.kernels.sm90_build``).

    python3 benchmarks/ws_prefill_sass.py --out benchmarks/results \\
        [--measured benchmarks/results/residual_prefill_v5.json]

Round 24 found the consumer issue-bound (docs/KERNELS.md): a key tile's time follows the
instructions its warps issue, ~8 cycles each at 8 x 64 over 8K. So a launch option can be
weighed before a GPU runs it. For each launch of ``residual_prefill_bench.WS_LAUNCHES``
this builds the kernel (output written directly), finds the consumer's main loop in the
SASS (the innermost loop holding a tile's wgmma and no global store) and counts what a tile
runs in steady state: the loop's basic blocks less the cold ones (``cold``: the split's
last tile zeroing its V rows, the mask of a tile crossing the diagonal under
``edge_masks``, the copy into ``rot`` of a program without an adapter). A ``pairs``
launch's loop holds two tiles. Prints a table (per launch: instructions a tile by class and
as a ratio to the default's), writes ``ws_prefill_sass.json`` and ``.png``; ``--measured``
puts a residual_prefill_bench run beside it, each launch's device time over the default's
at one case, so the model meets the measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

if __name__ == "__main__":  # before triton's import: the compiler refuses interpreted helpers
    os.environ.pop("TRITON_INTERPRET", None)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.residual_prefill_bench import WS_LAUNCHES  # noqa: E402
from forkserve.bench.output import add_out_argument, new_figure, save_figure, write_json  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.kernels.residual_prefill_gluon import WsPrefillLaunch, build_sm90a  # noqa: E402
from forkserve.kernels.sm90_build import ptxas_version, sass_sm90a  # noqa: E402

# Instruction classes, by SASS opcode (the part before the first dot); the rest is
# "uniform" (the uniform datapath's: mostly the wgmma descriptors) or "int/other".
CLASSES = {
    "fp32": ("FMUL", "FADD", "FFMA", "FMNMX", "FSEL", "FSETP"),
    "exp2": ("MUFU",),
    "bf16x2": ("HFMA2", "HMUL2", "HADD2"),
    "convert": ("F2FP", "PRMT", "F2F"),
    "wgmma": ("HGMMA", "WARPGROUP"),
    "smem/sync": ("LDS", "STS", "LDSM", "STSM", "BAR", "SYNCS", "MEMBAR", "FENCE", "SHFL"),
}
OTHER_UNIFORM, OTHER = "uniform", "int/other"
ALL_CLASSES = (*CLASSES, OTHER_UNIFORM, OTHER)
CASE = (8, 64, 8256)  # the --measured case: row 3's worst, 8 x 64 over 8K


@dataclass(frozen=True)
class TileCount:
    """One launch's consumer: instructions a key tile runs in steady state, by class
    (per thread: a 64-row launch's thread has twice a 128-row one's share of a tile)."""

    launch: str
    rows: int
    per_tile: float
    by_class: dict[str, float]
    loop_instructions: int
    tiles_per_iteration: int


def opcode(line: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", line).split()[0].split(".")[0]


def op_class(op: str) -> str:
    for name, ops in CLASSES.items():
        if op in ops:
            return name
    return OTHER_UNIFORM if op.startswith("U") or op == "R2UR" else OTHER


def parse(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines())
            if m]


def branch_target(text: str) -> int | None:
    m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def main_loop(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The innermost loop (a backward branch's span) with a tile's wgmma and no global store:
    the consumer's; the epilogue's and the loader's loops fail one test or the other."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        target = branch_target(text)
        if target is not None and target < a and target in at:
            body = ins[at[target]:i + 1]
            ops = Counter(opcode(t) for _, t in body)
            if ops["HGMMA"] >= 15 and ops["STG"] == 0:
                loops.append(body)
    if not loops:
        raise ValueError("no consumer loop in the SASS (a tile's wgmma, no global store)")
    return min(loops, key=len)


def blocks(body: list[tuple[int, str]], targets: set[int]) -> list[Counter]:
    out, cur = [], Counter()
    for a, text in body:
        if a in targets and cur:
            out.append(cur)
            cur = Counter()
        cur[opcode(text)] += 1
        if branch_target(text) is not None:
            out.append(cur)
            cur = Counter()
    if cur:
        out.append(cur)
    return out


def cold(block: Counter) -> bool:
    """A block steady-state tiles skip: the V rows zeroed past a split's end (selects over
    unpacked bf16), the edge-only mask (selects, no softmax), the no-adapter copy (four
    ldmatrix and four stmatrix alone)."""
    zeroing = block["SEL"] >= 16 and block["PRMT"] >= 16
    edge_mask = block["FSEL"] >= 64 and block["FMNMX"] == 0 and block["HGMMA"] == 0
    copy = (block["LDSM"] == 4 and block["STSM"] == 4 and block["HGMMA"] == 0
            and sum(block.values()) < 20)
    return zeroing or edge_mask or copy


def count(launch: WsPrefillLaunch, sass: str) -> TileCount:
    ins = parse(sass)
    body = main_loop(ins)
    targets = {t for _, text in ins if (t := branch_target(text)) is not None}
    hot = Counter()
    for block in blocks(body, targets):
        if not cold(block):
            hot += block
    tiles = 2 if launch.pairs else 1
    by_class = Counter()
    for op, n in hot.items():
        by_class[op_class(op)] += n / tiles
    return TileCount(launch.name, launch.rows, sum(hot.values()) / tiles,
                     dict(by_class.most_common()), len(body), tiles)


def measured_ratios(path: Path) -> dict[str, float]:
    """Each launch's device time over the default launch's at ``CASE`` in a
    residual_prefill_bench result (``residual_<launch>`` columns)."""
    doc = json.loads(path.read_text())
    row = next((r for r in doc["rows"] if (r["batch"], r["new"], r["keys"]) == CASE), None)
    if row is None:
        raise ValueError(f"{path}: no {CASE[0]} x {CASE[1]} over {CASE[2]} row")
    device = {n.removeprefix("residual_"): ms for n, ms in row["device"].items()}
    default = WsPrefillLaunch().name
    if default not in device:
        raise ValueError(f"{path}: no {default} column at that case")
    return {n: ms / device[default] for n, ms in device.items() if n.startswith("ws_m")}


def plain_counts(counts: list[TileCount]) -> dict[int, float]:
    """Per row count, the plain launch's (no option) instructions a tile: what a launch's
    ratio is against (a 64-row program does half the rows of a 128-row one)."""
    return {c.rows: c.per_tile for c in counts if c.launch == WsPrefillLaunch(c.rows).name}


def print_table(counts: list[TileCount], measured: dict[str, float]) -> None:
    plain = plain_counts(counts)
    head = f"{'launch':32s} {'a tile':>7s} {'x plain':>8s} " + " ".join(
        f"{c:>9s}" for c in ALL_CLASSES)
    if measured:
        head += f" {'measured':>9s}"
    print(head)
    for c in counts:
        cells = " ".join(f"{c.by_class.get(k, 0):9.0f}" for k in ALL_CLASSES)
        line = f"{c.launch:32s} {c.per_tile:7.0f} {c.per_tile / plain[c.rows]:8.2f} {cells}"
        if measured:
            line += f" {measured.get(c.launch, float('nan')):9.2f}"
        print(line)


def plot(counts: list[TileCount], measured: dict[str, float], path: Path) -> None:
    fig, (ax,) = new_figure(1, width=11, height=5)
    names = [c.launch.removeprefix("ws_") for c in counts]
    bottom = [0.0] * len(counts)
    for k in ALL_CLASSES:
        values = [c.by_class.get(k, 0.0) for c in counts]
        ax.bar(names, values, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    default = plain_counts(counts)[WsPrefillLaunch().rows]
    if measured:
        ax.plot(names, [measured.get(c.launch, float("nan")) * default for c in counts], "kD",
                label="measured time x default's count (8 x 64 over 8K)")
    ax.set_ylabel("SASS instructions a key tile (consumer thread)")
    ax.set_title("ws residual prefill: the consumer's instructions a tile, sm_90a build")
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=8, ncols=2)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(ap)
    ap.add_argument("--measured", type=Path,
                    help="a residual_prefill_bench JSON to put beside the counts")
    ap.add_argument("--launches", nargs="+", metavar="NAME",
                    help="only these launches (WsPrefillLaunch.name), beside the plain one "
                         "of each row count")
    args = ap.parse_args(argv)
    launches = [WsPrefillLaunch(*flags) for flags in WS_LAUNCHES]
    if args.launches:
        unknown = set(args.launches) - {lc.name for lc in launches}
        if unknown:
            ap.error(f"unknown launch {sorted(unknown)[0]}; the bench's: "
                     + ", ".join(lc.name for lc in launches))
        rows = {lc.rows for lc in launches if lc.name in args.launches}
        launches = [lc for lc in launches if lc.name in args.launches
                    or (lc == WsPrefillLaunch(lc.rows) and lc.rows in rows)]
    try:
        measured = measured_ratios(args.measured) if args.measured else {}
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    counts = []
    for i, launch in enumerate(launches, 1):
        ptx, _ = build_sm90a(launch, direct=True)
        counts.append(count(launch, sass_sm90a(ptx)))
        print(f"[{i}/{len(launches)}] {launch.name}: {counts[-1].per_tile:.0f} a tile",
              flush=True)
    print_table(counts, measured)
    import triton

    write_json(args.out / "ws_prefill_sass.json",
               {"commit": source_commit(), "triton": triton.__version__,
                "ptxas": ptxas_version(), "case": CASE, "measured": measured,
                "launches": [asdict(c) for c in counts]})
    plot(counts, measured, args.out / "ws_prefill_sass.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
