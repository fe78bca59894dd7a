"""Control-plane time per tick, against the GPU step it has to hide behind (issue 21).

    python benchmarks/engine_overhead_bench.py --label after --out benchmarks/results
    PYTHONPATH=<a checkout of an older commit> python benchmarks/engine_overhead_bench.py \
        --label before --out benchmarks/results

W sessions decode together over a shared 8K context on a MockBackend whose own work is
timed apart, so the figure is the Engine's bookkeeping alone (scheduling, page tables,
publishing, accounting). Each run adds its rows under ``--label`` to
``engine_overhead.json`` (rows of other labels are kept: one JSON and one PNG show the
source trees side by side) and reports, for a GPU step of ``--gpu-step-ms``:

* ``serial_unhidden``: engine ms / GPU ms — the tick runs in series with the step, so all
  of it is added to every step;
* ``overlap_bound``: max(0, engine - GPU) / GPU — what an engine that plans tick N+1 while
  the GPU runs tick N would still add (a bound: overlap itself is not built yet).

Engine times are CPU-only and move with the machine's load: compare labels measured back
to back on the same machine, by their ratio.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from forkserve import Engine, ForkServeConfig
from forkserve.backend.mock import MockBackend
from forkserve.bench.output import (add_out_argument, legend_below, new_figure, save_figure,
                                    write_json)



class TimedMock(MockBackend):
    """The mock's step, timed, so it can be subtracted from the tick (either entry: a tree
    before the DecodeBatch form calls only ``step``; the outer call is the one timed)."""

    backend_s = 0.0
    _inside = False

    def _timed(self, run, *args):
        if self._inside:
            return run(*args)
        self._inside, t0 = True, time.perf_counter()
        try:
            return run(*args)
        finally:
            self._inside = False
            self.backend_s += time.perf_counter() - t0

    def step(self, work):
        return self._timed(super().step, work)

    def step_batched(self, work, batch):
        return self._timed(super().step_batched, work, batch)

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
    ap.add_argument("--sessions", type=int, nargs="+", default=[32, 128, 512, 1024, 2048],
                    help="sessions decoding together")
    ap.add_argument("--context", type=int, default=8192, help="context tokens per session")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per session")
    ap.add_argument("--gpu-step-ms", type=float, default=9.0,
                    help="the GPU decode step the engine has to hide behind (H200, batch 64 "
                         "with LoRA: 9.02 ms, benchmarks/results/decode_bench.json)")
    ap.add_argument("--label", default="now", help="this source tree's name in the JSON and plot")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    path = args.out / "engine_overhead.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = [r for r in old["rows"] if r["label"] != args.label]
    print(f"{'label':>8} {'sessions':>8} {'engine ms/tick':>15} {'serial unhidden':>16} "
          f"{'overlap bound':>14}")
    for w in args.sessions:
        r = measure(w, args.context, args.steps) | {"label": args.label}
        r["serial_unhidden"] = r["engine_ms_per_tick"] / args.gpu_step_ms
        r["overlap_bound"] = max(0.0, r["engine_ms_per_tick"] - args.gpu_step_ms) / args.gpu_step_ms
        rows.append(r)
        print(f"{args.label:>8} {w:>8} {r['engine_ms_per_tick']:>15.3f} "
              f"{r['serial_unhidden']:>15.1%} {r['overlap_bound']:>13.1%}")
        # After every size, so a cut run keeps what it measured.
        write_json(path, {"gpu_step_ms": args.gpu_step_ms, "context": args.context,
                          "steps": args.steps, "rows": rows}, quiet=True)
    print(f"wrote {path}")
    plot(rows, args.gpu_step_ms, args.out / "engine_overhead.png")
    return 0


def plot(rows: list[dict], gpu_ms: float, path: Path) -> None:
    fig, (ax,) = new_figure(1, width=6.5)
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["sessions"])
        ax.plot([r["sessions"] for r in mine], [r["engine_ms_per_tick"] for r in mine],
                marker="o", label=f"engine ms/tick ({label})")
    ax.axhline(gpu_ms, color="gray", linestyle="--", label=f"GPU step {gpu_ms:g} ms")
    ax.set(xscale="log", yscale="log", xlabel="sessions decoding", ylabel="ms per tick",
           title="Control plane per tick (MockBackend, CPU)")
    legend_below(fig, ax)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
