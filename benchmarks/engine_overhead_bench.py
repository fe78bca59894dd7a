"""Control-plane time per tick, against the GPU step it has to hide behind (issue 21).

    python benchmarks/engine_overhead_bench.py --label after --machine cpu \
        --out benchmarks/results
    PYTHONPATH=<an export of an older commit> FORKSERVE_COMMIT=<its hash> \
        python benchmarks/engine_overhead_bench.py --label before --machine cpu \
        --out benchmarks/results

W sessions decode together over a shared 8K context on a MockBackend whose own work is
timed apart, so the figure is the Engine's bookkeeping alone (scheduling, page tables,
publishing, accounting). Each run adds its rows under ``--label`` to
``engine_overhead.json`` (rows of other labels are kept: one JSON and one PNG show the
source trees side by side) and reports, for a GPU step of ``--gpu-step-ms``, the share of
the GPU's time it idles between steps (measured on a model of the device: each launched step
occupies it for the step's ms from its launch, or from the previous step's end; reading a
result before then waits):

* ``serial_unhidden``: with the tick in series with the step (``overlap`` off): about
  engine ms / GPU ms;
* ``overlap_unhidden``: with ``config.overlap`` (a tree that has it), the tick preparing
  step N+1 while step N runs: what is still not hidden.

Engine times are CPU-only and move with the machine's load: compare labels measured back
to back on the same machine, by their ratio. Each size runs ``--repeats`` times; a row keeps
the median and the best of each figure, the source commit (``bench/provenance.py``) and the
machine, whose name is in the file's (``engine_overhead_<machine>.json|png``).
``engine_cpu_ms_per_tick`` is this process's CPU time (``time.process_time``, the mock's own
subtracted): it leaves out time the process waited for a core, not the slowdown of sharing
one (on the 2-core box of issue 21 it tracked the wall-clock figure within 1% when the box
was quiet; under a load average of 8 the wall clock read ~2x the CPU time).

``--backend torch`` runs the same sessions through the real ``TorchBackend`` (a tiny
random-weight Llama on the CPU, eager attention, overlap on) and splits each decode step's
host time into its phases (``TorchPhases``): the engine's tick, the backend's batch
preparation (everything ``launch`` does before the model's forward: validation, page tables,
slot mappings, cascade tiles, graph or eager inputs), the model forward (real compute, on
a CPU: not what the GPU pays), the sampling (``Sampler.draw``: device work, inside a CUDA
graph's replay for greedy rows; on a CPU its argmax alone takes ms) and the read-back
(``result()``: the tokens to the host, ``Sampler.accept``, the result). host = engine +
prepare + read-back: the Python a GPU's step waits for. Rows go to
``engine_overhead_torch_<machine>.json``; ``--profile`` prints cProfile's top functions.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from forkserve import Engine, ForkServeConfig
from forkserve.backend.mock import MockBackend
from forkserve.bench.output import (
    add_out_argument,
    legend_below,
    new_figure,
    save_figure,
    write_json,
)
from forkserve.bench.provenance import source_commit


class TimedMock(MockBackend):
    """The mock's step, timed, so it can be subtracted from the tick (every entry: a tree
    before the DecodeBatch form calls only ``step``; the outer call is the one timed), on a
    modeled device: ``gpu_ms`` per step, launched by ``launch`` (overlap) or run in series
    by ``step``."""

    # Zero until ``start``: prefill is not modeled.
    backend_s = backend_cpu_s = waited_s = gpu_s = gpu_free = t0 = 0.0
    steps = 0
    _inside = False

    def start(self, gpu_ms: float) -> None:
        self.gpu_s, self.backend_s, self.waited_s, self.steps = gpu_ms / 1e3, 0.0, 0.0, 0
        self.backend_cpu_s = 0.0
        self.t0 = time.perf_counter()
        self.gpu_free = 0.0

    def now(self) -> float:
        """Modeled time: the engine's own time plus what it waited for the device."""
        return time.perf_counter() - self.t0 - self.backend_s + self.waited_s

    def _launched(self) -> None:
        self.gpu_free = max(self.now(), self.gpu_free) + self.gpu_s
        self.steps += 1

    def _wait(self) -> None:
        self.waited_s += max(0.0, self.gpu_free - self.now())

    def _timed(self, run, *args):
        if self._inside:
            return run(*args)
        self._inside, t0, cpu0 = True, time.perf_counter(), time.process_time()
        try:
            return run(*args)
        finally:
            self._inside = False
            self.backend_s += time.perf_counter() - t0
            self.backend_cpu_s += time.process_time() - cpu0

    def _serial(self, run, *args):
        if not self._inside:
            self._launched()
        try:
            return self._timed(run, *args)
        finally:
            if not self._inside:
                self._wait()

    def step(self, work):
        return self._serial(super().step, work)

    def step_batched(self, work, batch):
        return self._serial(super().step_batched, work, batch)

    def launch(self, work, batch):
        self._launched()
        handle = super().launch(work, batch)
        mock = self

        class Timed:
            def result(self):
                mock._wait()
                return mock._timed(handle.result)
        return Timed()

    def _next_token(self, context, adapter):  # O(1): only the engine is being measured
        return 40 + int(context[-1]) % 50


