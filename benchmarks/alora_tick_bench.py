"""The react bench's aLoRA system on a MockBackend: the engine's ms per tick against no_lora's
(CPU figures; the GPU idle of issue 21's stage ``alora``).

    python benchmarks/alora_tick_bench.py --label after --out benchmarks/results
    PYTHONPATH=<an export of an older commit> FORKSERVE_COMMIT=<its hash> \
        python benchmarks/alora_tick_bench.py --label before --out benchmarks/results

The workload of ``forkserve bench react --systems alora --kv-budget-gib 100 --overlap on`` at
the Llama-3-8B page shape, timed as ``pressure_tick_bench.py`` times it (its ``measure``: the
mock's own work left out, ``decode_ms`` the Engine's planning per decode-only tick, wall and
this process's CPU), beside ``no_lora`` (the same agents as the base model: every decode row
in the steady set, every decode tick overlapped). ``steady_row_share``: the decode rows that
reached the backend as the steady set's columns; the rest came as items of the general path
(a Demand, a Grant, a SeqWork each), which ``config.overlap`` cannot launch ahead.
``--profile N``: cProfile's top N functions of one more alora run at the largest W.

``--torch W...``: the alora system through the real ``TorchBackend`` (``tiny_config``'s random
2-layer Llama on the CPU, float32, overlap on, a ``--torch-context`` context): each decode step
by how it reached the runner (``columns``: the steady set's ``DecodeBatch``, ``forward_rows``;
``items``: decode-shaped ``SeqWork``, ``forward``), the graph key it would replay on a GPU
(``runner.graph_key``: a CPU runs eagerly) against those ``capture_decode_graphs`` captures
ahead (``late_steps``: a capture inside the step), and the backend's host preparation per
decode step (``TorchPhases``: ``launch`` less the forward and the sampling). Each run adds
its rows under ``--label`` to ``alora_tick_<machine>.json`` (other labels are kept).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
from collections import Counter
from dataclasses import replace

from engine_overhead_bench import TorchPhases
from pressure_tick_bench import (
    add_tick_arguments,
    measure,
    other_labels,
    react_params,
    save_ticks,
)
from tqdm import tqdm

from forkserve.bench.multilora.workload import (
    MultiLoraParams,
    build_backend,
    run_system,
    tiny_config,
)
from forkserve.bench.provenance import source_commit

SYSTEMS = ("alora", "no_lora")
# The tiny model's KV budget: 16 KiB pages, room for 256 agents over a few K tokens (the 8B
# shape's 100 GiB would be allocated on the CPU).
TORCH_KV_GIB = 0.25


def measure_torch(params: MultiLoraParams) -> dict:
    """One alora run on a tiny TorchBackend (CPU): its decode steps by path, their graph keys
    and the backend's preparation per decode step (``--torch`` above)."""
    import torch

    from forkserve.backend.torch import cascade as cascade_tiles
    from forkserve.backend.torch.decode_rows import of_items
    from forkserve.backend.torch.kept_tables import KeptTables
    from forkserve.backend.torch.runner import ahead_keys, decode_shaped, graph_key
    from forkserve.backend.torch.weights import random_weights

    model, cpu = tiny_config(), torch.device("cpu")
    backend, sizes = build_backend("alora", params, params.workflows, model,
                                   random_weights(model, cpu, torch.float32), cpu, torch.float32)
    backend.config = backend.config.replace(overlap=True)
    runner = backend.runner
    keys: Counter = Counter()
    step: list[str] = []  # the path of the launch in progress
    kept = KeptTables(runner.limits.page_size, runner.cascade_agents)  # the items' tables

    def forward_rows(rows, plan, *rest, run=runner.forward_rows):
        step.append("columns")
        keys[graph_key(rows, plan)] += 1
        return run(rows, plan, *rest)

    def forward(work, slots, all_logits, hidden_states=False, *rest, run=runner.forward):
        if decode_shaped(work) and not all_logits and not hidden_states:
            step.append("items")
            plan = cascade_tiles.plan([w.shared_prefix for w in work], runner.limits.page_size,
                                      runner.cascade_agents)
            keys[graph_key(of_items(work, runner.limits, slots, runner.pool.scratch_page,
                                    runner.pool.scratch_residual_page, kept), plan)] += 1
        return run(work, slots, all_logits, hidden_states, *rest)

    runner.forward_rows, runner.forward = forward_rows, forward
    phases = TorchPhases(backend)
    prepare: dict[str, list[float]] = {"columns": [], "items": []}

    def launch(work, batch=None, run=backend.launch):
        s, step[:] = phases.seconds, []
        before = s["launch"] - s["forward"] - s["draw"]
        handle = run(work, batch)
        if step:
            prepare[step[0]].append((s["launch"] - s["forward"] - s["draw"] - before) * 1e3)
        return handle

    backend.launch = launch
    result = run_system("alora", params, backend, sizes)
    context_pages = -(-(params.context + params.instruction
                        + params.turns * (params.gen + params.observation)) // params.page_size)
    ahead = set(ahead_keys(params.workflows, context_pages, True, [False],
                           runner.cascade_agents))
    return {"workflows": params.workflows, "context": params.context,
            **{f"{path}_steps": len(ms) for path, ms in prepare.items()},
            **{f"{path}_prepare_ms": statistics.median(ms) if ms else None
               for path, ms in prepare.items()},
            "graph_keys": len(keys),
            "late_steps": sum(n for k, n in keys.items() if k not in ahead),
            "outputs_sha256": result.outputs_sha256}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workflows", type=int, nargs="+", default=[64, 128, 256], help="agents W")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--overlap", choices=("on", "off"), default="on")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per system and W; the row of the median engine CPU ms is kept")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print cProfile's top N functions of an alora run at the largest W")
    ap.add_argument("--torch", type=int, nargs="*", default=[], metavar="W",
                    help="also run these W on a tiny TorchBackend (CPU)")
    ap.add_argument("--torch-context", type=int, default=1024)
    add_tick_arguments(ap, kv_budget_gib=100.0)
    args = ap.parse_args(argv)
    overlap = args.overlap == "on"
    path = args.out / f"alora_tick_{args.machine}.json"
    rows = other_labels(path, args.label)
    torch_rows = other_labels(path, args.label, "torch_rows")
    commit = source_commit()

    for system, w in tqdm([(s, w) for s in args.systems for w in args.workflows],
                          desc="systems x W", unit="point"):
        runs = sorted((measure(react_params(args, w), system, overlap)
                       for _ in range(args.repeats)), key=lambda run: run["decode_cpu_ms"])
        rows.append({"label": args.label, "commit": commit, "repeats": args.repeats}
                    | runs[len(runs) // 2])
    for w in args.torch:
        torch_rows.append({"label": args.label, "commit": commit}
                          | measure_torch(replace(react_params(args, w), context=args.torch_context,
                                                kv_budget_gib=TORCH_KV_GIB)))
    if args.profile:
        profile = cProfile.Profile()
        measure(react_params(args, max(args.workflows)), "alora", overlap, profile)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())
    print(f"react on a MockBackend at the 8B page shape, overlap {args.overlap}, CPU: engine ms "
          f"per tick (mock excluded), wall (this process's CPU), median of {args.repeats}; "
          f"steady: the decode rows stepped as the steady set's columns")
    print(f"{'label':>8} {'commit':>8} {'system':>8} {'W':>4} {'decode ms':>14} "
          f"{'prefill ms':>15} {'batch':>6} {'steady':>7} {'late':>5}")
    for r in rows:
        print(f"{r['label']:>8} {r['commit'][:8]:>8} {r['system']:>8} {r['workflows']:>4} "
              f"{r['decode_ms']:>6.2f} ({r['decode_cpu_ms']:>5.2f}) "
              f"{r['prefill_ms']:>6.1f} ({r['prefill_cpu_ms']:>6.1f}) "
              f"{r['mean_decode_batch']:>6.1f} {r['steady_row_share']:>7.2f} "
              f"{r['late_steps']:>5}")
    if torch_rows:
        print("alora on a tiny TorchBackend (CPU, overlap on): decode steps by path, the "
              "backend's median preparation ms per step, steps whose graph key was not "
              "captured ahead")
        print(f"{'label':>8} {'commit':>8} {'W':>4} {'columns':>14} {'items':>14} {'late':>5}")
    for r in torch_rows:
        cells = [f"{r[f'{p}_steps']:>4} ({r[f'{p}_prepare_ms'] or 0:>6.2f})"
                 for p in ("columns", "items")]
        print(f"{r['label']:>8} {r['commit'][:8]:>8} {r['workflows']:>4} {cells[0]:>14} "
              f"{cells[1]:>14} {r['late_steps']:>5}")
    save_ticks(path, args, rows, lambda r: f"{r['system']} W={r['workflows']}",
               f"react, overlap {args.overlap}, MockBackend at the 8B page shape (CPU)",
               overlap=overlap, torch_model="tiny_config (2 layers, hidden 128), float32, CPU",
               torch_context=args.torch_context, torch_rows=torch_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
