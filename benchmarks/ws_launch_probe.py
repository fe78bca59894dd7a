"""Does the warp-specialized decode finish every launch? (rounds 20-21: with two consumer warp
groups, since removed, 3 of 7 H200 launches hung or faulted, and 6 of 8 probe cases with a
guard)

Each case (rows x keys x splits) runs in a process of its own
under a timeout, because a hung kernel hangs its process and a fault poisons its CUDA
context. A case launches ``residual_decode(variant="ws")`` ``--repeats`` times over random
pools (16-key pages scattered, rank-16 adapters, every fourth row without one) and compares
the last output with two-pass's. Per case: "ok" (seconds, the worst relative error of a row), "hang"
(the timeout) or "fault" (the process's last stderr line). Prints a table; writes
``ws_launch_probe.json`` after every case.

    python benchmarks/ws_launch_probe.py --out $OUT [--batches 8 32] [--timeout 30]
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_KV, HEAD_DIM, RANK, PAGE = 8, 128, 16, 16


def run_case(cmd: list[str], timeout: float) -> dict:
    """One child process: its JSON line on success, else how it ended."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "hang"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"status": "fault", "error": lines[-1] if lines else f"exit {done.returncode}"}
    return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


def child(batch: int, keys: int, splits: int, repeats: int) -> dict:
    import torch

    from forkserve.kernels import residual_decode
    from forkserve.kernels.rope import default_inv_freq

    gen = torch.Generator(device="cuda").manual_seed(batch * keys + splits)
    pages = batch * (keys // PAGE + 1)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    k, v = rand(pages, PAGE, N_KV, HEAD_DIM), rand(pages, PAGE, N_KV, HEAD_DIM)
    k_res, v_res = rand(pages, PAGE, RANK), rand(pages, PAGE, RANK)
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32).view(batch, -1)
    res_table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    b_k, b_v = rand(3, RANK, N_KV * HEAD_DIM, scale=0.2), rand(3, RANK, N_KV * HEAD_DIM, scale=0.2)
    adapters = torch.tensor([(0, 1, 2, -1)[i % 4] for i in range(batch)], dtype=torch.int32,
                            device="cuda")
    args = (rand(batch, 4 * N_KV, HEAD_DIM), k, v, k_res, v_res, table,
            res_table.view(batch, -1), torch.full((batch,), keys, dtype=torch.int32,
                                                  device="cuda"),
            b_k, b_v, adapters, default_inv_freq(HEAD_DIM, device="cuda"))
    start = time.perf_counter()
    for _ in range(repeats):
        out = residual_decode(*args, use_triton=True, variant="ws", num_splits=splits or None,
                              max_seq_len=keys)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ref = residual_decode(*args, use_triton=True, variant="two_pass", max_seq_len=keys)
    err = ((out.float() - ref.float()).norm(dim=(1, 2)) / ref.float().norm(dim=(1, 2))).max()
    return {"seconds": round(seconds, 3), "max_rel_err": float(err)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--keys", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 1],
                    help="0: the plan's count")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--child", type=int, nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    from forkserve.bench.provenance import source_commit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"commit": source_commit(), "repeats": args.repeats, "timeout_s": args.timeout,
           "cases": []}
    for batch, keys, splits in itertools.product(args.batches, args.keys, args.splits):
        case = {"batch": batch, "keys": keys, "splits": splits}
        case |= run_case([sys.executable, __file__, "--child", str(batch), str(keys),
                          str(splits), str(args.repeats)],
                         args.timeout)
        res["cases"].append(case)
        print(f"batch {batch:3d} keys {keys:6d} "
              f"splits {splits or 'plan':>4}"
              f"  {case['status']:5s} {case.get('max_rel_err', '')} {case.get('error', '')}",
              flush=True)
        (out / "ws_launch_probe.json").write_text(json.dumps(res, indent=1))
    bad = [c for c in res["cases"] if c["status"] != "ok"]
    print(f"{len(res['cases']) - len(bad)} of {len(res['cases'])} cases finished every launch")


if __name__ == "__main__":
    main()
