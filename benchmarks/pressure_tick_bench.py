"""The react bench under memory pressure, on a MockBackend: the engine's ms per tick and
the decode graphs its steps need (CPU figures; issue 21's D1 runs).

    python benchmarks/pressure_tick_bench.py --label after --out benchmarks/results
    PYTHONPATH=<an export of an older commit> FORKSERVE_COMMIT=<its hash> \
        python benchmarks/pressure_tick_bench.py --label before --out benchmarks/results

The workload of ``forkserve bench react --systems disaggregated --reopen`` at the Llama-3-8B
page shape (its page bytes, budget and residual share buy the same page counts: the
residuals of all agents do not fit, so paused agents' residuals are evicted), with the D1
features (``--host-residual-gib 4 --pause-pin``) off and on. The mock's own work is timed
apart, so ``decode_ms`` is the Engine's planning alone per decode-only tick (stepper,
steady set, eviction, host tier, pause pins, publishing) and ``prefill_ms`` per tick that
prefilled (scheduling, in-flight deduplication, page preparation); ``*_cpu_ms``: this
process's CPU time, which other processes' load does not inflate.

A decode-only step of TorchBackend replays the CUDA graph of its key (batch bucket, pages
bucket, LoRA, form, cascade tiles bucket); a key not captured ahead is captured by the step
itself (two eager forwards and a capture: hundreds of ms on the 8B shape, inside a timed
tick). Each step's key is computed here from its batch, and the steps are counted whose key
``capture_decode_graphs`` leaves out: ``late_steps`` with this tree's rule
(``runner.ahead_keys``), ``late_steps_one_tile`` with the rule before it (one tile slot:
every batch of more rows than a tile holds missed). Each run adds its rows under
``--label`` to ``pressure_tick_<machine>.json`` (rows of other labels are kept, and the
table prints them all: labels measured back to back compare).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from engine_overhead_bench import TimedMock
from tqdm import tqdm

from forkserve import Engine, ForkServeConfig
from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.model_config import llama3_8b_config
from forkserve.backend.torch.runner import ahead_keys, key_of
from forkserve.bench.multilora.systems import SPECS
from forkserve.bench.multilora.workload import (
    MultiLoraParams,
    budget_pages,
    page_bytes,
    run_workload,
)
from forkserve.bench.output import (
    add_out_argument,
    legend_below,
    new_figure,
    save_figure,
    write_json,
)
from forkserve.bench.provenance import source_commit
from forkserve.kernels import cascade_tile_agents


class KeyedMock(TimedMock):
    """Counts the graph key of each decode-only step (rows alone, as TorchBackend replays),
    and the decode rows that came as ``DecodeBatch`` columns (the steady set's) against
    those that came as items (the general path: a Demand, a Grant and a SeqWork each)."""

    def __init__(self, config: ForkServeConfig, agents: int,
                 invocations: Mapping[str, Sequence[int]] | None = None) -> None:
        super().__init__(config, invocations=invocations)
        self.agents, self.keys = agents, Counter()
        self.steady_rows = self.item_rows = 0

    def launch(self, work, batch):
        self.steady_rows += 0 if batch is None else len(batch)
        self.item_rows += sum(w.decode for w in work)
        if not work and batch is not None and len(batch):
            plan = cascade_tiles.plan(batch.shared_prefix, self.config.page_size, self.agents)
            width = int(batch.positions.max()) // self.config.page_size + 1
            self.keys[key_of(len(batch), width, any(a is not None for a in batch.adapter_ids),
                             any(r is not None for r in batch.residual_pages),
                             len(plan.tile_rows) if plan is not None else 0)] += 1
        return super().launch(work, batch)


def measure(params: MultiLoraParams, system: str = "disaggregated", overlap: bool = False,
            profile: cProfile.Profile | None = None) -> dict:
    """One run of ``system`` (bench/multilora/systems.py); ``profile``: enabled around the
    run's ticks alone."""
    spec = SPECS[system]
    model = llama3_8b_config()
    sizes = page_bytes(model, params.rank, params.page_size, torch.bfloat16)
    base, residual = budget_pages(sizes, params, spec.layout)
    host_pages = int(params.host_residual_gib * 2 ** 30 // sizes["residual"]) \
        if spec.layout.has_residual_pool else 0
    cfg = ForkServeConfig(page_size=params.page_size, num_pages=base,
                          num_residual_pages=residual, kv_layout=spec.layout,
                          host_residual_pages=host_pages,
                          pause_pin=params.pause_pin, hbm_tokens=base * params.page_size,
                          max_batch_tokens=16384, max_context=16384, node_ttl_s=None,
                          vocab_size=512, overlap=overlap)
    agents = cascade_tile_agents(model.num_heads // model.num_kv_heads)
    name = (lambda i: f"agent{i}") if spec.lora else None
    backend = KeyedMock(cfg, agents, None if spec.invocation is None else
                        {name(i): spec.invocation for i in range(params.workflows)})
    backend.start(0.0)
    engine = Engine(backend)
    m = engine.metrics
    kinds = {kind: [0, 0.0, 0.0] for kind in ("decode", "prefill")}  # ticks, wall s, CPU s
    tick = engine.tick

    def timed_tick() -> bool:  # a tick's time by kind, the mock's own left out
        decode, prefill = m.decode_tokens, m.prefill_tokens
        mock, mock_cpu = backend.backend_s, backend.backend_cpu_s
        t0, cpu0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        did = tick()
        if profile is not None:
            profile.disable()
        kind = ("prefill" if m.prefill_tokens > prefill
                else "decode" if m.decode_tokens > decode else None)
        if kind is not None:
            acc = kinds[kind]
            acc[0] += 1
            acc[1] += time.perf_counter() - t0 - (backend.backend_s - mock)
            acc[2] += time.process_time() - cpu0 - (backend.backend_cpu_s - mock_cpu)
        return did

    engine.tick = timed_tick
    result = run_workload(system, params, engine, sizes, name, invocation=spec.invocation)
    engine.check_integrity()
    context_pages = -(-(params.context + params.instruction
                        + params.turns * (params.gen + params.observation)) // params.page_size)
    now = set(ahead_keys(params.workflows, context_pages, spec.lora,
                         [spec.layout.has_residual_pool], agents))
    one_tile = {k for k in now if k[4] <= 1}
    steps = sum(backend.keys.values())
    per_tick = {f"{kind}_{name}": s * 1e3 / max(1, n)
                for kind, (n, wall, cpu) in kinds.items()
                for name, s in (("ms", wall), ("cpu_ms", cpu))}
    return {"system": system, "overlap": overlap, "workflows": params.workflows,
            "host_residual_gib": params.host_residual_gib,
            "pause_pin": params.pause_pin, "decode_only_ticks": kinds["decode"][0],
            "prefill_ticks": kinds["prefill"][0], **per_tick,
            "mean_decode_batch": result.mean_decode_batch,
            "restored_tokens": result.restored_tokens,
            "residual_prefill_tokens": result.residual_prefill_tokens,
            "pins_kept": result.pins_kept, "pins_lost": result.pins_lost,
            "outputs_sha256": result.outputs_sha256,
            # Decode rows stepped as the steady set's columns (overlap launches only these)
            # over all decode rows.
            "steady_row_share": backend.steady_rows
            / max(1, backend.steady_rows + backend.item_rows),
            "graph_keys": len(backend.keys), "graph_steps": steps,
            "late_steps": sum(n for k, n in backend.keys.items() if k not in now),
            "late_keys": sum(k not in now for k in backend.keys),
            "late_steps_one_tile": sum(n for k, n in backend.keys.items() if k not in one_tile),
            "late_keys_one_tile": sum(k not in one_tile for k in backend.keys)}


def plot_ticks(rows: Sequence[Mapping], category: Callable[[Mapping], str], path: Path,
               title: str) -> None:
    """Engine CPU ms per decode-only and per prefill tick, one bar per label (source tree)
    in each ``category`` of rows (D1 on / off, system x W): labels measured back to back
    compare."""
    groups = list(dict.fromkeys(category(r) for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.8 / len(labels)
    fig, axes = new_figure(2, width=max(8.0, 1.2 * len(groups) + 4), height=4.6)
    for ax, key, what in ((axes[0], "decode_cpu_ms", "decode-only tick"),
                          (axes[1], "prefill_cpu_ms", "prefill tick")):
        for j, label in enumerate(labels):
            by = {category(r): r[key] for r in rows if r["label"] == label}
            xs = [g for g in range(len(groups)) if groups[g] in by]
            ax.bar([x + (j - (len(labels) - 1) / 2) * width for x in xs],
                   [by[groups[x]] for x in xs], width, label=label)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("engine CPU ms per tick (mock excluded)")
        ax.set_title(what)
        ax.grid(axis="y", alpha=0.3)
    legend_below(fig, axes[0])
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def save_ticks(path: Path, args: argparse.Namespace, rows: Sequence[Mapping],
               category: Callable[[Mapping], str], title: str, **fields: object) -> None:
    """The rows (and ``fields``) as JSON at ``path`` under the run's common parameters, and
    their plot beside it (``plot_ticks``)."""
    write_json(path, {"machine": args.machine, "device": "cpu",
                      "backend": "MockBackend (engine only)", "workflows": args.workflows,
                      "context": args.context, "turns": args.turns, "gen": args.gen,
                      "kv_budget_gib": args.kv_budget_gib, **fields, "rows": rows})
    plot_ticks(rows, category, path.with_suffix(".png"), title)



def add_tick_arguments(ap: argparse.ArgumentParser, kv_budget_gib: float) -> None:
    """What every tick replay takes alike: the react run's shape, this tree's label and the
    machine's name (the JSON keeps other labels' rows, so before/after sit in one file)."""
    ap.add_argument("--context", type=int, default=8192, help="shared context tokens")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--kv-budget-gib", type=float, default=kv_budget_gib)
    ap.add_argument("--pause-s", type=float, default=0.01,
                    help="tool pause (the mock's steps are fast: a short pause keeps it quick)")
    ap.add_argument("--label", default="now", help="this source tree's name in the JSON")
    ap.add_argument("--machine", default="cpu", help="the machine's name, in the file name")
    add_out_argument(ap)


def react_params(args: argparse.Namespace, workflows: int, **over) -> MultiLoraParams:
    """The react run ``add_tick_arguments`` describes, at ``workflows`` agents."""
    return MultiLoraParams(workload="react", workflows=workflows, context=args.context,
                           turns=args.turns, gen=args.gen, pause_s=args.pause_s,
                           kv_budget_gib=args.kv_budget_gib, **over)


def other_labels(path: Path, label: str, key: str = "rows") -> list:
    """``path``'s ``key`` entries of every label but ``label`` (a rerun replaces its own)."""
    old = json.loads(path.read_text()).get(key, []) if path.exists() else []
    return [r for r in old if r["label"] != label]

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workflows", type=int, default=128, help="agents W")
    ap.add_argument("--residual-share", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per mode; the row of the median engine CPU ms is kept")
    add_tick_arguments(ap, kv_budget_gib=24.0)
    args = ap.parse_args(argv)
    path = args.out / f"pressure_tick_{args.machine}.json"
    rows = other_labels(path, args.label)
    commit = source_commit()
    for on in (False, True):
        params = react_params(args, args.workflows, residual_share=args.residual_share,
                              host_residual_gib=4.0 if on else 0.0, pause_pin=on, reopen=True)
        runs = sorted((measure(params) for _ in tqdm(range(args.repeats),
                                                     desc=f"D1 {'on' if on else 'off'}")),
                      key=lambda run: run["decode_cpu_ms"])
        rows.append({"label": args.label, "commit": commit, "repeats": args.repeats}
                    | runs[len(runs) // 2])
    print(f"react --reopen on a MockBackend at the 8B page shape, W={args.workflows}, CPU: "
          f"engine ms per tick (mock excluded), wall (this process's CPU), median of "
          f"{args.repeats}; decode steps (keys) whose graph a step captured itself, by the "
          f"rule captured ahead: this tree's / one tile slot")
    print(f"{'label':>8} {'commit':>8} {'D1':>3} {'decode ms':>14} {'prefill ms':>15} "
          f"{'batch':>6} {'restored':>9} {'late':>7} {'late one tile':>14}")
    for r in rows:
        print(f"{r['label']:>8} {r['commit'][:8]:>8} {'on' if r['pause_pin'] else 'off':>3} "
              f"{r['decode_ms']:>6.2f} ({r['decode_cpu_ms']:>5.2f}) "
              f"{r['prefill_ms']:>6.1f} ({r['prefill_cpu_ms']:>6.1f}) "
              f"{r['mean_decode_batch']:>6.1f} {r['restored_tokens']:>9} "
              f"{r['late_steps']:>3} ({r['late_keys']}) "
              f"{r['late_steps_one_tile']:>8} ({r['late_keys_one_tile']})")
    save_ticks(path, args, rows, lambda r: f"D1 {'on' if r['pause_pin'] else 'off'}",
               f"react --reopen, W = {args.workflows}, MockBackend at the 8B page shape (CPU)",
               residual_share=args.residual_share)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
