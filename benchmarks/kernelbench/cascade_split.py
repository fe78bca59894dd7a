"""``--cascade-split``: the split-form cascade's variants, whole and launch by launch, with
the bytes each launch must move."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernelbench.report import result_header, run_mode, save_titled
from benchmarks.kernelbench.setup import Setup, rel_err
from benchmarks.kernelbench.timing import check, measure
from forkserve.kernels.shared_prefix import (
    PREFIX_TUNING,
    cascade_residual_decode_triton,
    shared_prefix_decode_triton,
)

# The split-form cascade's variants timed by --cascade-split: name ->
# cascade_residual_decode_triton keywords, each naming its score buffer and value grid (the
# defaults moved in round 11). "two_pass": the round-10 form, float32 scores and the
# per-KV-head value grid (the errors' reference); "_fp16": the float16 score buffer;
# "_rowvalues": the value pass's row grid (one program per row and split over all heads);
# "two_pass_fp16_rowvalues" was the engine's default in rounds 11-13; all but "_pf" run
# without prefetch (the default since round 14).
# "tiled_a<agents>h<KV heads>_bn<keys>_w<warps>": variant="tiled_scores" at that tuning
# (residual_score_tiled.py; registers in docs/KERNELS.md), the first its default.
_ROUND10 = dict(score_dtype=torch.float32, value_grid="kv_head", prefetch=False)
_ROUND11 = dict(variant="two_pass", score_dtype=torch.float16, value_grid="row", prefetch=False)
CASCADE_SPLIT_VARIANTS: dict[str, dict] = {
    "two_pass": dict(variant="two_pass", **_ROUND10),
    "two_pass_fp16": dict(_ROUND10, variant="two_pass", score_dtype=torch.float16),
    "two_pass_rowvalues": dict(_ROUND10, variant="two_pass", value_grid="row"),
    "two_pass_fp16_rowvalues": _ROUND11,
    # The prefix launch at 16-key tiles: with float16 scores it spills at 32 (255 registers,
    # 48 B; --regs), not at 16 (221).
    "two_pass_fp16_rowvalues_pbn16": dict(_ROUND11, prefix_tuning=dict(block_n=16)),
    # Round 13: the prefix and suffix launches load each tile's scores a tile ahead (two-pass
    # decode's default since; its pass 2 went 1.4 -> 1.1x unified at batch 64); the engine's
    # default since round 14 (the call 0.8-1.7% faster at 8K / 32K x 32).
    "two_pass_fp16_rowvalues_pf": dict(_ROUND11, prefetch=True),
    "msc": dict(variant="msc", **_ROUND10),
    **{f"tiled_a{a}h{h}_bn{bn}_w{w}": dict(variant="tiled_scores", score_tuning=dict(
        agents=a, kv_heads=h, block_n=bn, num_warps=w), **_ROUND10)
       for a, h, bn, w in ((2, 1, 64, 8), (4, 1, 64, 8), (2, 2, 64, 8), (4, 1, 32, 8))},
    # Round 15: the tiled pass from the bf16 table (86 registers at 2 x 1 over 8 warps, was
    # 116), its suffixes on two-pass's batch 2-32 pass 1; float16 scores, row value grid.
    **{f"tiled16_a{a}h1_bn64_w8": dict(_ROUND11, variant="tiled_scores", score_tuning=dict(
        agents=a, kv_heads=1, block_n=64, num_warps=8, table16=True, suffix=dict(
            angle_add=False, block_n=64, prefetch=True, kv_heads=2)))
       for a in (2, 4)},
    # Pass 1 is the default form's largest launch since round 11: its tunings at the
    # default's buffers ("p1_" + residual_scores keywords; the default at batch 32 is
    # score_tuning_for's qfold at 64-key tiles over 4 warps).
    **{f"p1_{name}": dict(_ROUND11, score_tuning=tuning)
       for name, tuning in (
           ("round14", dict(form="qfold", angle_add=False, block_n=64, prefetch=True)),
           ("qfold_bn128_w8", dict(form="qfold", angle_add=False, block_n=128, num_warps=8)),
           ("qfold_bn64_w8", dict(form="qfold", angle_add=False, block_n=64, num_warps=8)),
           ("qfold_bn32_w4", dict(form="qfold", angle_add=False, block_n=32)),
           ("qfold_angleadd_bn64", dict(form="qfold", angle_add=True, block_n=64)),
           ("qfold_bn64_s3", dict(form="qfold", angle_add=False, block_n=64, num_stages=3)),
           ("keysm_bn64", dict(block_n=64, keys_m=True)),
       )},
}
# The split cascade's launches, in order (shared_prefix.CascadeLaunches).
SPLIT_PARTS = ("pass1", "prefix", "values", "suffix", "merge")


def split_part_bytes(s: Setup, keywords: dict, agents: int, prefix: int,
                     grids: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Bytes each launch of a split-cascade variant must move at least, from the tensors'
    shapes: every tensor it reads or writes once, the tile's shared base pages once per tile
    (as DRAM serves them when the agents' programs share them through L2). Not counted:
    q, B_k, B_v and the RoPE table (L2-resident, < 1%). ``grids``: the call's
    (``CascadeLaunches.grids``: the partials' split counts)."""
    rows, keys, suffix = agents * s.n_heads, prefix + s.split_suffix, s.split_suffix
    kv, res = s.n_kv * s.head_dim * s.k.element_size(), s.rank * s.k_res.element_size()
    tiles, pre_splits = grids["prefix"][0], grids["prefix"][2]
    splits = pre_splits + grids["suffix"][2]
    part = rows * (s.head_dim + 1) * 4  # one split slot: a float32 output row and its lse
    if keywords.get("variant") == "msc":
        score = rows * (keywords.get("score_tuning") or {}).get("dtype", torch.float32).itemsize
        return {
            "pass1": (tiles * prefix + agents * suffix) * kv + agents * keys * res + keys * score,
            "prefix": rows * pre_splits * 4 + tiles * prefix * kv + prefix * score
                      + pre_splits * part,
            "values": prefix * (score + agents * res) + rows * pre_splits * (4 + 8 * s.head_dim),
            "suffix": suffix * (agents * (kv + res) + score) + grids["suffix"][2] * part,
            "merge": splits * part + rows * s.head_dim * s.k.element_size(),
        }
    score = rows * keywords["score_dtype"].itemsize  # per key
    # float16 scores: a float32 block max per row, head and prefix key block
    block_max = (rows * 4 * -(-prefix // PREFIX_TUNING["block_n"])
                 if keywords["score_dtype"] != torch.float32 else 0)
    return {
        "pass1": keys * (agents * res + score),
        "prefix": rows * pre_splits * 4 + tiles * prefix * 2 * kv + 2 * prefix * score
                  + block_max + pre_splits * part,
        "values": prefix * (score + agents * res) + block_max
                  + rows * pre_splits * (4 + 8 * s.head_dim),
        "suffix": suffix * (agents * (2 * kv + res) + score) + grids["suffix"][2] * part,
        "merge": splits * part + rows * s.head_dim * s.k.element_size(),
    }


def run_cascade_split(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """Per (shared prefix, agents): the unified cascade (the floor), then every split-form
    variant whole and each of its launches alone (pass 1 as ``<variant>_pass1_ms`` too),
    with the bytes each must move, its GB/s and the launch grids; one tile as the engine
    fills a decode graph's (the agents, then -1 up to ``cascade_tile_agents``), each agent
    its own adapter and residual pages and a ``split_suffix``-key suffix. Errors against
    the two-pass cascade."""
    from forkserve.kernels import cascade_tile_agents
    from forkserve.kernels.shared_prefix import cascade_residual_launches
    from forkserve.kernels.split_kv import sm_count
    width_tile = cascade_tile_agents(s.n_heads // s.n_kv)
    for agents in s.split_agents:
        for ctx in s.split_prefixes:
            prefix_pages, total = ctx // s.page, ctx + s.split_suffix
            bt, rbt, _ = s.tables(agents, total)
            bt = bt.clone()
            # Every page holding a prefix key is shared (a prefix may end mid-page).
            bt[:, :-(-ctx // s.page)] = bt[0, :-(-ctx // s.page)]
            lens = torch.full((agents,), total, dtype=torch.int32, device=s.device)
            q, ad = s.q(agents), s.adapters(agents)
            seqs = torch.arange(width_tile, dtype=torch.int32, device=s.device)
            tiles = (torch.where(seqs < agents, seqs, -1).view(1, width_tile),
                     torch.full((1,), ctx, dtype=torch.int32, device=s.device),
                     torch.full((agents,), ctx, dtype=torch.int32, device=s.device))
            tag = f"split prefix={ctx} agents={agents}"
            row = {"prefix_ctx": ctx, "agents": agents, "suffix": s.split_suffix,
                   "sms": sm_count(s.device),
                   "unified_ms": measure(res, tag + " unified", lambda: shared_prefix_decode_triton(
                       q, s.k, s.v, bt, lens, prefix_pages, max_seq_len=total), s.smoke)}
            args = (q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, ad, s.inv_freq,
                    *tiles)
            outs = {}
            for name in res["split_variants"]:
                keywords = CASCADE_SPLIT_VARIANTS[name]
                whole = lambda kw=keywords: cascade_residual_decode_triton(  # noqa: E731
                    *args, max_seq_len=total, **kw)
                row[name + "_ms"] = measure(res, f"{tag} {name}", whole, s.smoke)
                outs[name] = check(res, f"{tag} {name} run", whole)
                time_split_parts(s, res, row, f"{tag} {name}", name, keywords, ctx, agents,
                                 lambda kw=keywords: cascade_residual_launches(
                                     *args, max_seq_len=total, **kw))
            for name, out in outs.items():
                row[name + "_rel_err"] = check(res, f"{tag} {name} check",
                                               lambda o=out: rel_err(o, outs["two_pass"]))
            res["cascade_split"].append(row)
            save()
            print(f"{tag}: unified {row['unified_ms']:.4f} ms | " + " | ".join(
                f"{n} {row[n + '_ms']:.4f} (p1 {row[n + '_pass1_ms']:.4f})"
                for n in res["split_variants"]), flush=True)


def time_split_parts(s: Setup, res: dict, row: dict, what: str, name: str, keywords: dict,
                     prefix: int, agents: int, build: Callable[[], object]) -> None:
    """Each launch of one split-cascade variant alone, by graph replay over the buffers a
    whole run filled first: ``<name>_parts_ms``, ``_parts_bytes`` (``split_part_bytes``),
    ``_parts_GBps``, ``_grids``; ``<name>_pass1_ms`` is the pass-1 part. The prefix launch
    writes its scores back and the value pass adds into the partials, so their replays
    drift in value, not in the bytes they move. Each part starts with L2 flushed (in the
    whole call the merge, say, reads partials still in L2): the parts sum above the whole."""
    try:
        calls = build()
        calls.run()
    except Exception as exc:
        res.setdefault("errors", []).append(f"{what} launches: {exc!r}"[:600])
        calls = None
    parts = {part: measure(res, f"{what} {part}", launch, s.smoke)
             for part, launch in (calls.launches if calls else ())}
    row[name + "_pass1_ms"] = parts.get("pass1", math.nan)
    row[name + "_parts_ms"] = parts
    if calls is None:
        return
    nbytes = split_part_bytes(s, keywords, agents, prefix, calls.grids)
    row[name + "_parts_bytes"] = nbytes
    row[name + "_parts_GBps"] = {p: nbytes[p] / ms / 1e6 for p, ms in parts.items()}
    row[name + "_grids"] = {p: list(g) for p, g in calls.grids.items()}


def print_cascade_split(res: dict) -> None:
    print(f"\n== {res['device']} {res['dtype']} commit {res['commit'][:10]}: split-form cascade "
          f"decode, one layer, ms whole / pass 1 alone; err vs two_pass; then each launch "
          f"alone, L2 flushed: ms (GB/s of the bytes it must move), the prefix and value "
          f"launches' grids")
    for r in res["cascade_split"]:
        print(f"prefix {r['prefix_ctx']:6d} agents {r['agents']:3d} suffix {r['suffix']:4d} | "
              f"unified cascade {r['unified_ms']:.4f}")
        for n in split_variants(res):
            print(f"    {n:22s} {r[n + '_ms']:8.4f} / {r[n + '_pass1_ms']:8.4f}  "
                  f"err {r.get(n + '_rel_err', math.nan):.1e}")
            parts, gbps = r.get(n + "_parts_ms", {}), r.get(n + "_parts_GBps", {})
            grids = r.get(n + "_grids", {})
            print("        " + " ".join(f"{p} {ms:.4f} ({gbps.get(p, math.nan):.0f})"
                                        for p, ms in parts.items())
                  + f" = {sum(parts.values()):.4f} | programs " + " ".join(
                      f"{p} {'x'.join(map(str, grids[p]))}={math.prod(grids[p])}"
                      for p in ("prefix", "values") if p in grids)
                  + f" on {r.get('sms', '?')} SMs")


def plot_cascade_split(res: dict, path: Path) -> None:
    """Per agent count: ms against the prefix length, whole (solid) and pass 1 (dashed) per
    variant, the unified cascade in black; last panel, at the largest agent count: per
    prefix length a bar per variant stacked by launch (each timed alone), the unified
    cascade's whole call a black line across its group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["cascade_split"]
    counts = sorted({r["agents"] for r in rows})
    panels = len(counts) + 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 5), squeeze=False)
    for ax, agents in zip(axes[0], counts):
        pts = sorted((r for r in rows if r["agents"] == agents), key=lambda r: r["prefix_ctx"])
        x = [r["prefix_ctx"] for r in pts]
        ax.plot(x, [r["unified_ms"] for r in pts], color="black", marker="o", label="unified")
        for i, n in enumerate(split_variants(res)):
            ax.plot(x, [r[n + "_ms"] for r in pts], color=f"C{i}", marker="o", label=n)
            ax.plot(x, [r[n + "_pass1_ms"] for r in pts], color=f"C{i}", marker="x",
                    linestyle="--", label=n + " pass 1")
        ax.set(xscale="log", yscale="log", xlabel="shared prefix (keys)", ylabel="ms (one layer)",
               title=f"{agents} agents, {pts[0]['suffix'] if pts else 0}-key suffixes")
        ax.legend(fontsize=6)
    plot_split_parts(axes[0][-1], [r for r in rows if counts and r["agents"] == counts[-1]],
                     split_variants(res))
    save_titled(fig, res, path, "split-form cascade: whole (-) and pass 1 (--); ")


def plot_split_parts(ax, rows: list[dict], names: list[str]) -> None:
    """Stacked bars of each variant's launches (one agent count), grouped by prefix length."""
    ticks, labels = [], []
    for g, r in enumerate(sorted(rows, key=lambda r: r["prefix_ctx"])):
        x0 = g * (len(names) + 1)
        ax.hlines(r["unified_ms"], x0 - 0.5, x0 + len(names) - 0.5, color="black",
                  label="unified cascade" if g == 0 else None)
        for j, n in enumerate(names):
            bottom = 0.0
            for k, part in enumerate(SPLIT_PARTS):
                ms = r.get(n + "_parts_ms", {}).get(part, math.nan)
                ax.bar(x0 + j, ms, bottom=bottom, color=f"C{k}",
                       label=part if g == 0 and j == 0 else None)
                bottom += ms
            ticks.append(x0 + j)
            ctx = r["prefix_ctx"]
            labels.append(f"{n} {f'{ctx // 1024}K' if ctx >= 1024 else ctx}")
    ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
    ax.set(ylabel="ms (each launch alone)",
           title=f"launch by launch, {rows[0]['agents'] if rows else 0} agents")
    ax.legend(fontsize=7)


def split_variants(res: dict) -> list[str]:
    """The variants a --cascade-split result ran (all of them before ``--split-variants``)."""
    return res.get("split_variants", list(CASCADE_SPLIT_VARIANTS))


def main_cascade_split(s: Setup, args: argparse.Namespace) -> dict:
    unknown = set(args.split_variants or ()) - set(CASCADE_SPLIT_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --split-variants {sorted(unknown)}; known: "
                         f"{', '.join(CASCADE_SPLIT_VARIANTS)}")
    names = (list(CASCADE_SPLIT_VARIANTS) if not args.split_variants else
             ["two_pass"] + [n for n in args.split_variants if n != "two_pass"])
    res = result_header(s, timing="CUDA graph replay, L2 flushed, median of CUDA events",
                        cascade_split=[], split_variants=names)
    return run_mode(res, args.out / "kernel_bench_cascade_split.json", "cascade split",
                    lambda save: run_cascade_split(s, res, save), plot_cascade_split,
                    print_cascade_split, plot_each=True)
