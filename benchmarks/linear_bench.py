"""The decode step's projections: the skinny GEMM (``kernels/skinny_gemm.py``) against cuBLAS.

    python benchmarks/linear_bench.py --out benchmarks/results [--rows 1 64 32]
    python benchmarks/linear_bench.py --smoke --out /tmp/lb     # CPU, interpreter: plumbing

For each projection of the Llama-3-8B shape (qkv, o, gate_up with its SiLU, down, lm_head)
and each row count (a decode batch: its tile class is 16, 32 or 64 rows), one CUDA graph per
variant runs the projection over 32 distinct weights, as a step's 32 layers do (the lm_head
over 2), so no weight is read from L2; the graphs are replayed in turn (``timed_interleaved``)
and each variant's time is per projection. Variants: ``F.linear`` (cuBLAS; for gate_up,
``F.linear`` then the ``silu_mul`` kernel, what the model ran), and the skinny kernel at every
tile ``even_tiles`` proposes (pipeline depth 4, 4 warps), then the best of those at other
depths and 8 warps. Each tile's output is checked against ``F.linear``'s first.

``--fold``: each projection measured as a step that folds its glue into it calls it
(``Fusions(fold_norms)``): qkv, gate_up and the lm_head with their input's RMSNorm
(``skinny_mm(norm=)``, one split) against the norm kernel then cuBLAS, o and down with the
residual add (``residual=``) against cuBLAS then the add; their keys end in ``/norm`` or
``/add``.

Writes after every (projection, rows) point: ``linear_bench.json`` (ms, TB/s read, ratio to
cuBLAS, the roofline: the weight's bytes at the measured copy rate), ``skinny_tuning.json``
(per shape class the best tile where it beats cuBLAS by ``--margin``, else null: merge it
into ``forkserve/kernels/skinny_tuning.json`` to adopt it) and ``linear_bench.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.kernels.glue import silu_mul_triton  # noqa: E402
from forkserve.kernels.skinny_gemm import (  # noqa: E402
    ShapeKey,
    SkinnyTile,
    SkinnyTuning,
    block_m,
    even_tiles,
    skinny_mm,
)

# name -> (weight rows, K, silu): Llama-3-8B (hidden 4096, 32 / 8 heads of 128, MLP 14336).
LLAMA3_8B = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
             "gate_up": (28672, 4096, True), "down": (4096, 14336, False),
             "lm_head": (128256, 4096, False)}
SMOKE = {"qkv": (128, 512, False), "o": (128, 512, False), "gate_up": (128, 512, True)}
LAYERS = 32
# What each projection folds in when the step folds (``--fold``; ``model.py``).
FOLD_ROLE = {"qkv": "norm", "gate_up": "norm", "lm_head": "norm", "o": "add", "down": "add"}
EPS = 1e-5


def weights_for(rows: int, k: int, copies: int, device, dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(rows * 7 + k)
    return [(torch.randn(rows, k, generator=gen, device=device) / k ** 0.5).to(dtype)
            for _ in range(copies)]


class Call(NamedTuple):
    """One projection call as a decode step makes it: its rows, SiLU, and what it folds in
    ("", "norm": the RMSNorm of x by ``gamma``, "add": the residual ``r`` after it)."""
    x: torch.Tensor
    silu: bool
    fold: str
    gamma: torch.Tensor
    r: torch.Tensor | None
    norm: Callable  # the norm kernel the step runs where it does not fold

    def reference(self, w: torch.Tensor) -> torch.Tensor:
        """cuBLAS and the glue kernels around it: what the step runs unfolded."""
        y = F.linear(self.norm(self.x, self.gamma, EPS) if self.fold == "norm" else self.x, w)
        y = silu_mul_triton(y) if self.silu else y
        return self.r + y if self.fold == "add" else y

    def tiled(self, w: torch.Tensor, t: SkinnyTile) -> torch.Tensor:
        return skinny_mm(self.x, w, t, silu=self.silu,
                         norm=(self.gamma, EPS) if self.fold == "norm" else None,
                         residual=self.r if self.fold == "add" else None)


def runs_for(ws: list[torch.Tensor], call: Call, tiles: list[SkinnyTile]) -> dict:
    """Each variant as a callable over every weight (one graph each)."""
    def cublas():
        for w in ws:
            call.reference(w)

    def tiled(t: SkinnyTile):
        def run():
            for w in ws:
                call.tiled(w, t)
        return run

    return {"cublas": cublas} | {tile_name(t): tiled(t) for t in tiles}


def tile_name(t: SkinnyTile) -> str:
    return f"n{t.block_n}_k{t.block_k}_w{t.warps}_s{t.stages}" + (
        f"_x{t.split_k}" if t.split_k > 1 else "")


def max_error(call: Call, w: torch.Tensor, tile: SkinnyTile) -> float:
    """The tile's largest error against the unfolded call; inf where it does not launch (a
    pipeline deeper than the SM's shared memory)."""
    try:
        out = call.tiled(w, tile)
    except triton.runtime.errors.OutOfResources:
        return math.inf
    return (out.float() - call.reference(w).float()).abs().max().item()


