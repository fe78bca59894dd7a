"""The cold unified prefill on library kernels: torch SDPA (its pick, cuDNN, flash) against
FlashAttention-4 (the CuTe-DSL kernels, ``flash_attn.cute``), dense, varlen and paged.

    python benchmarks/fa4_prefill_bench.py --out benchmarks/results     # on the H200
    python benchmarks/fa4_prefill_bench.py --smoke --out /tmp/bench     # plumbing (CPU, SDPA)

Issue 15's row 4 asks the unified prefill to run at or under torch SDPA at >= 4K. The
engine's cold route (FRESH) *is* torch's SDPA pick, so it sits at 1.00x by construction;
only a faster kernel moves it. This weighs FA4 as that kernel before the engine takes it:
per case (batch x length, Llama-3-8B heads: 32 q, 8 kv, head_dim 128, bf16, causal), each
column by CUDA-graph replay, interleaved, L2 flushed (``kernelbench.timing.timed_interleaved``):

- ``sdpa_default`` / ``sdpa_cudnn`` / ``sdpa_flash``: one ``is_causal`` GQA SDPA call per
  sequence on (B, H, S, D) views of the (S, H, D) step tensors, as ``fresh_prefill`` calls it;
- ``fa4_varlen``: one ``flash_attn_varlen_func`` call over the packed step (every sequence);
- ``fa4_paged``: the same over our page-16 K/V pool through a page table (no gather), pages
  in a shuffled order as a live pool has them.

Each column also eager (``eager_ms``: the call as the engine makes it, host work included).

Also the first call's wall time (compile included) and each FA4 column's largest difference
from ``sdpa_default``. Writes fa4_prefill.json after every case, fa4_prefill.png, prints a
table. FA4 missing (CPU, or no wheels) leaves its columns out and says why.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# --smoke runs the kernels in Triton's interpreter, chosen before triton is first imported.
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.timing import bench_eager, timed_interleaved  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402

SDPA_BACKENDS = {"sdpa_default": None, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_flash": SDPBackend.FLASH_ATTENTION}
PAGE = 16


def fa4_module():
    """``flash_attn.cute``'s varlen entry point, or the reason it cannot run here."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # ImportError, or the DSL failing to load its libraries
        return None, f"{type(exc).__name__}: {exc}"[:300]
    return flash_attn_varlen_func, ""


def sdpa_call(q, k, v, cu: list[int], backend) -> Callable[[], torch.Tensor]:
    """One causal SDPA call per sequence on (1, H, S, D) views, into one output."""
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            if backend is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                       enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
        return out
    return run


