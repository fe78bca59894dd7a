"""``--cascade-sweep``: shared-prefix decode over its prefix launch's tuning."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.kernelbench.setup import Setup
from benchmarks.kernelbench.timing import measure
from forkserve.bench.provenance import source_commit
from forkserve.kernels.decode_attention import paged_decode_triton
from forkserve.kernels.shared_prefix import shared_prefix_decode_triton


def run_cascade_sweep(s: Setup, res: dict, path: Path) -> None:
    """Shared-prefix decode (32 agents) over the prefix launch's tuning (splits, key block,
    warps, stages); the suffix launch keeps the unified defaults. JSON after each context."""
    import itertools
    res["cascade_sweep"] = []
    grid = itertools.product((None, 16, 8), (32, 64), (4, 8), (2, 3))
    combos = [dict(num_splits=a, block_n=b, num_warps=w, num_stages=st) for a, b, w, st in grid]
    for ctx in s.contexts:
        prefix_pages = ctx // s.page
        per = prefix_pages + -(-s.suffix // s.page)
        bt = s.tables(s.agents, per * s.page)[0].clone()
        bt[:, :prefix_pages] = bt[0, :prefix_pages]
        lens = torch.full((s.agents,), ctx + s.suffix, dtype=torch.int32, device=s.device)
        q = s.q(s.agents)
        indep = measure(res, f"sweep ctx={ctx} independent", lambda: paged_decode_triton(
            q, s.k, s.v, bt, lens, max_seq_len=ctx + s.suffix), s.smoke)
        for tuning in combos:
            ms = measure(res, f"sweep ctx={ctx} {tuning}",
                         lambda t=tuning: shared_prefix_decode_triton(
                             q, s.k, s.v, bt, lens, prefix_pages, max_seq_len=ctx + s.suffix,
                             prefix_tuning=t),
                         s.smoke)
            res["cascade_sweep"].append({"prefix_ctx": ctx, "agents": s.agents, "suffix": s.suffix,
                                         "prefix_tuning": tuning, "shared_ms": ms,
                                         "independent_ms": indep, "ratio": ms / indep})
        best = min((r for r in res["cascade_sweep"] if r["prefix_ctx"] == ctx),
                   key=lambda r: r["shared_ms"])
        print(f"sweep ctx={ctx} independent={indep:.4f}ms best={best['shared_ms']:.4f}ms "
              f"({best['ratio']:.3f}) {best['prefix_tuning']}", flush=True)
        path.write_text(json.dumps(res, indent=1))


def main_cascade_sweep(s: Setup, args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
           "commit": source_commit(), "dtype": str(s.dtype)}
    run_cascade_sweep(s, res, args.out / "kernel_bench_cascade_sweep.json")
