"""ResidualAttention prefill routes against the best unified prefill, per case (row 3 of
issue 15: residual / unified <= 1.3x).

    python benchmarks/residual_prefill_bench.py --out benchmarks/results   # on the H200
    python benchmarks/residual_prefill_bench.py --smoke --out /tmp/bench    # plumbing (CPU)

Per case (batch x new tokens over keys; Llama-3-8B heads, GQA 4, rank 16, bf16), each route
eager as the engine runs prefill (CUDA events, L2 flushed: ``kernelbench.timing.bench_eager``):

* unified: ``paged`` (our Triton kernel) and ``paged_flash`` (FlashAttention-4 through the
  block tables, where ``flash_support`` finds it, as the engine calls it): the baseline is
  the fastest. A unified route that raises at a case is left out of it, its error under the
  row's ``errors``;
* residual: ``ws`` (residual_prefill_gluon.py, sm_90 only; ``ws_m<rows>_s<stages>`` each
  launch, ``_edge`` with ``edge_masks``, ``_base`` with ``base_scores``, ``ws_base_only``
  the default launch with no row's adapter: the residual's share of its time;
  ``wide_m<rows>_r<regs>_c<chunk>`` each launch of the 128-key kernel,
  residual_prefill_wide.py, and ``wide_base_only`` its default with no row's adapter),
  ``fused`` (the Triton kernel at its default launch) and ``flash`` (the context rebuilt
  and packed, then the varlen flash kernel), and the route ``DEFAULT_PREFILL_POLICY`` picks
  (``auto``, recorded as ``policy_route``);

and by CUDA-graph replay (device time, no launch cost) the routes a graph holds: the unified
ones, ``fused`` and every ``ws`` and ``wide`` launch, their graphs replayed in turn 50 times
(``kernelbench.timing.measure_interleaved``). Each ws kernel's output is checked
against the fused kernel's at every case (the tests' contexts stop near 4K).

``--warm-jobs N`` builds every case's Triton kernels in N processes at once before the timed
run (FA4's builds stay in it). Writes residual_prefill.json after every case (``--tag`` names
the file), a PNG of each route's time over the baseline's, and prints a table; and, where the
128-key kernel ran, the verdict on its launches (``wide_verdict``: the one
``default_launch`` should take at a program's rows, if any beat the ws default at every
case).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import astuple
from pathlib import Path
from typing import NamedTuple

# --smoke runs the kernels in Triton's interpreter, chosen before triton is first imported.
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.setup import Setup, rel_err  # noqa: E402
from benchmarks.kernelbench.timing import bench_eager, measure_interleaved, runs_once  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402

CASES = [(1, 64, 8256), (8, 64, 8256), (32, 16, 8208), (4, 64, 32832), (8, 512, 8704),
         (1, 4096, 4096)]
SMOKE_CASES = [(1, 8, 40), (2, 16, 48)]
# A 128-key launch whose output is further than this from the fused kernel's at a case
# (relative error) is not adopted, however fast: the CUDA tests' tolerance
# (tests/kernels/kernel_testlib.REL_TOL), which the bench can run ahead of.
MATCH_TOL = 2e-2
GOAL = 1.3
# The ws kernel's launches beside its default (rows, stages, edge_masks, base_scores,
# bf16_rope: WsPrefillLaunch; two slots, which lost to three everywhere in
# residual_prefill_v4.json, and round 25-26's pairs and late_pv, no faster and slower in
# residual_prefill_v5.json, are no longer measured).
WS_LAUNCHES = [(64, 3, False, False, False),
               (64, 3, True, True, True),
               (128, 3, False, False, False),
               (128, 3, True, False, False),
               (128, 3, False, True, False),
               (128, 3, True, True, False),
               (128, 3, True, True, True)]
# The 128-key kernel's launches (consumers, consumer registers, rebuild chunk, bf16_rope,
# pingpong, overlap, thread_arrive, early_loads, defer_stores, half_ahead, join:
# WideLaunch).
# Two consumers leave the rebuild 72 registers, where a chunk of 32 spills inside its loop;
# one leaves it 232, room for a chunk of a whole key half (64). Round 30 put thread_arrive
# beside round 29's launches (a consumer's tile then crosses 1 CTA barrier, not 4:
# docs/KERNELS.md "Round 30").
WIDE_LAUNCHES = [(2, 200, 16, False, False, False, False), (2, 200, 16, True, False, False, False),
                 (2, 200, 16, True, False, False, True), (2, 200, 16, True, True, False, True),
                 (1, 232, 32, True, False, False, False), (1, 232, 64, True, False, False, True),
                 (1, 232, 64, True, False, True, True),
                 # Round 32: the adopted launches with the rebuild's reads before its waits.
                 (2, 200, 16, True, True, False, True, True),
                 # Round 33: the rebuild's writes held to the end of a half (12 barriers a
                 # tile, not 18), its registers taken from the consumers' 200 (without
                 # early_loads the rebuild's loop spills).
                 (2, 184, 16, True, True, False, True, True, True),
                 # Round 34: round 33's with the next key half's first up-projection issued
                 # before the half's writes; its accumulator held there spills the
                 # rebuild's loop at 184 (6 instructions), the consumers' at 176 (16).
                 (2, 184, 16, True, True, False, True, True, True, True),
                 (2, 176, 16, True, True, False, True, True, True, True),
                 # Round 35: round 33's with the held chunks written two at a time (8
                 # barriers a tile, not 12), and a half at once (6) at 176 registers, where
                 # the rebuild's loop does not spill (at 184 it would, 49 instructions).
                 (2, 184, 16, True, True, False, True, True, True, False, 2),
                 (2, 176, 16, True, True, False, True, True, True, False, 4),
                 # Round 39: round 33's (the default) without deferred stores, the cos|sin read
                 # from global memory by the rebuild, then with the room that makes taken by a
                 # third key slot (the deep key ring: round 38's probe found the two-slot
                 # ring's coupling cost 13%). With deferred stores the rebuild's loop spills
                 # (15 local loads and stores a tile at 184): measured no faster, left out.
                 (2, 184, 16, True, True, False, True, True, False, False, 1, True),
                 (2, 184, 16, True, True, False, True, True, False, False, 1, True, 3),
                 # Measured: each 1.2-1.7x the default (H100). Read two or four chunks ahead
                 # (1.2-1.3x), or computed by the SFU (1.4-1.7x, H200), they stayed slower
                 # and were taken out again (docs/KERNELS.md "Round 39, measured").
                 # Round 40: the deep ring with the cos|sin made by angle addition from two
                 # small tables in shared memory (a warp's base row, 16 relative rows):
                 # 1.02-1.22x the default (H100 and H200), its math doubling the rebuild's.
                 (2, 184, 16, True, True, False, True, True, False, False, 1, True, 3, True),
                 # A 64-row launch last: the CUDA tests take the last one as that.
                 (1, 232, 64, True, False, False, True, True)]


def launch_table() -> dict:
    """Every launch the bench measures beside the default, by name: the ws kernel's and the
    128-key kernel's."""
    from forkserve.kernels.residual_prefill_gluon import WsPrefillLaunch
    from forkserve.kernels.residual_prefill_wide import WideLaunch

    launches = [*(WsPrefillLaunch(*flags) for flags in WS_LAUNCHES),
                *(WideLaunch(*flags) for flags in WIDE_LAUNCHES)]
    return {lc.name: lc for lc in launches}