def case(batch: int, length: int, fa4, device: torch.device, dtype: torch.dtype,
         heads: tuple[int, int, int], res: dict) -> dict:
    hq, hkv, dim = heads
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + length)
    n = batch * length
    q = torch.randn(n, hq, dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(n, hkv, dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(n, hkv, dim, generator=gen, device=device, dtype=dtype)
    cu = list(range(0, n + 1, length))
    runs: dict[str, Callable[[], torch.Tensor]] = {
        name: sdpa_call(q, k, v, cu, backend) for name, backend in SDPA_BACKENDS.items()
        if device.type == "cuda" or backend is None}
    if fa4 is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        runs["fa4_varlen"] = lambda: fa4(q, k, v, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                                         max_seqlen_q=length, max_seqlen_k=length,
                                         causal=True)[0]
        pages = length // PAGE
        order = torch.randperm(batch * pages, generator=gen, device=device).to(torch.int32)
        table = order.view(batch, pages).contiguous()
        k_pool = torch.empty(batch * pages, PAGE, hkv, dim, device=device, dtype=dtype)
        v_pool = torch.empty_like(k_pool)
        k_pool[order.long()] = k.view(batch * pages, PAGE, hkv, dim)
        v_pool[order.long()] = v.view(batch * pages, PAGE, hkv, dim)
        used = torch.full((batch,), length, dtype=torch.int32, device=device)
        runs["fa4_paged"] = lambda: fa4(q, k_pool, v_pool, cu_seqlens_q=cu_t, max_seqlen_q=length,
                                        seqused_k=used, page_table=table, causal=True)[0]
    row: dict = {"batch": batch, "length": length, "first_ms": {}, "max_diff": {}}
    ref = None
    ok = {}
    for name, run in runs.items():
        try:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            row["first_ms"][name] = (time.perf_counter() - t0) * 1e3
        except Exception as exc:  # one failing column keeps the others
            res["errors"].append(f"{name} {batch}x{length}: {exc!r}"[:600])
            print(f"ERROR {name} {batch}x{length}: {exc!r}"[:300], flush=True)
            continue
        if ref is None:
            ref = out.float().clone()
        row["max_diff"][name] = (out.float() - ref).abs().max().item()
        ok[name] = run
    smoke = device.type != "cuda"
    replayed = None if smoke else timed(ok, res, f"{batch}x{length}")
    # Eager, as the engine calls them (CUDA events, L2 flushed: ``kernelbench.timing.bench_eager``):
    # the device time plus any host work the GPU waits for (FA4's Python-side argument
    # handling, SDPA's dispatch). On CPU one wall-timed call, the plumbing only.
    row["eager_ms"] = {name: bench_eager(run, smoke) for name, run in ok.items()}
    row["ms"] = replayed or row["eager_ms"]
    flops = 2.0 * batch * length * length * dim * hq  # causal: half of 4 * S^2 * D per head
    base = row["ms"].get("sdpa_default", math.nan)
    row["tflops"] = {name: flops / (ms * 1e-3) / 1e12 for name, ms in row["ms"].items()}
    row["over_sdpa_default"] = {name: ms / base for name, ms in row["ms"].items()}
    return row


def timed(runs: dict[str, Callable[[], torch.Tensor]], res: dict,
          tag: str) -> dict[str, float] | None:
    """Graph replay, interleaved; None (the error recorded) where a capture fails, and the
    eager times stand in."""
    try:
        return timed_interleaved(runs, rounds=20)
    except Exception as exc:
        res["errors"].append(f"{tag} graphs: {exc!r}"[:600])
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="small shapes on CPU: the plumbing")
    ap.add_argument("--cases", default="1x1024,1x4096,1x8192,1x16384,1x32768,4x4096,8x1024",
                    help="batch x length, comma separated")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    heads = (4, 2, 32) if args.smoke else (32, 8, 128)
    cases = ([(1, 64), (2, 32)] if args.smoke else
             [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")])
    fa4, why = fa4_module() if device.type == "cuda" else (None, "no CUDA device")
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "commit": source_commit(), "heads": heads,
                 "page": PAGE, "fa4": why or "available", "rows": [], "errors": []}
    if why:
        print(f"FlashAttention-4 not measured: {why}", flush=True)
    for batch, length in cases:
        res["rows"].append(case(batch, length, fa4, device, dtype, heads, res))
        (out / "fa4_prefill.json").write_text(json.dumps(res, indent=1))
        print(f"{batch}x{length} done", flush=True)
    print_table(res)
    plot(res, out / "fa4_prefill.png")
    return 0


def print_table(res: dict) -> None:
    names = sorted({n for r in res["rows"] for n in r["ms"]}, key=list(
        (*SDPA_BACKENDS, "fa4_varlen", "fa4_paged")).index)
    print(f"\n{res['device']}, commit {res['commit']}: causal GQA prefill, ms (x sdpa_default), "
          f"graph replay / eager")
    print(f"{'case':>9s} " + " ".join(f"{n:>28s}" for n in names))
    for r in res["rows"]:
        cells = [f"{r['ms'][n]:7.3f} ({r['over_sdpa_default'][n]:4.2f}x) / {r['eager_ms'][n]:7.3f}"
                 if n in r["ms"] else f"{'-':>28s}" for n in names]
        print(f"{r['batch']:>3d}x{r['length']:<5d} " + " ".join(f"{c:>28s}" for c in cells))
    for e in res["errors"]:
        print("ERROR", e)


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from forkserve.bench.output import save_figure
    except ImportError:
        return
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['batch']}x{r['length']}" for r in res["rows"]]
    names = sorted({n for r in res["rows"] for n in r["ms"]})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(labels))]
        ax_t.bar(xs, [r["tflops"].get(name, 0.0) for r in res["rows"]], width, label=name)
        ax_r.bar(xs, [r["over_sdpa_default"].get(name, 0.0) for r in res["rows"]], width,
                 label=name)
    for ax in (ax_t, ax_r):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, fontsize=8)
        ax.set_xlabel("batch x length (causal, 32 q / 8 kv heads, D 128)")
    ax_t.set_ylabel("TFLOP/s")
    ax_r.set_ylabel("time / sdpa_default (lower is faster)")
    ax_r.axhline(1.0, color="k", lw=0.8)
    ax_t.legend(fontsize=7)
    fig.suptitle(f"Cold prefill on library kernels, {res['device']}, {res['commit'][:8]}")
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


if __name__ == "__main__":
    raise SystemExit(main())
