"""One residual prefill case on the ws route, launched a few times, for a profiler to read.

    ncu --clock-control none --kernel-name regex:_residual_prefill_ws_kernel --launch-skip 2 \\
        --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/ws_prefill_profile.py --batch 8 --new 64 --keys 8256

(``h200_issue15.sh 68``). Without a profiler it prints the case's device time by CUDA-graph
replay, so a run says what it profiled. The shapes are kernel_bench's (Llama-3-8B heads,
GQA 4, rank 16, bf16); ``--rows`` / ``--stages`` pick a ``WsPrefillLaunch`` (default: the
kernel's own for the case).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.setup import Setup  # noqa: E402
from benchmarks.kernelbench.timing import bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--keys", type=int, default=8256)
    ap.add_argument("--rows", type=int, choices=(64, 128))
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ws_prefill_profile: needs an sm_90 GPU (the ws kernel is Hopper's)", file=sys.stderr)
        return 2
    from forkserve.kernels.residual_decode_gluon import supports
    from forkserve.kernels.residual_prefill_gluon import WsPrefillLaunch, residual_prefill_ws

    s = Setup(smoke=False)
    bt, rbt, lens = s.tables(args.batch, args.keys)
    q = s.q(args.batch * args.new)
    if not supports(q, s.k, s.k_res):
        print("ws_prefill_profile: the ws kernel does not take these shapes on this device",
              file=sys.stderr)
        return 2
    cu = torch.arange(0, args.batch * args.new + 1, args.new, dtype=torch.int32,
                      device=s.device)
    launch = None if args.rows is None else WsPrefillLaunch(args.rows, args.stages)
    adapters = s.adapters(args.batch)

    def call() -> torch.Tensor:
        return residual_prefill_ws(q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu, s.b_k,
                                   s.b_v, adapters, s.inv_freq,
                                   max_q_len=args.new, max_seq_len=args.keys, launch=launch)

    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    print(f"ws prefill {args.batch} x {args.new} over {args.keys} keys, launch "
          f"{launch or 'default'}: {bench(call, False):.4f} ms (graph replay)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
