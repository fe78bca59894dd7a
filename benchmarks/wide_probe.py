"""Round 38's probe of the 128-key residual prefill (reverted after its run, as round 28's
was): at 8 x 64 over 8K, the default launch beside the same launch with (1) its consumers
idle, each tile released as it is ready, (2) no rebuild math (the waits and releases kept),
(3) no fence at a tile's end, and the no-adapter run of (0) and (2), timed interleaved by
CUDA-graph replay (``timed_interleaved``), three passes; (3)'s output checked equal to (0)'s.
Writes ``wide_probe_round38.json`` under ``--out`` after each pass.

    python3 benchmarks/wide_probe.py --out "$OUT"
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.setup import Setup  # noqa: E402
from benchmarks.kernelbench.timing import timed_interleaved  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--keys", type=int, default=8256)
    args = ap.parse_args()
    from forkserve.kernels.residual_prefill_gluon import default_launch, residual_prefill_ws

    s = Setup(smoke=False)
    bt, rbt, lens = s.tables(args.batch, args.keys)
    q = s.q(args.batch * args.new)
    cu = torch.arange(0, args.batch * args.new + 1, args.new, dtype=torch.int32, device=s.device)
    base = default_launch(args.new, s.n_heads // s.n_kv)
    with_adapter = s.adapters(args.batch)
    none = torch.full_like(with_adapter, -1)

    def call(probe: int, adapters: torch.Tensor):
        launch = replace(base, probe=probe)
        return lambda: residual_prefill_ws(q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu,
                                           s.b_k, s.b_v, adapters, s.inv_freq,
                                           max_q_len=args.new, max_seq_len=args.keys,
                                           launch=launch)

    runs = {"default": call(0, with_adapter), "consumers_idle": call(1, with_adapter),
            "no_rebuild_math": call(2, with_adapter), "no_tile_end_fence": call(3, with_adapter),
            "default_no_adapter": call(0, none), "consumers_idle_no_adapter": call(1, none),
            "no_cos_sin_loads": call(4, with_adapter),
            "consumers_idle_no_cos_sin_loads": call(5, with_adapter)}
    same = bool(torch.equal(runs["default"](), runs["no_tile_end_fence"]()))
    doc = {"launch": base.name, "case": f"{args.batch} x {args.new} over {args.keys}",
           "gpu": torch.cuda.get_device_name(), "fence_free_output_equal": same, "passes": []}
    for n in range(3):
        ms = timed_interleaved(runs)
        doc["passes"].append(ms)
        print(f"pass {n}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in ms.items()),
              flush=True)
        (args.out / "wide_probe_round38.json").write_text(json.dumps(doc, indent=1))
    print("no-fence output equal:", same)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
