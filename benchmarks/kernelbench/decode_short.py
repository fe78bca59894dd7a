"""``--decode-short``: unified decode of short sequences in narrow and wide tables, the
static split plan against the dynamic one, its split counts and tiles."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernelbench.report import result_header, run_mode, save_titled
from benchmarks.kernelbench.setup import Setup, copy_bandwidth, rel_err
from benchmarks.kernelbench.timing import check, measure
from forkserve.kernels import reference
from forkserve.kernels.decode_attention import paged_decode_triton

# --decode-short: unified decode of short sequences (decode_bench's prompt 512 and up) in
# tables as wide as their keys and as a wide decode graph's (8K / 32K), the static split plan
# of before against the dynamic one (decode_attention.paged_decode_triton ``plan``), and the
# dynamic plan at forced split counts: which count the H200 wants per batch and length.
SHORT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
# ... and the dynamic plan at other (key tile, warps, pipeline stages) than the default
# (64, 4, 2): at 512 keys x batch 64 each program walks nine tiles with one load ahead
# (2.8 TB/s on the H200, round 8), where more stages keep more loads in flight.
SHORT_TILES = ((64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (128, 8, 2), (128, 8, 3),
               (64, 8, 3))


def short_table(s: Setup, batch: int, keys: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled pages for ``batch`` x ``keys`` in a table ``width`` keys wide, padded with the
    pool's last page (outside the shuffled ones: a decode graph's scratch page), and lens."""
    bt, _, lens = s.tables(batch, keys)
    pages = max(bt.shape[1], -(-width // s.page))
    if pages > bt.shape[1]:
        pad = torch.full((batch, pages - bt.shape[1]), s.k.shape[0] - 1, dtype=bt.dtype,
                         device=bt.device)
        bt = torch.cat([bt, pad], dim=1).contiguous()
    return bt, lens


def short_cases(s: Setup) -> list[tuple[int, int, int]]:
    """(keys, table width in keys, batch): widths of 0 mean the keys' own."""
    cases = []
    for keys in s.short_keys:
        widths = sorted({w if w else keys for w in s.short_widths if not w or w >= keys})
        for width in widths:
            for batch in s.short_batches:
                cases.append((keys, width, batch))
    return cases


def live_splits(keys: int, splits: int, block_n: int) -> int:
    """Splits of the dynamic plan that hold keys for a ``keys``-long sequence (the kernel's
    ``DYN_SPLIT`` split: ``keys / splits`` rounded up to whole ``block_n`` tiles)."""
    per = -(-keys // splits)
    split_len = -(-per // block_n) * block_n
    return -(-keys // split_len)


def run_decode_short(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """One row per case (``save`` after each): the static plan's splits and time, the
    dynamic plan's, the dynamic plan forced to each count of ``SHORT_SWEEP`` that a
    sequence's keys can fill, achieved TB/s (K+V bytes read / time), and the outputs
    checked against each other (and the float32 reference where the table is not wide)."""
    from forkserve.kernels.split_kv import dynamic_splits, plan_splits, sm_count
    tuning = {"block_n": 16} if s.smoke else {}
    block_n = tuning.get("block_n", 64)
    per_key = 2 * s.n_kv * s.head_dim * s.k.element_size()
    res["decode_short_tuning"] = {"block_n": block_n, "num_warps": 4, "num_stages": 2}
    for keys, width, batch in short_cases(s):
        bt, lens = short_table(s, batch, keys, width)
        bound = bt.shape[1] * s.page
        q = s.q(batch)
        n_programs = batch * s.n_kv
        old_splits, old_len = plan_splits(n_programs, bound, s.device, block_n)
        new_splits = dynamic_splits(n_programs, bound, sm_count(s.device), block_n)

        def run(plan: str, splits: int | None = None) -> torch.Tensor:
            return paged_decode_triton(q, s.k, s.v, bt, lens, max_seq_len=bound, plan=plan,
                                       num_splits=splits, **tuning)

        tag = f"decode-short keys={keys} width={bound} batch={batch}"
        kv_bytes = batch * keys * per_key
        row: dict = {"keys": keys, "width": bound, "batch": batch, "kv_bytes": kv_bytes,
                     "old_splits": old_splits, "old_split_len": old_len,
                     "old_programs": old_splits * n_programs, "new_splits": new_splits,
                     "new_programs": new_splits * n_programs,
                     "new_live_splits": live_splits(keys, new_splits, block_n)}
        row["old_ms"] = measure(res, tag + " old", lambda: run("static"), s.smoke)
        row["new_ms"] = measure(res, tag + " new", lambda: run("dynamic"), s.smoke)
        row["old_TBps"] = kv_bytes / row["old_ms"] / 1e9
        row["new_TBps"] = kv_bytes / row["new_ms"] / 1e9
        row["new_over_old"] = row["new_ms"] / row["old_ms"]
        sweep = {}
        for n in (SHORT_SWEEP[:2] if s.smoke else SHORT_SWEEP):
            if n > -(-keys // block_n):
                break  # more splits than key tiles: only empty programs more
            sweep[str(n)] = (row["new_ms"] if n == new_splits else
                             measure(res, f"{tag} splits={n}", lambda n=n: run("dynamic", n),
                                     s.smoke))
        row["sweep_ms"] = sweep
        if sweep:
            best = min(sweep, key=lambda n: sweep[n] if sweep[n] == sweep[n] else math.inf)
            row["best_splits"], row["best_ms"] = int(best), sweep[best]
        tiles = {}
        for bn, warps, stages in (SHORT_TILES[:1] if s.smoke else SHORT_TILES):
            cfg = dict(block_n=16 if s.smoke else bn, num_warps=warps, num_stages=stages)
            tiles[f"bn{bn}_w{warps}_s{stages}"] = measure(
                res, f"{tag} tiles {cfg}", lambda cfg=cfg: paged_decode_triton(
                    q, s.k, s.v, bt, lens, max_seq_len=bound, plan="dynamic", **cfg), s.smoke)
        row["tiles_ms"] = tiles
        row["tiles_over_new"] = {k: v / row["new_ms"] for k, v in tiles.items()}
        row["new_rel_err_vs_old"] = check(res, tag + " check",
                                          lambda: rel_err(run("dynamic"), run("static")))
        if width == keys or s.smoke:
            # The reference upcasts the gathered K/V itself (not the whole pool).
            row["new_rel_err_vs_ref_fp32"] = check(res, tag + " check", lambda: rel_err(
                run("dynamic"), reference.paged_decode_ref(q.float(), s.k, s.v, bt, lens)))
        res["decode_short"].append(row)
        save()
        print(f"{tag} | old {old_splits}x{old_len} {row['old_ms']:.4f} ms "
              f"{row['old_TBps']:.2f} TB/s | new {new_splits} {row['new_ms']:.4f} ms "
              f"{row['new_TBps']:.2f} TB/s | new/old {row['new_over_old']:.2f} | best "
              f"{row.get('best_splits')} {row.get('best_ms', math.nan):.4f} ms | tiles/new "
              + " ".join(f"{k} {v:.2f}" for k, v in row["tiles_over_new"].items()), flush=True)


def print_decode_short(res: dict) -> None:
    print(f"\n== {res['device']} {res['dtype']} commit {res['commit'][:10]}: unified decode of "
          f"short sequences, static plan (old) vs dynamic (new); ms of one layer call "
          f"(copy {res.get('copy_GBps', math.nan):.0f} GB/s)")
    print(" keys  width batch | old splits x len       ms   TB/s | new splits       ms   TB/s "
          "| new/old | best splits       ms | err new-old  new-ref | best tiles / new")
    for r in res["decode_short"]:
        ratios = r.get("tiles_over_new") or {}
        tiles = min(ratios, key=ratios.get) if ratios else ""
        print(f"{r['keys']:5d} {r['width']:6d} {r['batch']:5d} | {r['old_splits']:4d} x "
              f"{r['old_split_len']:6d} {r['old_ms']:8.4f} {r['old_TBps']:6.2f} | "
              f"{r['new_splits']:10d} {r['new_ms']:8.4f} {r['new_TBps']:6.2f} | "
              f"{r['new_over_old']:7.2f} | {r.get('best_splits', 0):11d} "
              f"{r.get('best_ms', math.nan):8.4f} | {r.get('new_rel_err_vs_old', math.nan):.1e} "
              f"{r.get('new_rel_err_vs_ref_fp32', math.nan):.1e} | {tiles} "
              f"{ratios.get(tiles, math.nan):.2f}")


def plot_decode_short(res: dict, path: Path) -> None:
    """Per batch: ms (top) and TB/s (bottom) against keys, old (dashed) and new (solid) plan,
    one colour per table width class (keys, 8K, 32K)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["decode_short"]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 8), squeeze=False)

    def width_class(r: dict) -> str:
        return "width = keys" if r["width"] < 2 * r["keys"] else f"width {r['width'] // 1024}K"

    for col, batch in enumerate(batches):
        sub = [r for r in rows if r["batch"] == batch]
        classes = sorted({width_class(r) for r in sub})
        for i, cls in enumerate(classes):
            pts = sorted((r for r in sub if width_class(r) == cls), key=lambda r: r["keys"])
            keys = [r["keys"] for r in pts]
            for plan, style in (("old", "--"), ("new", "-")):
                for row_i, metric in enumerate(("ms", "TBps")):
                    axes[row_i, col].plot(keys, [r[f"{plan}_{metric}"] for r in pts],
                                          linestyle=style, marker="o", color=f"C{i}",
                                          label=f"{plan}, {cls}")
        axes[0, col].set(xscale="log", yscale="log", xlabel="keys per sequence",
                         ylabel="ms (one layer)", title=f"batch {batch}")
        axes[1, col].set(xscale="log", xlabel="keys per sequence", ylabel="K+V TB/s")
        axes[0, col].legend(fontsize=6)
    save_titled(fig, res, path,
                "unified decode, short sequences: static (--) vs dynamic (-) split plan; ")


def main_decode_short(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="CUDA graph replay (as the engine's decode), L2 flushed, median of CUDA events",
        decode_short=[])
    res["copy_GBps"] = copy_bandwidth(s) / 1e9
    return run_mode(res, args.out / "kernel_bench_decode_short.json", "decode short",
                    lambda save: run_decode_short(s, res, save), plot_decode_short,
                    print_decode_short, plot_each=True)