def timed(runs: dict, smoke: bool) -> dict[str, float]:
    if smoke:  # the interpreter: one call each, for the plumbing
        out = {}
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            out[name] = (time.perf_counter() - t0) * 1e3
        return out
    from benchmarks.kernelbench.timing import timed_interleaved
    return timed_interleaved(runs, rounds=20)


def measure_point(res: dict, name: str, shape: tuple[int, int, bool], rows: int, sms: int,
                  device, dtype, smoke: bool, margin: float, fold: str = "",
                  norm: Callable | None = None) -> dict:
    """``fold``: the call folds its input's norm (by ``norm`` where unfolded) or the add."""
    n_rows, k, silu = shape
    n = n_rows // 2 if silu else n_rows
    key = ShapeKey(n, k, block_m(rows), silu, fold)
    copies = 1 if smoke else (2 if name == "lm_head" else LAYERS)
    ws = weights_for(n_rows, k, copies, device, dtype)
    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
    call = Call(x, silu, fold, (0.5 + torch.rand(k, device=device, generator=gen)).to(dtype),
                torch.randn(rows, n, device=device, generator=gen).to(dtype) if fold == "add"
                else None, norm)
    # Two bf16 ulps at the output's largest magnitude (a folded norm rounds elsewhere than the
    # norm kernel, so one-ulp differences at the largest outputs are expected), at least 0.05.
    tol = 0.05 * max(1.0, call.reference(ws[0]).float().abs().max().item() / 4)
    errors, first, more = {}, [], []
    # A folded norm runs in one split (each split would see part of a row's squares).
    for t in (t for t in even_tiles(key, sms, stages=(4,)) if fold != "norm" or t.split_k == 1):
        errors[tile_name(t)] = max_error(call, ws[0], t)
        if errors[tile_name(t)] <= tol:
            first.append(t)
    ms = timed(runs_for(ws, call, first), smoke)
    skinny = {n: v for n, v in ms.items() if n != "cublas" and math.isfinite(v)}
    if skinny:  # the best tile at other pipeline depths and warps
        best = next(t for t in first if tile_name(t) == min(skinny, key=skinny.get))
        more = [best._replace(stages=s) for s in (3, 5, 6)] + [best._replace(warps=8)]
        errors |= {tile_name(t): max_error(call, ws[0], t) for t in more}
        more = [t for t in more if errors[tile_name(t)] <= tol]
        ms |= {variant: v for variant, v in timed(runs_for(ws, call, more), smoke).items()
               if variant != "cublas"}
        skinny = {n: v for n, v in ms.items() if n != "cublas" and math.isfinite(v)}
    per = {n: v / copies for n, v in ms.items()}
    nbytes = n_rows * k * dtype.itemsize
    best_name = min(skinny, key=skinny.get) if skinny else None
    point = {"projection": name, "rows": rows, "key": key.text(), "weight_bytes": nbytes,
             "ms": per, "TBps": {n: nbytes / (v * 1e-3) / 1e12 for n, v in per.items()},
             "max_error": errors, "tolerance": tol, "best": best_name,
             "best_over_cublas": per[best_name] / per["cublas"] if best_name else None,
             "roofline_ms": nbytes / res["copy_bandwidth_Bps"] * 1e3
             if res.get("copy_bandwidth_Bps") else None}
    wins = best_name is not None and point["best_over_cublas"] <= 1 - margin
    point["adopted"] = best_name if wins else None
    point["adopted_tile"] = (list(next(t for t in first + more if tile_name(t) == best_name))
                             if wins else None)
    return point


