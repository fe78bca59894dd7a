"""One prefill case on one route, launched a few times, for a profiler to read: the ws
residual prefill (its default launch, another, or with no row's adapter) or FlashAttention-4
reading the unified pages (row 3's baseline), so one ncu setting reads both side by side.
``--launch NAME`` takes any launch residual_prefill_bench measures by its name, the 128-key
kernel's (``wide_m...``, residual_prefill_wide.py) among them.

    ncu --clock-control none --kernel-name regex:_residual_prefill_ws_kernel --launch-skip 2 \\
        --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/ws_prefill_profile.py --batch 8 --new 64 --keys 8256

(``h200_issue15.sh`` 68 and 73; ``benchmarks/ncu_compare.py`` puts the raw pages of several
runs side by side.) Without a profiler it prints the case's device time by CUDA-graph
replay, so a run says what it profiled. The shapes are kernel_bench's (Llama-3-8B heads,
GQA 4, rank 16, bf16); ``--rows`` / ``--stages`` pick a ``WsPrefillLaunch`` (default: the
kernel's own for the case, ``default_launch``).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.setup import Setup  # noqa: E402
from benchmarks.kernelbench.timing import bench  # noqa: E402


class ProfileError(RuntimeError):
    """The case cannot run here (one line, exit 2)."""


def _ws_call(s: Setup, args: argparse.Namespace, q: torch.Tensor, tables: tuple,
             cu: torch.Tensor) -> tuple[Callable[[], torch.Tensor], str]:
    from forkserve.kernels.residual_prefill_gluon import (
        WsPrefillLaunch,
        default_launch,
        residual_prefill_ws,
        supports,
    )

    if not supports(q, s.k, s.k_res):
        raise ProfileError("the ws kernel does not take these shapes on this device")
    bt, rbt, lens = tables
    if args.launch is not None:
        from benchmarks.residual_prefill_bench import launch_table

        table = launch_table()
        if args.launch not in table:
            raise ProfileError(f"unknown launch {args.launch}; the bench's: "
                               + ", ".join(sorted(table)))
        launch = table[args.launch]
    elif args.rows is not None:
        launch = WsPrefillLaunch(args.rows, args.stages)
    else:
        launch = default_launch(args.new, s.n_heads // s.n_kv)
    adapters = s.adapters(args.batch)
    if args.no_adapter:  # the kernel's skeleton: no rebuild, no V residual
        adapters = torch.full_like(adapters, -1)

    def call() -> torch.Tensor:
        return residual_prefill_ws(q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu, s.b_k,
                                   s.b_v, adapters, s.inv_freq,
                                   max_q_len=args.new, max_seq_len=args.keys, launch=launch)

    return call, f"ws {launch.name}" + (", no adapter" if args.no_adapter else "")


def _fa4_call(s: Setup, args: argparse.Namespace, q: torch.Tensor, tables: tuple,
              cu: torch.Tensor) -> tuple[Callable[[], torch.Tensor], str]:
    from forkserve.kernels import PrefillCounts, flash_support, paged_prefill

    flash = flash_support(q, s.k)
    if not flash.paged:
        raise ProfileError(f"no FlashAttention-4 paged read here ({flash.reason or flash.kernel})")
    bt, _, lens = tables
    counts = PrefillCounts((args.new,) * args.batch, (args.keys,) * args.batch)

    def call() -> torch.Tensor:
        return paged_prefill(q, s.k, s.v, bt, lens, cu, use_triton=True,
                             variant="paged_flash", counts=counts)

    return call, "FlashAttention-4, unified pages"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", choices=("ws", "fa4"), default="ws")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--keys", type=int, default=8256)
    ap.add_argument("--rows", type=int, choices=(64, 128))
    ap.add_argument("--launch", metavar="NAME",
                    help="a launch by its bench name (replaces --rows / --stages)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--no-adapter", action="store_true",
                    help="ws with no row's adapter (what the base loop alone costs)")
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    if args.launch is not None and args.rows is not None:
        ap.error("--launch names a launch whole: not with --rows")
    if not torch.cuda.is_available():
        print("ws_prefill_profile: needs an sm_90 GPU (the ws kernel is Hopper's)", file=sys.stderr)
        return 2
    s = Setup(smoke=False)
    tables = s.tables(args.batch, args.keys)
    q = s.q(args.batch * args.new)
    cu = torch.arange(0, args.batch * args.new + 1, args.new, dtype=torch.int32,
                      device=s.device)
    try:
        call, what = (_ws_call if args.route == "ws" else _fa4_call)(s, args, q, tables, cu)
    except ProfileError as e:
        print(f"ws_prefill_profile: {e}", file=sys.stderr)
        return 2
    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    print(f"{what}: {args.batch} x {args.new} over {args.keys} keys, "
          f"{bench(call, False):.4f} ms (graph replay)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
