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
``--profile N``: cProfile's top N functions of one more alora run at the largest W. Each run
adds its rows under ``--label`` to ``alora_tick_<machine>.json`` (other labels are kept).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

from pressure_tick_bench import measure

from forkserve.bench.multilora.workload import MultiLoraParams
from forkserve.bench.output import add_out_argument, write_json
from forkserve.bench.provenance import source_commit

SYSTEMS = ("alora", "no_lora")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workflows", type=int, nargs="+", default=[64, 128, 256], help="agents W")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--context", type=int, default=8192, help="shared context tokens")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--kv-budget-gib", type=float, default=100.0)
    ap.add_argument("--pause-s", type=float, default=0.01,
                    help="tool pause (the mock's steps are fast: a short pause keeps it quick)")
    ap.add_argument("--overlap", choices=("on", "off"), default="on")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per system and W; the row of the median engine CPU ms is kept")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print cProfile's top N functions of an alora run at the largest W")
    ap.add_argument("--label", default="now", help="this source tree's name in the JSON")
    ap.add_argument("--machine", default="cpu", help="the machine's name, in the file name")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    overlap = args.overlap == "on"
    path = args.out / f"alora_tick_{args.machine}.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in old if r["label"] != args.label]
    commit = source_commit()

    def params(workflows: int) -> MultiLoraParams:
        return MultiLoraParams(workload="react", workflows=workflows, context=args.context,
                               turns=args.turns, gen=args.gen, pause_s=args.pause_s,
                               kv_budget_gib=args.kv_budget_gib)

    for system in args.systems:
        for w in args.workflows:
            runs = sorted((measure(params(w), system, overlap) for _ in range(args.repeats)),
                          key=lambda run: run["decode_cpu_ms"])
            rows.append({"label": args.label, "commit": commit, "repeats": args.repeats}
                        | runs[len(runs) // 2])
    if args.profile:
        profile = cProfile.Profile()
        measure(params(max(args.workflows)), "alora", overlap, profile)
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
    write_json(path, {"machine": args.machine, "device": "cpu",
                      "backend": "MockBackend (engine only)", "workflows": args.workflows,
                      "context": args.context, "turns": args.turns, "gen": args.gen,
                      "kv_budget_gib": args.kv_budget_gib, "overlap": overlap, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
