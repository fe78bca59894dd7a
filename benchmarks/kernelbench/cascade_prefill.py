"""``--cascade-prefill``: prefill chunks of a group over one shared prefix, the engine's
layer call ungrouped against grouped, and the prefix launch's tiles."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernelbench.prefill import engine_call, step_tensors
from benchmarks.kernelbench.report import result_header, run_mode, save_titled
from benchmarks.kernelbench.setup import Setup, rel_err
from benchmarks.kernelbench.timing import check, measure_eager

# --cascade-prefill: prefill chunks of a group over one shared prefix (32 agents each
# prefilling an observation over one context), one layer call of the engine's dispatch.
# Prefix-launch tiles timed beside it (kernel alone: ``kernels.cascade_prefill`` with
# ``prefix_tuning``), in query rows (tokens x padded GQA group), key block and warps: which
# tile the prefix launch wants (shared_prefix_prefill.PREFIX_ROWS / PREFIX_TUNING).
CASCADE_PREFIX_TILES: dict[str, tuple[int, int, int]] = {
    "r64_n64_w4": (64, 64, 4), "r128_n32_w8": (128, 32, 8), "r128_n64_w8": (128, 64, 8),
    "r256_n64_w8": (256, 64, 8),
}


def cascade_prefill_cases(s: Setup) -> list[tuple[int, int, int]]:
    """(shared prefix keys, members, new tokens per member) of --cascade-prefill."""
    return [(p, g, n) for p in s.cascade_prefixes for g in s.cascade_members
            for n in s.cascade_new]


def cascade_prefill_step(s: Setup, prefix: int, members: int, new: int,
                         tiles: bool = False) -> tuple[dict[str, Callable[[], torch.Tensor]],
                                                       dict]:
    """One attention layer call (``KernelAttention.forward``, page writes included) of
    ``members`` chunks of ``new`` tokens, each over the same ``prefix`` keys (the same
    pages, page-aligned, marked as one group) then its own pages: "ungrouped", the engine's
    dispatch as it was (``CostPrefillPolicy`` with cascade off: the route it picks, flash
    included); "ungrouped_paged", the same with the Triton paged route pinned; "grouped",
    ``FixedPrefillPolicy(cascade=True)``: the prefix once per group; with ``tiles``,
    "tile_<name>": the kernel alone with each of ``CASCADE_PREFIX_TILES`` for its prefix
    launch at the engine's split count, and the default tile unsplit. Returns the calls and
    the routes the engine's calls took (after one call), with that split count."""
    from forkserve import kernels
    from forkserve.backend.protocol import SharedPrefix
    shared = prefix // s.page
    own = -(-new // s.page)
    pages = s.perm[:shared + members * own]
    bt = torch.cat([pages[:shared].expand(members, shared),
                    pages[shared:].view(members, own)], dim=1).contiguous()
    keys = prefix + new
    lens = torch.full((members,), keys, dtype=torch.int32, device=s.device)
    cu = torch.arange(0, members * new + 1, new, dtype=torch.int32, device=s.device)
    tensors = step_tensors(s, bt, bt, members, new, keys)
    counts = kernels.PrefillCounts((new,) * members, (keys,) * members)
    ad = torch.full((members,), -1, dtype=torch.int32, device=s.device)
    marks = (SharedPrefix(0, shared),) * members
    policies = {"ungrouped": kernels.CostPrefillPolicy(cascade_prefix_ratio=None),
                "ungrouped_paged": kernels.FixedPrefillPolicy(),
                "grouped": kernels.FixedPrefillPolicy(cascade=True)}
    calls, routes = {}, {}
    for name, policy in policies.items():
        fn, attention = engine_call(s, tensors, bt, bt, lens, cu, ad, counts, False, policy,
                                    marks)
        fn()
        calls[name], routes[name] = fn, "+".join(sorted(attention.prefill_routes))
    group = [(tuple(range(members)), prefix)]
    splits = kernels.prefix_splits(group, counts.query_lens, s.n_heads, s.n_kv)
    routes["prefix_splits"] = splits
    if tiles:
        pad = 1 << (s.n_heads // s.n_kv - 1).bit_length()
        variants = {name: (tile, splits) for name, tile in CASCADE_PREFIX_TILES.items()}
        variants["r128_n64_w8_unsplit"] = (CASCADE_PREFIX_TILES["r128_n64_w8"], 1)
        for name, ((rows, block_n, warps), n) in variants.items():
            groups = kernels.prefill_groups(group, counts.query_lens, counts.seq_lens, bt, n)
            tuning = {"block_m": max(1, rows // pad), "block_n": block_n, "num_warps": warps}
            calls["tile_" + name] = lambda t=tuning, g=groups: kernels.cascade_prefill(
                tensors["q"], s.k, s.v, bt, lens, cu, g, use_triton=True, counts=counts,
                prefix_tuning=t)
    return calls, routes


def run_cascade_prefill(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """Per case (JSON saved after each): the three calls timed eagerly (a prefill step runs
    eagerly), grouped's output against ungrouped's."""
    for prefix, members, new in cascade_prefill_cases(s):
        tag = f"cascade prefill prefix={prefix} members={members} new={new}"
        calls, routes = cascade_prefill_step(s, prefix, members, new, tiles=True)
        row: dict = {"prefix": prefix, "members": members, "new": new,
                     "route_ungrouped": routes["ungrouped"], "route_grouped": routes["grouped"],
                     "prefix_splits": routes["prefix_splits"]}
        for name, fn in calls.items():
            row[name + "_ms"] = measure_eager(res, f"{tag} {name}", fn, s.smoke)
        row["ungrouped_over_grouped"] = row["ungrouped_ms"] / row["grouped_ms"]
        row["paged_over_grouped"] = row["ungrouped_paged_ms"] / row["grouped_ms"]
        row["grouped_rel_err_vs_ungrouped"] = check(
            res, tag + " check", lambda: rel_err(calls["grouped"](), calls["ungrouped"]()))
        tile_ms = {k[5:-3]: v for k, v in row.items() if k.startswith("tile_")}
        row["best_tile"] = min(tile_ms, key=tile_ms.get)
        row["best_tile_ms"] = tile_ms[row["best_tile"]]
        res["cascade_prefill"].append(row)
        save()
        print(f"{tag} | ungrouped({row['route_ungrouped']})={row['ungrouped_ms']:.3f} "
              f"paged={row['ungrouped_paged_ms']:.3f} grouped={row['grouped_ms']:.3f} ms | "
              f"ratio={row['ungrouped_over_grouped']:.2f} "
              f"err={row['grouped_rel_err_vs_ungrouped']:.1e} splits={row['prefix_splits']} "
              f"best tile {row['best_tile']}", flush=True)


def print_cascade_prefill(res: dict) -> None:
    print(f"cascade prefill, one attention layer call (eager ms; {res['dtype']}); ratio: "
          "ungrouped / grouped (> 1: grouping wins)")
    print(" prefix members  new | ungrouped (route)     paged  grouped | ratio paged/grp | err"
          "     | splits | best prefix tile (kernel alone)")
    for r in res["cascade_prefill"]:
        print(f"{r['prefix']:7d} {r['members']:7d} {r['new']:4d} | {r['ungrouped_ms']:8.3f} "
              f"({r['route_ungrouped']:6s}) {r['ungrouped_paged_ms']:8.3f} "
              f"{r['grouped_ms']:8.3f} | {r['ungrouped_over_grouped']:5.2f} "
              f"{r['paged_over_grouped']:5.2f} | {r['grouped_rel_err_vs_ungrouped']:.1e} | "
              f"{r['prefix_splits']:6d} | {r['best_tile']} {r['best_tile_ms']:.3f}")


def plot_cascade_prefill(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["cascade_prefill"]
    fig, axis = plt.subplots(figsize=(max(7, 0.6 * len(rows)), 5))
    x = range(len(rows))
    for i, key in enumerate(("ungrouped", "ungrouped_paged", "grouped")):
        axis.bar([j + (i - 1) * 0.27 for j in x], [r[key + "_ms"] for r in rows], 0.27,
                 label=key)
    axis.set_xticks(list(x), [f"{r['prefix']}\n{r['members']}x{r['new']}\n"
                              f"{r['ungrouped_over_grouped']:.2f}x" for r in rows], fontsize=7)
    axis.set(yscale="log", ylabel="ms (eager)",
             title="cascade prefill: prefix / members x new tokens / ungrouped over grouped")
    axis.legend(fontsize=7)
    save_titled(fig, res, path)


def main_cascade_prefill(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="eager (as the engine runs prefill), L2 flushed, median of CUDA events",
        cascade_prefill=[])
    return run_mode(res, args.out / "kernel_bench_cascade_prefill.json", "cascade prefill",
                    lambda save: run_cascade_prefill(s, res, save), plot_cascade_prefill,
                    print_cascade_prefill)