class CaseRoutes(NamedTuple):
    """A case's routes, each a call on the case's inputs (name -> call), and what the timed
    run records beside them: the prefill calls' keywords, the flash kernels found and the
    kernels the policy may route to."""

    unified: dict
    residual: dict
    kw: dict
    flash: object
    found: object


def case_routes(s: Setup, batch: int, new: int, keys: int,
                skip: frozenset[str] = frozenset()) -> CaseRoutes:
    """The case's unified and residual routes (``CaseRoutes``)."""
    from forkserve.kernels import (
        PrefillCounts,
        flash_support,
        paged_prefill,
        prefill_kernels,
        residual_prefill,
    )
    from forkserve.kernels.residual_prefill_gluon import supports
    from forkserve.kernels.residual_prefill_wide import WideLaunch

    launches = {n: lc for n, lc in launch_table().items() if n not in skip}

    bt, rbt, lens = s.tables(batch, keys)
    q = s.q(batch * new)
    ad = s.adapters(batch)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=s.device)
    kw = dict(use_triton=True, counts=PrefillCounts((new,) * batch, (keys,) * batch))
    uni = (q, s.k, s.v, bt, lens, cu)
    res = (q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu, s.b_k, s.b_v, ad, s.inv_freq)
    flash = flash_support(q, s.k)
    found = prefill_kernels(q, s.k, s.k_res, flash)
    unified = {"paged": lambda: paged_prefill(*uni, variant="paged", **kw)}
    if flash.paged:
        unified["paged_flash"] = lambda: paged_prefill(*uni, variant="paged_flash", **kw)
    residual = {"fused": lambda: residual_prefill(*res, variant="fused", **kw),
                "flash": lambda: residual_prefill(*res, variant="flash", **kw),
                "auto": lambda: residual_prefill(*res, **kw)}
    # The kernel's own columns wherever it takes the shape, measured or not (the policy's
    # ``found`` routes to it at the measured shapes only).
    if supports(q, s.k, s.k_res):
        residual["ws"] = lambda: residual_prefill(*res, variant="ws", **kw)
        for name, launch in launches.items():
            residual[name] = lambda lc=launch: residual_prefill(*res, variant="ws", **kw,
                                                                launch=lc)
        # The same launch with no row's adapter: the kernel's skeleton (loads, base scores,
        # softmax, values) without the rebuild and the V residual, what the residual costs.
        no_adapter = torch.full_like(ad, -1)
        base_only = (*res[:11], no_adapter, res[12])
        residual["ws_base_only"] = lambda: residual_prefill(*base_only, variant="ws", **kw)
        if any(n.startswith("wide") for n in launches):
            residual["wide_base_only"] = lambda: residual_prefill(
                *base_only, variant="ws", **kw, launch=WideLaunch())
    return CaseRoutes(unified, residual, kw, flash, found)