def start_decoding(engine: Engine, sessions: int, context: int, steps: int) -> None:
    """``sessions`` sessions over one shared ``context``-token prompt (two tokens of their own
    each), prefilled, then each generating ``steps`` tokens: the steady state measured."""
    prompt = [5 + i % 200 for i in range(context)]
    handles = [engine.open(prompt + [7, 3 + i % 250]) for i in range(sessions)]
    engine.drain_slack()
    assert not engine.metrics.failed_items, "the prompts' prefill failed"
    for h in handles:
        engine.start_generate(h.id, steps)


def measure(sessions: int, context: int, steps: int, gpu_ms: float, overlap: bool = False) -> dict:
    pages = sessions * (context // 16 + 16) + 64
    # H covers every page, so the decode slots C = H / M_spine admit all sessions each tick.
    cfg = ForkServeConfig(page_size=16, num_pages=pages, hbm_tokens=pages * 16,
                          vocab_size=300, max_batch_tokens=1 << 20, node_ttl_s=None,
                          **({"overlap": True} if overlap else {}))
    backend = TimedMock(cfg)
    engine = Engine(backend)
    start_decoding(engine, sessions, context, steps)
    backend.start(gpu_ms)
    t0, cpu0 = time.perf_counter(), time.process_time()
    ticks = 0
    while engine.tick():
        ticks += 1
    total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    backend._wait()  # the last step's end
    modeled = backend.now()
    engine.check_integrity()
    assert engine.metrics.decode_tokens >= sessions * (steps - 1), \
        "not every session decoded each tick"
    busy = backend.steps * backend.gpu_s
    return {"sessions": sessions, "context": context, "ticks": ticks,
            "engine_ms_per_tick": (total - backend.backend_s) / ticks * 1e3,
            # This process's CPU time alone: what other processes' load does not inflate.
            "engine_cpu_ms_per_tick": (cpu - backend.backend_cpu_s) / ticks * 1e3,
            "unhidden": (modeled - busy) / busy}


class TorchPhases:
    """Host time of a TorchBackend's steps by phase, timed around its own calls: ``launch``
    (all of it), the model's forward and ``Sampler.draw`` inside it, and each handle's
    ``result()``. On a CPU device every phase runs inside these calls, so their sum is the
    backend's whole share of a tick."""

    def __init__(self, backend) -> None:
        self.seconds = dict.fromkeys(("launch", "forward", "draw", "result"), 0.0)
        backend.launch = self._timed("launch", backend.launch, handle=True)
        backend.model.forward = self._timed("forward", backend.model.forward)
        backend.sampler.draw = self._timed("draw", backend.sampler.draw)

    def _timed(self, phase: str, run, handle: bool = False):
        seconds = self.seconds

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = run(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t0
            if handle:
                out.result = self._timed("result", out.result)
            return out
        return call

    def reset(self) -> None:
        self.seconds.update(dict.fromkeys(self.seconds, 0.0))

    @staticmethod
    def split(s: dict[str, float]) -> dict[str, float]:
        """Seconds per phase: preparation is ``launch`` less the forward and the drawing."""
        return {"prepare": s["launch"] - s["forward"] - s["draw"], "forward": s["forward"],
                "sample": s["draw"], "readback": s["result"]}


def tiny_llama():
    """One layer, one K/V head of 16: eager attention gathers every row's whole context each
    step (W x 8K keys), so the model stays small enough for 512 rows on a CPU."""
    from forkserve.backend.torch.model_config import ModelConfig
    from forkserve.backend.torch.rope import RopeConfig

    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5,
                       rope=RopeConfig(), max_context=16384, attention_bias=False,
                       tie_word_embeddings=False)


def measure_torch(sessions: int, context: int, steps: int, profile: int = 0) -> dict:
    """W sessions over one shared context through Engine + TorchBackend (overlap on, cascade
    on, CPU): host ms per decode tick by phase."""
    import torch

    from forkserve.backend.torch import TorchBackend
    from forkserve.backend.torch.weights import random_weights

    page = 16
    pages = context // page + sessions * (steps // page + 3) + 64
    cfg = ForkServeConfig(page_size=page, num_pages=pages, hbm_tokens=pages * page,
                          max_batch_tokens=1 << 20, node_ttl_s=None, overlap=True)
    model = tiny_llama()
    cpu = torch.device("cpu")
    backend = TorchBackend.from_weights(cfg, model, random_weights(model, cpu, torch.float32),
                                        device=cpu, dtype=torch.float32, attention="eager")
    engine = Engine(backend)
    start_decoding(engine, sessions, context, steps)
    phases = TorchPhases(backend)
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    per_tick = []  # (wall s, phase seconds) of each tick
    while True:
        phases.reset()
        t0 = time.perf_counter()
        more = engine.tick()
        if not more:
            engine.sync()
        per_tick.append((time.perf_counter() - t0, dict(phases.seconds)))
        if not more:
            break
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    engine.check_integrity()
    assert engine.metrics.decode_tokens >= sessions * (steps - 1), \
        "not every session decoded each tick"
    ticks = [phases.split(seconds) | {"engine": wall - seconds["launch"] - seconds["result"]}
             for wall, seconds in per_tick]
    for tick in ticks:
        tick["host"] = tick["engine"] + tick["prepare"] + tick["readback"]
    # The median tick is a steady decode step; the mean also carries the first decode tick
    # (every session an item of the general path) and the boundary and publish ticks.
    out = {"sessions": sessions, "context": context, "ticks": len(ticks)}
    for key in ("engine", "prepare", "forward", "sample", "readback", "host"):
        values = [tick[key] * 1e3 for tick in ticks]
        out[f"{key}_ms"] = statistics.median(values)
        out[f"{key}_mean_ms"] = statistics.fmean(values)
    return out


def torch_main(args: argparse.Namespace) -> int:
    path = args.out / f"engine_overhead_torch_{args.machine}.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = [r for r in old["rows"] if r["label"] != args.label]
    commit, cpu = source_commit(), _cpu()
    keys = ("engine_ms", "prepare_ms", "forward_ms", "sample_ms", "readback_ms", "host_ms",
            "host_mean_ms")
    print(f"{args.label} = {commit} on {args.machine} ({cpu}); TorchBackend on the CPU, "
          f"overlap on; ms per tick: the median tick (host_mean: the mean tick), median (best) "
          f"of {args.repeats} runs; host = engine + prepare + readback")
    print(f"{'sessions':>8} " + " ".join(f"{k:>17}" for k in keys))
    for w in args.sessions:
        runs = [measure_torch(w, args.context, args.steps, args.profile if i == 0 else 0)
                for i in range(args.repeats)]
        r = {"label": args.label, "commit": commit, "machine": args.machine, "sessions": w,
             "context": args.context, "ticks": runs[0]["ticks"], "repeats": args.repeats}
        means = ("engine_mean_ms", "prepare_mean_ms", "sample_mean_ms", "readback_mean_ms")
        for key in (*keys, *means):
            values = [run[key] for run in runs]
            r[key], r[key + "_best"] = statistics.median(values), min(values)
        rows.append(r)
        print(f"{w:>8} " + " ".join(f"{_pair(r, k):>17}" for k in keys))
        write_json(path, {"context": args.context, "steps": args.steps, "machine": args.machine,
                          "cpu": cpu, "model": "tiny Llama, 1 layer (tiny_llama), eager attention",
                          "rows": rows}, quiet=True)
    print(f"wrote {path}")
    return 0


def repeated(sessions: int, args: argparse.Namespace, overlap: bool) -> dict:
    """``measure`` ``args.repeats`` times: the median and the best of each figure."""
    runs = [measure(sessions, args.context, args.steps, args.gpu_step_ms, overlap=overlap)
            for _ in range(args.repeats)]
    out = {"ticks": runs[0]["ticks"]}
    for key in ("engine_ms_per_tick", "engine_cpu_ms_per_tick", "unhidden"):
        values = [r[key] for r in runs]
        out[key], out[key + "_best"] = statistics.median(values), min(values)
    return out


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
    ap.add_argument("--repeats", type=int, default=3, help="runs per size and mode (median, best)")
    ap.add_argument("--label", default="now", help="this source tree's name in the JSON and plot")
    ap.add_argument("--machine", default="cpu",
                    help="the machine's name, in the file names and every row")
    ap.add_argument("--backend", choices=("mock", "torch"), default="mock",
                    help="mock: the engine alone; torch: TorchBackend's host phases too")
    ap.add_argument("--profile", type=int, default=0,
                    help="torch: print cProfile's top N functions of each size's first run")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.backend == "torch":
        return torch_main(args)
    path = args.out / f"engine_overhead_{args.machine}.json"
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = [r for r in old["rows"] if r["label"] != args.label]
    has_overlap = "overlap" in ForkServeConfig.__dataclass_fields__
    commit = source_commit()
    cpu = _cpu()
    print(f"{args.label} = {commit} on {args.machine} ({cpu}); median (best) of {args.repeats}")
    print(f"{'label':>8} {'sessions':>8} {'engine ms/tick':>16} {'CPU ms/tick':>14} "
          f"{'serial unhidden':>16} {'overlap ms/tick':>16} {'overlap unhidden':>17}")
    for w in args.sessions:
        serial = repeated(w, args, overlap=False)
        r = {"label": args.label, "commit": commit, "machine": args.machine, "sessions": w,
             "context": args.context, "ticks": serial["ticks"], "repeats": args.repeats,
             "engine_ms_per_tick": serial["engine_ms_per_tick"],
             "engine_ms_per_tick_best": serial["engine_ms_per_tick_best"],
             "engine_cpu_ms_per_tick": serial["engine_cpu_ms_per_tick"],
             "engine_cpu_ms_per_tick_best": serial["engine_cpu_ms_per_tick_best"],
             "serial_unhidden": serial["unhidden"],
             "overlap_engine_ms_per_tick": None, "overlap_engine_ms_per_tick_best": None,
             "overlap_unhidden": None}
        if has_overlap:
            over = repeated(w, args, overlap=True)
            r["overlap_engine_ms_per_tick"] = over["engine_ms_per_tick"]
            r["overlap_engine_ms_per_tick_best"] = over["engine_ms_per_tick_best"]
            r["overlap_unhidden"] = over["unhidden"]
        rows.append(r)
        print(f"{args.label:>8} {w:>8} {_pair(r, 'engine_ms_per_tick'):>16} "
              f"{_pair(r, 'engine_cpu_ms_per_tick'):>14} {r['serial_unhidden']:>15.1%} "
              + (f"{_pair(r, 'overlap_engine_ms_per_tick'):>16} {r['overlap_unhidden']:>16.1%}"
                 if has_overlap else f"{'-':>16} {'-':>17}"))
        # After every size, so a cut run keeps what it measured.
        write_json(path, {"gpu_step_ms": args.gpu_step_ms, "context": args.context,
                          "steps": args.steps, "machine": args.machine, "cpu": cpu, "rows": rows},
                   quiet=True)
    print(f"wrote {path}")
    plot(rows, args.gpu_step_ms, args.out / f"engine_overhead_{args.machine}.png", args.machine)
    return 0


def _cpu() -> str:
    """The processor's model and this machine's core count (Linux names the model)."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} cores"


def _pair(row: dict, key: str) -> str:
    """``median (best)`` of a figure, as the table prints it."""
    return f"{row[key]:.3f} ({row[key + '_best']:.3f})"


def plot(rows: list[dict], gpu_ms: float, path: Path, machine: str) -> None:
    fig, (ax,) = new_figure(1, width=10, height=5)
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["sessions"])
        commit = mine[0].get("commit", "?")[:7]
        ax.plot([r["sessions"] for r in mine], [r["engine_ms_per_tick"] for r in mine],
                marker="o", label=f"{label} {commit}: median")
        ax.plot([r["sessions"] for r in mine], [r["engine_cpu_ms_per_tick_best"] for r in mine],
                marker="^", linestyle="--", label=f"{label}: CPU, best")
        over = [r for r in mine if r.get("overlap_unhidden") is not None]
        if over:  # the GPU time not hidden, in ms per step
            ax.plot([r["sessions"] for r in over], [r["overlap_unhidden"] * gpu_ms for r in over],
                    marker="s", linestyle=":", label=f"{label}: GPU idle, overlap")
    ax.axhline(gpu_ms, color="gray", linestyle="--", label=f"GPU step ({gpu_ms:g} ms)")
    ax.set(xscale="log", yscale="log", xlabel="sessions decoding",
           ylabel="ms per tick (GPU idle: ms per step)",
           title=f"Control plane per tick (MockBackend, {machine})")
    legend_below(fig, ax, max_cols=3)
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
