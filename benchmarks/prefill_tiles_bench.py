"""The Triton prefill kernels' launch configurations per case: the engine's defaults against
the alternatives, so a default is chosen from the cases the engine meets, not from one.

    python benchmarks/prefill_tiles_bench.py --out benchmarks/results    # on the H200
    python benchmarks/prefill_tiles_bench.py --smoke --out /tmp/bench     # plumbing (CPU)

``kernel_bench.py --prefill`` tunes at one cold 4K prefill and times every route with the
winner, while the engine launches ``residual_prefill_triton`` / ``paged_prefill_triton``
with their defaults: the two can disagree, and did (H200, ``kernel_bench_prefill.json`` at
fe206fd: the fused residual route 0.61 ms tuned against 1.69 through the engine for 8 chunks
of 64 tokens over 8K). Per case (batch x new tokens over keys; Llama-3-8B heads, rank 16,
bf16) and kernel, each configuration eager, as the engine runs prefill (CUDA events, L2
flushed: ``kernelbench.timing.timed_median``), the default first. Writes prefill_tiles.json after
every case, prefill_tiles.png, prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# --smoke runs the kernels in Triton's interpreter, chosen before triton is first imported.
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.setup import Setup  # noqa: E402
from benchmarks.kernelbench.timing import bench_eager  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402

# None: the kernel's own default (what the engine launches).
CONFIGS = {
    "default": None,
    "m16_n64_w4": dict(block_m=16, block_n=64, num_warps=4, num_stages=2),
    "m16_n64_w8": dict(block_m=16, block_n=64, num_warps=8, num_stages=2),
    "m32_n64_w4": dict(block_m=32, block_n=64, num_warps=4, num_stages=2),
    "m32_n64_w8": dict(block_m=32, block_n=64, num_warps=8, num_stages=2),
    "m32_n32_w4": dict(block_m=32, block_n=32, num_warps=4, num_stages=2),
    "m64_n64_w8": dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
}
CASES = [(1, 1024, 1024), (1, 4096, 4096), (8, 64, 8256), (8, 512, 8704), (32, 16, 8208)]


def run_case(s: Setup, batch: int, new: int, keys: int) -> dict:
    from forkserve.kernels.prefill_attention import paged_prefill_triton, residual_prefill_triton
    bt, rbt, lens = s.tables(batch, keys)
    q = s.q(batch * new)
    ad = s.adapters(batch)
    cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=s.device)
    bounds = dict(max_q_len=new, max_seq_len=keys)
    row: dict = {"batch": batch, "new": new, "keys": keys, "unified": {}, "residual": {}}
    for name, cfg in CONFIGS.items():
        tiles = cfg or {}
        row["unified"][name] = bench_eager(lambda t=tiles: paged_prefill_triton(
            q, s.k, s.v, bt, lens, cu, **bounds, **t), s.smoke)
        row["residual"][name] = bench_eager(lambda t=tiles: residual_prefill_triton(
            q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu, s.b_k, s.b_v, ad, s.inv_freq,
            **bounds, **t), s.smoke)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = ap.parse_args(argv)
    s = Setup(args.smoke)
    cases = [(1, 32, 32), (2, 8, 40)] if args.smoke else CASES
    res: dict = {"device": torch.cuda.get_device_name() if not args.smoke else "cpu",
                 "commit": source_commit(), "configs": CONFIGS, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "prefill_tiles.json"
    for batch, new, keys in cases:
        res["rows"].append(run_case(s, batch, new, keys))
        path.write_text(json.dumps(res, indent=1))
        print(f"{batch}x{new}/{keys} done", flush=True)
    print_table(res)
    plot(res, path.with_suffix(".png"))
    return 0


def print_table(res: dict) -> None:
    print(f"\n{res['device']}, commit {res['commit']}: prefill kernels eager, ms (x default)")
    for kernel in ("unified", "residual"):
        print(f"{kernel:>14s} " + " ".join(f"{n:>18s}" for n in CONFIGS))
        for r in res["rows"]:
            base = r[kernel]["default"]
            cells = [f"{ms:8.3f} ({ms / base:4.2f}x)" for ms in r[kernel].values()]
            label = f"{r['batch']}x{r['new']}/{r['keys']}"
            print(f"{label:>14s} " + " ".join(f"{c:>18s}" for c in cells))


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from forkserve.bench.output import save_figure
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['batch']}x{r['new']}/{r['keys']}" for r in res["rows"]]
    width = 0.8 / len(CONFIGS)
    for ax, kernel in zip(axes, ("unified", "residual"), strict=True):
        for i, name in enumerate(CONFIGS):
            ax.bar([j + i * width for j in range(len(labels))],
                   [r[kernel][name] / r[kernel]["default"] for r in res["rows"]], width,
                   label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=8)
        ax.set_title(f"{kernel} prefill kernel")
        ax.set_ylabel("time / the default's (lower is faster)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Prefill launch configurations, {res['device']}, {res['commit'][:8]}")
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


if __name__ == "__main__":
    raise SystemExit(main())
