"""What a new sequence length costs torch SDPA: the first call at a length against the next.

    python benchmarks/sdpa_shapes_bench.py --out benchmarks/results        # on the H200
    python benchmarks/sdpa_shapes_bench.py --tiny --out /tmp/bench          # plumbing on CPU

The cold prefill routes (``sdpa``, FRESH) call ``is_causal`` SDPA once per sequence at its
own length; a react run meets dozens of lengths. If a backend builds a plan per shape (cuDNN
does), the first call at each length pays for it inside the run. For each backend (torch's
pick, forced flash, forced cuDNN) and each of ``--lengths`` distinct lengths near
``--around`` (Llama-3-8B heads: 32 q, 8 kv, head_dim 128, bf16), times the first call and
the median of the next ``--reps``, and the same for lengths rounded up to a multiple of
``--bucket`` (the padding that would bound the number of shapes; causal attention leaves
the real rows exact). Writes sdpa_shapes.json after every backend, sdpa_shapes.png, prints
a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forkserve.bench.provenance import source_commit  # noqa: E402

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def call_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend) -> float:
    """Wall ms of one causal GQA SDPA call, synchronised (the first call's plan included)."""
    if q.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if backend is None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def lengths_row(lengths: list[int], backend, heads: tuple[int, int, int], reps: int,
                device: torch.device) -> list[dict]:
    hq, hkv, dim = heads
    rows = []
    for n in lengths:
        q = torch.randn(1, hq, n, dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, n, dim, device=device, dtype=torch.bfloat16)
        v = torch.randn(1, hkv, n, dim, device=device, dtype=torch.bfloat16)
        first = call_ms(q, k, v, backend)
        steady = statistics.median(call_ms(q, k, v, backend) for _ in range(reps))
        rows.append({"length": n, "first_ms": first, "steady_ms": steady})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU: the plumbing")
    ap.add_argument("--around", type=int, default=2048, help="the lengths start here")
    ap.add_argument("--lengths", type=int, default=12, help="distinct lengths per backend")
    ap.add_argument("--step", type=int, default=37, help="between lengths (not a multiple of 16)")
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    heads = (4, 2, 32) if args.tiny else (32, 8, 128)
    around = 64 if args.tiny else args.around
    backends = {"default": None} if args.tiny else BACKENDS
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "commit": source_commit(), "heads": heads,
                 "bucket": args.bucket, "rows": {}, "errors": {}}
    # Each backend meets its own fresh lengths (offset per backend), so no plan is shared.
    for b, (name, backend) in enumerate(backends.items()):
        base = around + b * args.lengths * args.step * 3
        exact = [base + i * args.step for i in range(args.lengths)]
        bucketed = sorted({-(-n // args.bucket) * args.bucket
                           for n in (x + args.lengths * args.step + 1 for x in exact)})
        try:
            res["rows"][name] = {
                "exact": lengths_row(exact, backend, heads, args.reps, device),
                "bucketed": lengths_row(bucketed, backend, heads, args.reps, device)}
        except RuntimeError as e:  # a backend the device lacks: say so, keep the others
            res["errors"][name] = str(e).splitlines()[0]
        (out / "sdpa_shapes.json").write_text(json.dumps(res, indent=1))
        print(name, "done", flush=True)
    print_table(res)
    plot(res, out / "sdpa_shapes.png")
    return 0


def summary(rows: list[dict]) -> tuple[float, float, float]:
    """(median first-call ms, median steady ms, total first-call overhead ms)."""
    first = [r["first_ms"] for r in rows]
    steady = [r["steady_ms"] for r in rows]
    return (statistics.median(first), statistics.median(steady),
            sum(f - s for f, s in zip(first, steady, strict=True)))


def print_table(res: dict) -> None:
    print(f"\n{res['device']}, commit {res['commit']}: causal GQA SDPA, first call at a new "
          f"length vs the next (ms)")
    print(f"{'backend':8s} {'lengths':8s} {'n':>3s} {'first':>8s} {'steady':>8s} "
          f"{'overhead/len':>12s}")
    for name, kinds in res["rows"].items():
        for kind, rows in kinds.items():
            first, steady, over = summary(rows)
            print(f"{name:8s} {kind:8s} {len(rows):3d} {first:8.3f} {steady:8.3f} "
                  f"{over / len(rows):12.3f}")
    for name, err in res["errors"].items():
        print(f"FAILED {name}: {err}")


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from forkserve.bench.output import save_figure
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, kinds in res["rows"].items():
        rows = kinds["exact"]
        ax.plot([r["length"] for r in rows], [r["first_ms"] for r in rows], "o-",
                label=f"{name}: first call")
        ax.plot([r["length"] for r in rows], [r["steady_ms"] for r in rows], "x--",
                label=f"{name}: next calls")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (each new)")
    ax.set_ylabel("ms (synchronised wall)")
    ax.set_title(f"SDPA at new lengths, {res['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


if __name__ == "__main__":
    raise SystemExit(main())
