"""Control-plane time per tick, against the GPU step it has to hide behind.

    python benchmarks/engine_overhead_bench.py [--sessions 1 8 32 64] [--context 1024 8192]

W sessions decode together over a shared-length context on a MockBackend whose own work
is timed apart, so the figure is the Engine's bookkeeping alone (scheduling, page tables,
publishing, accounting). Printed beside the measured H200 decode step of
benchmarks/results/decode_bench.json (batch 64 with LoRA) as a share of it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from forkserve import Engine, ForkServeConfig
from forkserve.backend.mock import MockBackend
from forkserve.bench.output import add_out_argument, write_json

# The committed H200 decode step this overhead is compared with (read only).
GPU_STEP = Path(__file__).parent / "results" / "decode_bench.json"


class TimedMock(MockBackend):
    """The mock's step, timed, so it can be subtracted from the tick."""

    backend_s = 0.0

    def step(self, work):
        t0 = time.perf_counter()
        try:
            return super().step(work)
        finally:
            self.backend_s += time.perf_counter() - t0

    def _next_token(self, context, adapter):  # O(1): only the engine is being measured
        return 40 + int(context[-1]) % 50


def measure(sessions: int, context: int, steps: int) -> dict:
    pages = sessions * (context // 16 + 16) + 64
    # H covers every page, so the decode slots C = H / M_spine admit all sessions each tick.
    cfg = ForkServeConfig(page_size=16, num_pages=pages, hbm_tokens=pages * 16,
                          vocab_size=300, max_batch_tokens=1 << 20, node_ttl_s=None)
    backend = TimedMock(cfg)
    engine = Engine(backend)
    prompt = [5 + i % 200 for i in range(context)]
    handles = [engine.open(prompt + [7, 3 + i % 250]) for i in range(sessions)]
    engine.drain_slack()
    for h in handles:
        engine.start_generate(h.id, steps)
    backend.backend_s = 0.0
    t0 = time.perf_counter()
    ticks = 0
    while engine.tick():
        ticks += 1
    total = time.perf_counter() - t0
    engine.check_integrity()
    assert engine.metrics.decode_tokens >= sessions * (steps - 1), \
        "not every session decoded each tick"
    return {"sessions": sessions, "context": context, "ticks": ticks,
            "engine_ms_per_tick": (total - backend.backend_s) / ticks * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 64],
                    help="sessions decoding together")
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 8192],
                    help="context tokens per session")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per session")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    gpu = json.loads(GPU_STEP.read_text())
    gpu_ms = gpu["decode_b64_lora"]["ms_per_step"]
    rows = [measure(w, c, args.steps) for c in args.context for w in args.sessions]
    print(f"{'sessions':>8} {'context':>8} {'engine ms/tick':>15} {'share of H200 step':>19}")
    for r in rows:
        r["share_of_gpu_step"] = r["engine_ms_per_tick"] / gpu_ms
        print(f"{r['sessions']:>8} {r['context']:>8} {r['engine_ms_per_tick']:>15.3f} "
              f"{r['share_of_gpu_step']:>18.1%}")
    print(f"(H200 decode step, batch 64 with LoRA: {gpu_ms:.2f} ms)")
    write_json(args.out / "engine_overhead.json", {"gpu_step_ms": gpu_ms, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