# Routes the warm-up leaves to the timed run: FlashAttention-4's builds live in the process
# that made them (CuTe's cache), and ``auto`` is one of the others.
NOT_WARMED = ("paged_flash", "flash", "auto")


def warm_share(job: tuple[bool, int | None, frozenset[str], int, int]) -> list[str]:
    """One warm-up worker, in a process of its own (``smoke, group, skip, share, jobs``):
    at every case, each route whose place among the case's routes is ``share`` modulo
    ``jobs`` called once, so its kernels are built into the Triton cache the timed run reads
    (pools sized for the cases alone: the same specializations); the routes it called."""
    smoke, group, skip, share, jobs = job
    cases = SMOKE_CASES if smoke else CASES
    s = Setup(smoke, group=group, max_tokens=max(b * -(-k // 16) * 16 for b, _, k in cases))
    called = []
    for batch, new, keys in cases:
        case = case_routes(s, batch, new, keys, skip)
        routes = [(n, f) for n, f in (case.unified | case.residual).items()
                  if n not in NOT_WARMED]
        for name, f in routes[share::jobs]:
            f()
            called.append(f"{batch}x{new}/{keys} {name}")
    if not smoke:
        torch.cuda.synchronize()
    return called


def warm(smoke: bool, group: int | None, skip: frozenset[str], jobs: int) -> dict:
    """The cases' kernels built by ``jobs`` processes at once before the timed run, which
    would otherwise build them one after another inside it (several seconds each)."""
    import importlib
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # By the package's name, which a spawned process can import (this file may run as
    # __main__ or be loaded under another name).
    worker = importlib.import_module("benchmarks.residual_prefill_bench").warm_share
    if smoke:  # the workers' kernels in the interpreter too, whoever loaded this file
        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.perf_counter()
    called = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        shares = [ex.submit(worker, (smoke, group, skip, i, jobs)) for i in range(jobs)]
        for done, share in enumerate(as_completed(shares), 1):
            called += share.result()
            print(f"warm-up: [{done}/{jobs}] processes done, {len(called)} route calls, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    return {"jobs": jobs, "calls": len(called), "s": round(seconds, 1)}


def run_case(s: Setup, batch: int, new: int, keys: int, skip: frozenset[str] = frozenset()
             ) -> dict:
    from forkserve.kernels import DEFAULT_PREFILL_POLICY

    unified, residual, kw, flash, found = case_routes(s, batch, new, keys, skip)
    route = DEFAULT_PREFILL_POLICY.route(kw["counts"], True, found).value
    row: dict = {"batch": batch, "new": new, "keys": keys, "flash_kernel": flash.kernel,
                 "policy_route": route}
    # A library route may refuse a case (round 42: FA4's key splits, "SplitKV not supported
    # on SM 9.0"): the baseline is then the fastest of the rest, the refusal under the row's
    # errors, not a crashed run.
    unified = {n: f for n, f in unified.items() if runs_once(row, f"unified {n}", f)}
    row |= {"unified": {n: bench_eager(f, s.smoke) for n, f in unified.items()},
            "residual": {n: bench_eager(f, s.smoke) for n, f in residual.items()}}
    row["baseline"] = min(row["unified"], key=row["unified"].get)
    base = row["unified"][row["baseline"]]
    row["over_baseline"] = {n: ms / base for n, ms in row["residual"].items()}
    # Device time (CUDA-graph replay: no host launch cost) of the routes a graph can hold.
    device = {f"unified_{n}": f for n, f in unified.items()}
    device |= {f"residual_{n}": f for n, f in residual.items()
               if n.startswith(("ws", "wide", "fused"))}
    # Replayed in turn: the verdict reads ratios of launches within a few percent of each
    # other, and one after another a column met the clock the one before it left (round 33:
    # the default launch under two names, 0.99x-1.05x of itself).
    row["device"] = measure_interleaved(row, "device", device, s.smoke, rounds=50)
    best = min(v for n, v in row["device"].items()
               if n.startswith("unified_") and not math.isnan(v))
    row["device_over_best_unified"] = {n: v / best for n, v in row["device"].items()}
    if "ws" in residual:  # the kernel against the formula's other route, same inputs
        fused = residual["fused"]()
        row["ws_rel_err_vs_fused"] = rel_err(residual["ws"](), fused)
        # Each 128-key launch too: the tests' contexts stop near 4K, the cases here do not.
        row["wide_rel_err_vs_fused"] = {n: rel_err(f(), fused) for n, f in residual.items()
                                        if n.startswith("wide_m")}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tag", default="residual_prefill")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--skip-launches", nargs="+", default=[], metavar="NAME",
                    help="ws launches to leave out (one whose CUDA tests failed or hung)")
    ap.add_argument("--group", type=int, default=None,
                    help="query heads a KV head (default Llama-3-8B's 4; the ws kernel takes "
                         "1, 2, 4, 8)")
    ap.add_argument("--warm-jobs", type=int, default=0, metavar="N",
                    help="build the cases' kernels in N processes at once first (the Triton "
                         "cache then holds them); 0: built inside the timed run")
    args = ap.parse_args(argv)
    known = set(launch_table())
    if unknown := set(args.skip_launches) - known:
        ap.error(f"unknown ws launch {sorted(unknown)[0]}; the bench's: "
                 + ", ".join(sorted(known)))
    s = Setup(args.smoke, group=args.group)
    res: dict = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu",
                 "commit": source_commit(), "goal": GOAL,
                 "shape": {"n_heads": s.n_heads, "n_kv": s.n_kv, "head_dim": s.head_dim,
                           "rank": s.rank}, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.tag}.json"
    if args.warm_jobs > 0:
        res["warm"] = warm(args.smoke, args.group, frozenset(args.skip_launches),
                           args.warm_jobs)
    for batch, new, keys in SMOKE_CASES if args.smoke else CASES:
        res["rows"].append(run_case(s, batch, new, keys, frozenset(args.skip_launches)))
        path.write_text(json.dumps(res, indent=1))
        print(f"{batch}x{new}/{keys} done", flush=True)
    res["wide_verdict"] = wide_verdict(res)
    path.write_text(json.dumps(res, indent=1))
    print_table(res)
    plot(res, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def wide_verdict(res: dict) -> dict:
    """Per program rows (64, 128; keys ``"64"``, ``"128"``): the cases whose chunks take that
    many rows (``default_launch``), and for each 128-key launch of those rows its device
    time over the ``ws`` column's at each (the default launch of the run's commit) and its
    worst case over the best unified route's (``worst_over_unified``: what row 3 reads).
    ``adopt``: of the launches faster than the ws column at every such case by more than
    ``spread`` (the default launch's own column over the ws column, which runs the same
    kernel: how far the timing strays from 1 at these cases; 0 where the default is not a
    128-key launch the bench names), the one whose worst case over the best unified route
    is lowest, with the key ``[group, rows]`` and
    the ``WideLaunch`` fields of its ``residual_prefill_gluon.MEASURED_WIDE_LAUNCHES``
    entry; ``None`` where none is faster everywhere. A launch missing at a case (skipped,
    or no kernel there) is not judged; one whose output is off the fused kernel's by more
    than ``MATCH_TOL`` at a case is listed in ``wrong`` and not adopted."""
    from forkserve.kernels.residual_prefill_gluon import default_launch

    group = res["shape"]["n_heads"] // res["shape"]["n_kv"]
    table = launch_table()
    verdict = {}
    for rows in (64, 128):
        cases = [r for r in res["rows"] if default_launch(r["new"], group).rows == rows]
        default = default_launch(cases[0]["new"], group).name if cases else None
        over, over_unified = {}, {}
        for name, launch in table.items():
            col = f"residual_{name}"
            times = [(r["device"].get(col), r["device"].get("residual_ws")) for r in cases]
            if (name.startswith("wide_m") and launch.rows == rows and cases
                    and all(t and ws for t, ws in times)):
                over[name] = [t / ws for t, ws in times]
                over_unified[name] = max(r["device_over_best_unified"][col] for r in cases)
        wrong = sorted({n for r in cases for n, e in r.get("wide_rel_err_vs_fused", {}).items()
                        if n in over and not e <= MATCH_TOL})
        spread = max((abs(x - 1.0) for x in over.get(default, [])), default=0.0)
        faster = [n for n in over if max(over[n]) < 1.0 - spread and n not in wrong]
        adopt = min(faster, key=over_unified.get, default=None)
        verdict[str(rows)] = {
            "cases": [f"{r['batch']}x{r['new']}/{r['keys']}" for r in cases],
            "over_default": over, "worst": {n: max(v) for n, v in over.items()},
            "worst_over_unified": over_unified, "wrong": wrong, "spread": spread,
            "adopt": adopt,
            "key": [group, rows] if adopt else None,
            "fields": list(astuple(table[adopt])) if adopt else None}
    return verdict


def print_table(res: dict) -> None:
    names = sorted({n for r in res["rows"] for n in r["residual"]})
    print(f"\n{res['device']}, commit {res['commit']}: prefill eager, ms; residual routes "
          f"as x the best unified (goal <= {res['goal']}x)")
    print(f"{'case':>14s} {'baseline':>22s} " + " ".join(f"{n:>16s}" for n in names))
    for r in res["rows"]:
        base = f"{r['baseline']} {r['unified'][r['baseline']]:.3f}"
        cells = [f"{r['residual'][n]:7.3f} ({r['over_baseline'][n]:4.2f}x)"
                 if n in r["residual"] else "-" for n in names]
        label = f"{r['batch']}x{r['new']}/{r['keys']}"
        print(f"{label:>14s} {base:>22s} " + " ".join(f"{c:>16s}" for c in cells))
    print("device time (graph replay), x the best unified:")
    for r in res["rows"]:
        label = f"{r['batch']}x{r['new']}/{r['keys']}"
        print(f"{label:>14s} " + " ".join(f"{n}={ms:.3f} ({r['device_over_best_unified'][n]:.2f}x)"
                                          for n, ms in r["device"].items()))
    errs = [r for r in res["rows"] if "ws_rel_err_vs_fused" in r]
    if errs:
        print("the ws kernels' outputs against the fused kernel's (relative error):")
    for r in errs:
        label = f"{r['batch']}x{r['new']}/{r['keys']}"
        cells = {"ws": r["ws_rel_err_vs_fused"], **r.get("wide_rel_err_vs_fused", {})}
        print(f"{label:>14s} " + " ".join(f"{n}={e:.1e}" for n, e in cells.items()))
    for rows, v in res.get("wide_verdict", {}).items():
        if not v["worst"]:
            continue
        print(f"128-key launches of {rows} rows over the ws default, worst of "
              f"{', '.join(v['cases'])}: "
              + " ".join(f"{n}={w:.2f}x" for n, w in sorted(v["worst"].items(),
                                                           key=lambda x: x[1])))
        print("  worst over the best unified: " + " ".join(
            f"{n}={w:.2f}x" for n, w in sorted(v["worst_over_unified"].items(),
                                               key=lambda x: x[1])))
        print(f"  adopt at {rows} rows: " + (
            f"{v['adopt']}: MEASURED_WIDE_LAUNCHES[{tuple(v['key'])}] = {tuple(v['fields'])}"
            if v["adopt"] else "none (none faster at every case)")
            + f"; the timing's spread here {v['spread']:.3f} (the default under its own name)")
        if v["wrong"]:
            print(f"  not adopted, output off the fused kernel's by more than {MATCH_TOL}: "
                  + " ".join(v["wrong"]))


def plot(res: dict, path: Path) -> None:
    """Two panels, each route a bar a case, over the best unified route: device time (graph
    replay) of the routes a graph holds, which row 3 reads, and every route eagerly."""
    try:
        import matplotlib

        from forkserve.bench.output import legend_below, new_figure, save_figure
        matplotlib.use("Agg")
    except ImportError:
        return
    labels = [f"{r['batch']}x{r['new']}/{r['keys']}" for r in res["rows"]]
    eager = sorted({n for r in res["rows"] for n in r["residual"]})
    device = sorted({n for r in res["rows"] for n in r["device"] if n.startswith("residual_")})
    names = sorted(set(eager) | {n.removeprefix("residual_") for n in device})
    colors = dict(zip(names, [*matplotlib.colormaps["tab20"].colors,
                              *matplotlib.colormaps["tab20b"].colors], strict=False))
    fig, (ax_d, ax_e) = new_figure(2, width=16, height=6)
    panels = ((ax_d, [n.removeprefix("residual_") for n in device], "device_over_best_unified",
               "residual_", "device time (graph replay)"),
              (ax_e, eager, "over_baseline", "", "eager, as the engine runs prefill"))
    for ax, shown, key, prefix, what in panels:
        width = 0.8 / max(len(shown), 1)
        for i, name in enumerate(shown):
            ax.bar([j + i * width for j in range(len(labels))],
                   [r.get(key, {}).get(prefix + name, 0.0) for r in res["rows"]], width,
                   label=name, color=colors[name])
        ax.axhline(res["goal"], color="r", lw=0.8, ls="--", label=f"goal {res['goal']}x")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=8)
        ax.set_ylabel("time / the best unified route's (lower is faster)")
        ax.set_title(what, fontsize=10)
    legend_below(fig, ax_e, max_cols=5)
    fig.suptitle(f"ResidualAttention prefill routes, {res['device']}, {res['commit'][:8]}")
    save_figure(fig, path, quiet=True)


if __name__ == "__main__":
    raise SystemExit(main())
