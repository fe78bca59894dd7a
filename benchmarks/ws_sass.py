"""The ws kernels' consumers counted instruction by instruction, every launch the benches
measure, on the CPU (no GPU: the sm_90a build, ``forkserve.kernels.sm90_build``).

    python3 benchmarks/ws_sass.py prefill --out benchmarks/results \\
        [--measured benchmarks/results/residual_prefill_v5.json]
    python3 benchmarks/ws_sass.py decode --out benchmarks/results
    python3 benchmarks/ws_sass.py prefill_wide --out benchmarks/results
    python3 benchmarks/ws_sass.py decode --shape 8 16 --out benchmarks/results

Round 24 found the ws prefill's consumer issue-bound (docs/KERNELS.md): a key tile's time
follows the instructions its warps issue, ~8 cycles each at 8 x 64 over 8K. So a launch
option can be weighed before a GPU runs it. For each launch (the prefill's:
``residual_prefill_bench.WS_LAUNCHES``; the decode: its one form since round 27) this builds
the kernel (output written directly), finds the consumer's main loop in the SASS (the
innermost loop holding a tile's wgmma and no global store) and counts what a tile runs in
steady state: the loop's basic blocks less the cold ones (``cold``: the split's last tile
zeroing its V rows, the prefill's mask of a tile crossing the diagonal under
``edge_masks``, its copy into ``rot`` for a program without an adapter). Prints a table
(per launch: instructions and CTA barriers a tile, by class, and the ratio to the same
launch without options), writes ``ws_<kernel>_sass.json`` and ``.png``; ``--measured``
(prefill) puts a bench run beside it, each launch's time over the plain launch's at the
row's worst case, so the model meets the measurement (round 27 found it does not for the
prefill: docs/KERNELS.md "Round 27"). ``--shape GROUP RANK`` builds the decode at another
GQA group and rank than Llama-3-8B's 4 and 16 (``residual_decode_gluon.ws_shape``), into
``ws_decode_sass_g<GROUP>_r<RANK>``. ``prefill_wide`` counts the 128-key kernel
(residual_prefill_wide.py) three roles a launch: a consumer thread's tile (64 query rows x
128 keys, four times a 128-row ws launch's thread's share of a 64-key tile), the
rebuilding warp group's (``<launch>:rebuild``: a thread's share of the tile's keys) and
the loader warp's (``<launch>:loader``), and sums them on each of an SM's four warp
schedulers (``schedulers``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __name__ == "__main__":  # before triton's import: the compiler refuses interpreted helpers
    os.environ.pop("TRITON_INTERPRET", None)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.residual_prefill_bench import WIDE_LAUNCHES, WS_LAUNCHES  # noqa: E402
from benchmarks.sass_classes import ALL_CLASSES, op_class, opcode  # noqa: E402
from forkserve.bench.output import add_out_argument, new_figure, save_figure, write_json  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.kernels import (  # noqa: E402
    residual_decode_gluon,
    residual_prefill_gluon,
    residual_prefill_wide,
)
from forkserve.kernels.residual_prefill_gluon import WsPrefillLaunch  # noqa: E402
from forkserve.kernels.residual_prefill_wide import WideLaunch  # noqa: E402
from forkserve.kernels.sm90_build import ptxas_version, sass_sm90a  # noqa: E402


@dataclass(frozen=True)
class TileCount:
    """One launch's consumer: instructions a key tile runs in steady state, by class, and
    the CTA barriers among them (per thread: a 64-row prefill launch's thread has twice a
    128-row one's share of a tile). ``plain``: the same launch without options, which the
    ratio is against."""

    launch: str
    plain: str
    per_tile: float
    barriers: float
    by_class: dict[str, float]
    loop_instructions: int


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
    loops = [body for body, ops in _loops(ins) if ops["HGMMA"] >= 15 and ops["STG"] == 0]
    if not loops:
        raise ValueError("no consumer loop in the SASS (a tile's wgmma, no global store)")
    return min(loops, key=len)


def _loops(ins: list[tuple[int, str]]):
    """Every backward branch's span in ``ins`` and its opcode counts."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    for i, (a, text) in enumerate(ins):
        target = branch_target(text)
        if target is not None and target < a and target in at:
            body = ins[at[target]:i + 1]
            yield body, Counter(opcode(t) for _, t in body)


def rebuild_loop(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The 128-key kernel's rebuilding warp group's loop (residual_prefill_wide.py): of the
    loops with the up-projection's wgmma (N = its chunk: 4 a tile at a chunk of 64) and
    none of a consumer's ``N = 128`` score products, the innermost of those holding the
    most of them: an mbarrier wait's retry block, laid out at the function's end, jumps
    back into the middle of a tile and spans a part of it alone."""
    return _loop_with_most(
        ins, "HGMMA", lambda body, ops: ops["HGMMA"] >= 4 and ops["STG"] == 0
        and not any("HGMMA.64x128x" in t for _, t in body),
        "no rebuild loop in the SASS (the up-projection's wgmma alone)")


def loader_loop(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The 128-key kernel's loader warp's loop: the one with the most TMA copies (a tile's
    keys, values and cos|sin), the innermost of those (an mbarrier wait's retry block
    spans part of a tile)."""
    return _loop_with_most(ins, "UTMALDG", lambda body, ops: ops["UTMALDG"] > 0,
                           "no loader loop in the SASS (no TMA copy in a loop)")


def _loop_with_most(ins: list[tuple[int, str]], op: str,
                    accept: Callable[[list[tuple[int, str]], Counter], bool],
                    missing: str) -> list[tuple[int, str]]:
    """Of the loops ``accept`` takes, the one with the most ``op`` instructions, the
    shortest of those (a role's tile, not a retry block spanning part of it); ``missing``:
    the error where none is."""
    loops = [(-ops[op], len(body), body) for body, ops in _loops(ins) if accept(body, ops)]
    if not loops:
        raise ValueError(missing)
    return min(loops, key=lambda x: x[:2])[2]


def schedulers(counts: list[TileCount], launches: list) -> dict[str, dict[str, float]]:
    """The 128-key kernel's instructions a 128-key tile on each of an SM's four warp
    schedulers, per launch: warp ``w`` issues on scheduler ``w % 4``, so the rebuilding
    warp group (warps 0-3) and each consumer warp group put a warp on each, and the loader
    (warp 4, its group's other three idle) adds its tile to scheduler 0. The busiest one
    bounds a tile's time where the warps issue back to back."""
    per_tile = {c.launch: c.per_tile for c in counts}
    out = {}
    for lc in launches:
        if f"{lc.name}:loader" not in per_tile:
            continue
        each = per_tile[f"{lc.name}:rebuild"] + lc.consumers * per_tile[lc.name]
        out[lc.name] = {"scheduler_0": each + per_tile[f"{lc.name}:loader"],
                        "schedulers_1_3": each}
    return out


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
    zeroing = block["SEL"] >= 16 and block["PRMT"] >= 16 and block["HGMMA"] == 0
    edge_mask = block["FSEL"] >= 64 and block["FMNMX"] == 0 and block["HGMMA"] == 0
    copy = (block["LDSM"] == 4 and block["STSM"] == 4 and block["HGMMA"] == 0
            and sum(block.values()) < 20)
    return zeroing or edge_mask or copy


def count(name: str, plain: str, sass: str,
          loop: Callable[[list[tuple[int, str]]], list[tuple[int, str]]] = main_loop
          ) -> TileCount:
    """The steady-state tile of ``loop``'s loop in ``sass`` (one key tile an iteration; the
    consumer's by default)."""
    ins = parse(sass)
    body = loop(ins)
    targets = {t for _, text in ins if (t := branch_target(text)) is not None}
    hot = Counter()
    for block in blocks(body, targets):
        if not cold(block):
            hot += block
    by_class = Counter()
    for op, n in hot.items():
        by_class[op_class(op)] += n
    return TileCount(name, plain, sum(hot.values()), hot["BAR"], dict(by_class.most_common()),
                     len(body))


@dataclass(frozen=True)
class Kernel:
    """One ws kernel as this tool counts it: its launches, each one's launch without
    options, its sm_90a PTX, and each launch's time over the plain one's in a measured run
    (``--measured``) at ``case``."""

    name: str
    launches: tuple
    plain: Callable[[object], object]
    ptx: Callable[[object], str]
    measured: Callable[[Path], dict[str, float]]
    case: str
    roles: tuple = (("", main_loop),)  # (a name's suffix, the role's loop), each counted


def prefill_measured(path: Path) -> dict[str, float]:
    """Each launch's device time over the default launch's at 8 x 64 over 8K (row 3's worst)
    in a residual_prefill_bench result (its ``residual_<launch>`` columns)."""
    return _over_default(path, WsPrefillLaunch().name, "ws_m")


def wide_measured(path: Path) -> dict[str, float]:
    """As ``prefill_measured``, the 128-key kernel's launches over its default launch's."""
    return _over_default(path, WideLaunch().name, "wide_m")


def _over_default(path: Path, default: str, prefix: str) -> dict[str, float]:
    """The 8 x 64 over 8K row's device times of the launches named ``prefix...`` over the
    launch ``default``'s."""
    doc = json.loads(path.read_text())
    row = next((r for r in doc["rows"] if (r["batch"], r["new"], r["keys"]) == (8, 64, 8256)),
               None)
    if row is None:
        raise ValueError(f"{path}: no 8 x 64 over 8256 row")
    device = {n.removeprefix("residual_"): ms for n, ms in row["device"].items()}
    if default not in device:
        raise ValueError(f"{path}: no {default} column at that case")
    return {n: ms / device[default] for n, ms in device.items() if n.startswith(prefix)}


@dataclass(frozen=True)
class DecodeBuild:
    """The ws decode as a launch of this tool: one form since round 27 (round 26's options
    were measured, ``kernel_bench_decode_round26_deferred_sum.json``, and the winner kept)."""

    name: str = "ws"


def decode_measured(path: Path) -> dict[str, float]:
    raise ValueError("--measured is the prefill's: the decode has one form, nothing to weigh "
                     "it against")


PREFILL = Kernel(
    "prefill", tuple(WsPrefillLaunch(*flags) for flags in WS_LAUNCHES),
    lambda lc: WsPrefillLaunch(lc.rows),
    lambda lc: residual_prefill_gluon.build_sm90a(lc, direct=True)[0],
    prefill_measured, "8 x 64 over 8K")
DECODE = Kernel(
    "decode", (DecodeBuild(),), lambda lc: lc,
    lambda lc: residual_decode_gluon.build_sm90a(True)[0], decode_measured,
    "4K x 64")
WIDE = Kernel(
    "prefill_wide", tuple(WideLaunch(*flags) for flags in WIDE_LAUNCHES),
    lambda lc: WideLaunch(*next(f for f in WIDE_LAUNCHES if f[0] == lc.consumers)),
    lambda lc: residual_prefill_wide.build_sm90a(lc, direct=True)[0],
    wide_measured, "8 x 64 over 8K",
    (("", main_loop), (":rebuild", rebuild_loop), (":loader", loader_loop)))
KERNELS = {k.name: k for k in (PREFILL, DECODE, WIDE)}
DECODE_SHAPE = (4, 16)  # the GQA group and rank every build above is at


def ratios(counts: list[TileCount]) -> dict[str, float]:
    """Each launch's instructions a tile over its plain launch's."""
    per_tile = {c.launch: c.per_tile for c in counts}
    return {c.launch: c.per_tile / per_tile[c.plain] for c in counts}


def print_table(counts: list[TileCount], measured: dict[str, float]) -> None:
    ratio = ratios(counts)
    head = f"{'launch':32s} {'a tile':>7s} {'x plain':>8s} {'BAR':>5s} " + " ".join(
        f"{c:>9s}" for c in ALL_CLASSES)
    if measured:
        head += f" {'measured':>9s}"
    print(head)
    for c in counts:
        cells = " ".join(f"{c.by_class.get(k, 0):9.0f}" for k in ALL_CLASSES)
        line = (f"{c.launch:32s} {c.per_tile:7.0f} {ratio[c.launch]:8.2f} {c.barriers:5.1f} "
                f"{cells}")
        if measured:
            line += f" {measured.get(c.launch, float('nan')):9.2f}"
        print(line)


def plot(kernel: Kernel, counts: list[TileCount], measured: dict[str, float],
         path: Path) -> None:
    fig, (ax,) = new_figure(1, width=max(6.0, 1.1 * len(counts) + 2), height=5)
    names = [c.launch.removeprefix("ws_") for c in counts]
    bottom = [0.0] * len(counts)
    for k in ALL_CLASSES:
        values = [c.by_class.get(k, 0.0) for c in counts]
        ax.bar(names, values, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, (top, c) in enumerate(zip(bottom, counts, strict=True)):
        ax.annotate(f"{c.barriers:g} BAR", (x, top), ha="center", va="bottom", fontsize=7)
    if measured:
        per_tile = {c.launch: c.per_tile for c in counts}
        ax.plot(names, [measured.get(c.launch, float("nan")) * per_tile[c.plain]
                        for c in counts], "kD",
                label=f"measured time x the plain launch's count ({kernel.case})")
    ax.set_ylabel("SASS instructions a key tile (a thread of the role)")
    ax.set_title(f"ws residual {kernel.name}, sm_90a ({kernel.case}):\n"
                 "each counted role's instructions a tile (and its CTA barriers)", fontsize=10)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=8, ncols=2)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    add_out_argument(ap)
    ap.add_argument("--measured", type=Path,
                    help="prefill: a residual_prefill_bench result to put beside the counts")
    ap.add_argument("--launches", nargs="+", metavar="NAME",
                    help="only these launches (by name), beside each one's plain launch")
    ap.add_argument("--shape", nargs=2, type=int, metavar=("GROUP", "RANK"),
                    default=list(DECODE_SHAPE),
                    help="decode only: the GQA group and residual rank to build at")
    args = ap.parse_args(argv)
    kernel = KERNELS[args.kernel]
    shape = tuple(args.shape)
    stem = f"ws_{kernel.name}_sass"
    if shape != DECODE_SHAPE:
        if kernel is not DECODE:
            ap.error("--shape is the decode's: the prefill is built at GQA 4, rank 16 only")
        if not residual_decode_gluon.builds_for(*shape):
            ap.error(f"--shape {shape[0]} {shape[1]}: the ws decode is not built for it "
                     "(residual_decode_gluon.ws_shape)")
        kernel = replace(kernel, ptx=lambda lc: residual_decode_gluon.build_sm90a(
            True, *shape)[0], case=f"{kernel.case}, GQA {shape[0]}, rank {shape[1]}")
        stem += f"_g{shape[0]}_r{shape[1]}"
    launches = list(kernel.launches)
    if args.launches:
        unknown = set(args.launches) - {lc.name for lc in launches}
        if unknown:
            ap.error(f"unknown {kernel.name} launch {sorted(unknown)[0]}; the bench's: "
                     + ", ".join(lc.name for lc in launches))
        named = [lc for lc in launches if lc.name in args.launches]
        launches = [lc for lc in launches if lc in named or lc in map(kernel.plain, named)]
    try:
        measured = kernel.measured(args.measured) if args.measured else {}
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    counts = []
    for i, launch in enumerate(launches, 1):
        sass = sass_sm90a(kernel.ptx(launch))
        for suffix, loop in kernel.roles:
            counts.append(count(launch.name + suffix, kernel.plain(launch).name + suffix,
                                sass, loop))
            print(f"[{i}/{len(launches)}] {counts[-1].launch}: {counts[-1].per_tile:.0f} "
                  "a tile", flush=True)
    print_table(counts, measured)
    per_scheduler = schedulers(counts, launches) if kernel is WIDE else {}
    for name, load in per_scheduler.items():
        print(f"{name}: a tile issues {load['scheduler_0']:.0f} instructions on scheduler 0 "
              f"(the loader's), {load['schedulers_1_3']:.0f} on each other one")
    import triton

    write_json(args.out / f"{stem}.json",
               {"commit": source_commit(), "triton": triton.__version__,
                "ptxas": ptxas_version(), "kernel": kernel.name, "case": kernel.case,
                "shape": {"group": shape[0], "rank": shape[1]},
                "measured": measured, "launches": [asdict(c) for c in counts],
                **({"schedulers": per_scheduler} if per_scheduler else {})})
    plot(kernel, counts, measured, args.out / f"{stem}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