def tuning_of(points: list[dict], device_name: str) -> SkinnyTuning:
    return SkinnyTuning({device_name: {
        ShapeKey.parse(p["key"]): SkinnyTile(*p["adopted_tile"]) if p["adopted_tile"] else None
        for p in points}})


def plot(points: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from forkserve.bench.output import save_figure
    labels = [f"{p['projection']}\nM={p['rows']}" for p in points]
    cub = [p["TBps"]["cublas"] for p in points]
    best = [p["TBps"][p["best"]] if p["best"] else 0.0 for p in points]
    fig, ax = plt.subplots(figsize=(max(6, len(points) * 0.9), 4))
    xs = range(len(points))
    ax.bar([i - 0.2 for i in xs], cub, 0.4, label="cuBLAS (F.linear)")
    ax.bar([i + 0.2 for i in xs], best, 0.4, label="skinny, best tile")
    roof = [p["weight_bytes"] / (p["roofline_ms"] * 1e-3) / 1e12 for p in points
            if p.get("roofline_ms")]
    if roof:
        ax.axhline(roof[0], color="k", ls="--", lw=1, label="device copy rate (read + write)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("weight TB/s")
    ax.set_title("Decode projections: weight read rate (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 32])
    ap.add_argument("--projections", nargs="+", default=list(LLAMA3_8B))
    ap.add_argument("--margin", type=float, default=0.02,
                    help="adopt a tile only where it is this much faster than cuBLAS")
    ap.add_argument("--fold", action="store_true",
                    help="each projection with the glue a folding step puts in it: the input's "
                         "RMSNorm (qkv, gate_up, lm_head) or the residual add (o, down)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    from decode_bench import copy_bandwidth
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16  # bf16 is wrong in the interpreter
    table = SMOKE if smoke else LLAMA3_8B
    shapes = {p: table[p] for p in args.projections if p in table}
    # The norm a step runs where it does not fold it: the model's (compiled on CUDA).
    from forkserve.backend.torch.fused import get_fusions, rms_norm
    norm = rms_norm if smoke else get_fusions(True, True).rms_norm
    sms = 4 if smoke else torch.cuda.get_device_properties(device).multi_processor_count
    device_name = "cpu" if smoke else torch.cuda.get_device_name(device)
    res = {"device": device_name, "sms": sms, "torch": torch.__version__,
           "dtype": str(dtype), "commit": source_commit(), "layers": LAYERS,
           "copy_bandwidth_Bps": None if smoke else copy_bandwidth(device, 2 << 30),
           "points": []}
    rows = [1, 32] if smoke else args.rows
    for name, shape in shapes.items():
        for m in rows:
            point = measure_point(res, name, shape, m, sms, device, dtype, smoke, args.margin,
                                  FOLD_ROLE.get(name, "") if args.fold else "", norm)
            res["points"].append(point)
            print(f"{point['key']:24s} {name:8s} M={m:3d} "
                  f"cuBLAS {point['ms']['cublas'] * 1e3:8.1f} us  "
                  f"best {point['best']} "
                  f"{point['ms'][point['best']] * 1e3 if point['best'] else math.nan:8.1f} us  "
                  f"x{point['best_over_cublas'] or math.nan:.3f}  adopted: {point['adopted']}",
                  flush=True)
            (out / "linear_bench.json").write_text(json.dumps(res, indent=1))
            (out / "skinny_tuning.json").write_text(
                json.dumps(tuning_of(res["points"], device_name).to_json(), indent=1))
            plot(res["points"], out / "linear_bench.png")


if __name__ == "__main__":
    main()
