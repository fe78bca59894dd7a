"""``forkserve bench react|mapreduce``: every system side by side at each W, a table, a JSON
and a PNG; exits 1 when a run failed."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from forkserve.bench.multilora.recompute_choice import choose
from forkserve.bench.multilora.report import FailedRun, format_table, plot, variant
from forkserve.bench.multilora.scale import FULL, TINY, Scale, tiny_threads
from forkserve.bench.multilora.step_profile import profile_lines
from forkserve.bench.multilora.systems import SYSTEMS, UnknownSystem, spec
from forkserve.bench.multilora.workload import (
    MultiLoraParams,
    RunResult,
    build_backend,
    rehearse,
    run_system,
    tiny_config,
    warm_up,
)
from forkserve.bench.output import add_out_argument, write_json
from forkserve.bench.provenance import measured_on, source_commit
from forkserve.engine.heap import thaw
from forkserve.errors import OutOfPagesError


def parser(scale: Scale) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="forkserve bench react|mapreduce",
        description="seed 001's multi-LoRA workloads (docs/WORKLOADS.md), every KV layout side "
                    "by side. The defaults shown are those of this scale: add --tiny to --help "
                    "to see the tiny ones.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    ap.add_argument("workload", choices=["react", "mapreduce"], help="which workload")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model on the CPU with small defaults (minutes on 2 cores); "
                         "the plot title says 'tiny / CPU'")
    ap.add_argument("--workflows", type=int, nargs="+", default=list(scale.workflows), metavar="W",
                    help="the W values (concurrent agent workflows)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), type=_system,
                    metavar="SYSTEM",
                    help=f"systems to run, one engine each, of {', '.join(SYSTEMS)}, and "
                         "recompute<N> (disaggregated with the N most drifting layers exact "
                         "per reader; --drift)")
    ap.add_argument("--drift", type=Path, default=None, metavar="DRIFT.json",
                    help="the drift profile (benchmarks/quality/drift.py) recompute<N> takes its "
                         "layers from; default: the committed SmolLM2 one "
                         "(benchmarks/results/quality_h200_drift.json), read at the model's "
                         "depth")
    ap.add_argument("--context", type=int, default=scale.context, help="shared context tokens C")
    ap.add_argument("--turns", type=int, default=scale.turns, help="react turns T per workflow")
    ap.add_argument("--gen", type=int, default=scale.gen, help="tokens G generated per turn")
    ap.add_argument("--kv-budget-gib", type=float, default=scale.kv_budget_gib,
                    help="KV bytes for every system")
    ap.add_argument("--residual-share", type=float, default=scale.residual_share,
                    help="share of the budget for the residual pool of the disaggregated layouts")
    ap.add_argument("--closed-loop", action="store_true",
                    help="each workflow moves on when its turn ends (off: lockstep turns, as the "
                         "vLLM anchor was measured)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction,
                    default=torch.cuda.is_available(),
                    help="per system, one untimed 2-agent run and the decode graphs captured, "
                         "and per W one untimed rehearsal run (at most 2 turns), before "
                         "the timed runs (on by default on CUDA)")
    ap.add_argument("--settle-heap", action=argparse.BooleanOptionalAction,
                    default=torch.cuda.is_available(),
                    help="start each timed run on a settled heap: earlier runs' garbage "
                         "collected, the rest frozen out of the cycle collector's passes, as "
                         "the server does after loading (engine/heap.py; on by default on CUDA)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs per system and W; the one with the median tasks/s is "
                         "reported (the lower middle one of an even count)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times over, the systems' order reversed "
                         "every other round, each round on a backend built afresh: a card that "
                         "warms (or throttles) through a run then favours no system, and the "
                         "rows carry each round's tasks/s (round_tasks_per_s) for paired ratios")
    ap.add_argument("--cascade", nargs="+", choices=["on", "off"], default=["on"],
                    help="shared-prefix (cascade) attention of the backend; both: each W runs "
                         "twice")
    ap.add_argument("--overlap", nargs="+", choices=["on", "off"], default=["off"],
                    help="the engine's overlap (config.overlap: the next decode step is planned "
                         "while the device runs this one); both: each W runs twice")
    ap.add_argument("--gpu-timeline", action="store_true",
                    help="record the device's idle time between decode steps (GpuTimeline; "
                         "the gpu_idle_share column)")
    ap.add_argument("--profile-ticks", type=int, default=0,
                    help="profile this many prefill and decode ticks of each run (torch.profiler:"
                         " kernel time by category, top kernels, device idle; the step_profile "
                         "entry of the JSON)")
    ap.add_argument("--host-residual-gib", type=float, default=0.0,
                    help="host tier for evicted residual pages (disaggregated layouts; 0: none)")
    ap.add_argument("--pause-pin", action="store_true",
                    help="pin a closed session's base pages through its tool pause (D1)")
    ap.add_argument("--reopen", action="store_true",
                    help="stateless turns: each turn closes its session, the next re-sends the "
                         "whole history (what the host tier and pause pins serve)")
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--plot", type=Path, metavar="RESULT.json",
                    help="run nothing: print the table of a JSON this command wrote and draw "
                         "its PNG beside it")
    add_out_argument(ap)
    return ap


def _system(name: str) -> str:
    try:
        spec(name)
    except UnknownSystem as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def main(argv: list[str] | None = None) -> int:
    """Returns the exit status: 0, or 1 when any run failed."""
    argv = list(argv or [])
    ap = parser(TINY if "--tiny" in argv else FULL)
    args = ap.parse_args(argv)
    if args.plot is not None:
        return replot(args.plot, args.workload)
    model_cfg = _model_config(args.tiny)
    for name in args.systems:  # a recompute<N> the model or profile cannot take: before any run
        if spec(name).recompute:
            try:
                choose(spec(name).recompute, model_cfg.num_layers, args.drift)
            except (ValueError, FileNotFoundError) as e:
                ap.error(f"{name}: {e}")
    device = torch.device(args.device)
    stem = (f"{args.workload}_multilora{'_tiny' if args.tiny else ''}"
            f"{'_' + args.tag if args.tag else ''}")
    json_path = args.out / f"{stem}.json"
    with tiny_threads(device, args.tiny):
        _run_all(args, model_cfg, device, json_path)
    print(f"wrote {json_path}")
    return replot(json_path, args.workload)


def replot(path: Path, workload: str) -> int:
    """The table and the PNG of a JSON ``main`` wrote (``main`` ends here too; a GPU call cut
    before its plot runs it alone); exits 1 when it records failed runs, as the run did."""
    doc = json.loads(path.read_text())
    results = [RunResult.from_json(r) for r in doc["results"]]
    failed = [FailedRun(**f) for f in doc.get("errors", [])]
    print(format_table(results, workload))
    for f in failed:
        print(f.line())
    plot(results, failed, path.with_suffix(".png"), workload, doc.get("model") == "tiny",
         measured_on(doc))
    return 1 if failed else 0


def _model_config(tiny: bool):
    from forkserve.backend.torch.model_config import llama3_8b_config

    return tiny_config() if tiny else llama3_8b_config()


def _run_all(args: argparse.Namespace, model_cfg, device: torch.device,
             json_path: Path) -> None:
    """Every system at every W, ``--rounds`` times over, into ``json_path``: rewritten after
    each run, so what a cut call leaves is the same file."""
    from forkserve.backend.torch.weights import random_weights

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = random_weights(model_cfg, device, dtype)
    # Runs by (system, W, cascade, overlap), then by round; the rows are made from them.
    runs: dict[tuple[str, int, bool, bool], list[list[RunResult]]] = {}
    orders: list[list[str]] = []
    failed: list[FailedRun] = []
    commit = source_commit()

    def rows() -> list[RunResult]:  # in the order of --systems, whatever order a round ran
        keys = sorted((k for k, v in runs.items() if any(v)),
                      key=lambda k: args.systems.index(k[0]))
        return [_row(runs[k]) for k in keys]

    def params(w: int, **over) -> MultiLoraParams:
        return MultiLoraParams(**(dict(workload=args.workload, workflows=w, context=args.context,
                                       turns=args.turns, gen=args.gen,
                                       kv_budget_gib=args.kv_budget_gib,
                                       residual_share=args.residual_share,
                                       lockstep=not args.closed_loop,
                                       host_residual_gib=args.host_residual_gib,
                                       pause_pin=args.pause_pin, reopen=args.reopen,
                                       drift=str(args.drift or "")) | over))

    def save() -> None:  # after every run, so a later failure or timeout loses nothing
        write_json(json_path, {
            "workload": f"{args.workload}-multilora",
            "driver": "closed-loop" if args.closed_loop else "lockstep",
            "model": "tiny" if args.tiny else "llama3-8b-shape", "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "commit": commit,
            "context": args.context, "turns": args.turns, "gen": args.gen,
            "kv_budget_gib": args.kv_budget_gib, "residual_share": args.residual_share,
            "host_residual_gib": args.host_residual_gib, "pause_pin": args.pause_pin,
            "reopen": args.reopen, "drift": str(args.drift or ""),
            "rounds": orders, "results": [asdict(r) for r in rows()],
            "errors": [asdict(f) for f in failed]},
            quiet=True)

    top = max(args.workflows)

    def timed_on_one_backend(system: str, n: int, bar: tqdm) -> None:
        """Round ``n`` of ``system``: a backend built afresh, every W (and variant) timed on
        it. The backend is the caller's to free once this returns."""
        at = system + (f" (round {n + 1}/{args.rounds})" if args.rounds > 1 else "")
        bar.set_postfix_str(f"{at}: building the backend")
        backend, sizes = build_backend(system, params(top), max(top, 2), model_cfg, weights,
                                       device, dtype)
        if args.warmup:  # compile kernels and capture graphs outside the timed runs
            bar.set_postfix_str(f"{at}: warm-up")
            warm_up(system, params(top), backend, sizes)
        if args.gpu_timeline:
            backend.record_gpu_timeline()
        for w, cascade, overlap in ((w, c == "on", o == "on") for w in args.workflows
                                    for c in args.cascade for o in args.overlap):
            backend.cascade_attention = cascade
            # The Engine of each run reads its config from the backend.
            backend.config = backend.config.replace(overlap=overlap)
            off = variant(cascade, overlap)
            bar.set_postfix_str(f"{at} W={w}{off}")
            rounds = runs.setdefault((system, w, cascade, overlap),
                                     [[] for _ in range(args.rounds)])
            try:
                if args.warmup:
                    bar.set_postfix_str(f"{at} W={w}{off}: rehearsal")
                    built = rehearse(system, params(w), backend, sizes).kernels_built_in_run
                    bar.set_postfix_str(f"{at} W={w}{off} ({built} kernels built by its "
                                        "rehearsal)")
                rounds[n] = [replace(run_system(system, params(w), backend, sizes, bar.update,
                                                args.profile_ticks, args.settle_heap),
                                     cascade=cascade, overlap=overlap, commit=commit)
                             for _ in range(args.repeat)]
                last = _median(rounds[n])
                bar.write(f"{system:<18} W={w:<3} {last.tasks_per_s:8.3f} tasks/s{off}"
                          f"{_extras(last)}")
                for line in profile_lines(last.step_profile):
                    bar.write(line)
            except (RuntimeError, OutOfPagesError, torch.cuda.OutOfMemoryError) as exc:
                failed.append(FailedRun(system, w, f"{type(exc).__name__}: {exc}", cascade,
                                        overlap, n if args.rounds > 1 else None))
                bar.write(failed[-1].line())
            save()

    total = (sum(params(w).turns_run * w for w in args.workflows) * len(args.systems)
             * args.repeat * args.rounds * len(args.cascade) * len(args.overlap))
    with tqdm(total=total, desc=f"{args.workload} agent turns", unit="turn") as bar:
        for n in range(args.rounds):
            order = args.systems if n % 2 == 0 else args.systems[::-1]
            orders.append(list(order))
            for system in order:
                timed_on_one_backend(system, n, bar)
                thaw()  # the backend's cycles, frozen with each run's heap, go before the next
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def _extras(r: RunResult) -> str:
    """The optional figures of a run: device idle, and D1's under pressure."""
    out = f", GPU idle {r.gpu_idle_share:.1%}" if r.gpu_idle_share is not None else ""
    if r.graphs_captured_in_run:
        out += f", {r.graphs_captured_in_run} decode graphs captured in the run"
    if r.kernels_built_in_run or r.dynamo_graphs_in_run:
        out += (f", {r.kernels_built_in_run} kernels built in the run "
                f"({r.kernel_build_s_in_run:.1f} s: {', '.join(r.kernels_built)})"
                + (f", {r.dynamo_graphs_in_run} dynamo graphs" if r.dynamo_graphs_in_run else ""))
    if r.fa4_compiled_in_run:
        out += f", {r.fa4_compiled_in_run} FlashAttention-4 kernels compiled in the run"
    if r.prefill_routes:
        out += ", prefill routes " + " ".join(f"{k}:{n}" for k, n in r.prefill_routes)
    if r.restored_tokens or r.pins_kept or r.pins_lost:
        out += (f", residual restored/recomputed {r.restored_tokens}/{r.residual_prefill_tokens}"
                f", pins kept/lost {r.pins_kept}/{r.pins_lost}")
    if r.host_copy_calls:
        out += (f", host copies {r.host_copy_calls} ({r.host_copy_bytes / 2 ** 20:.0f} MiB, "
                f"{r.host_copy_ms:.0f} ms host), per decode step "
                f"{r.decode_host_copies_per_step:.2f} ({r.decode_host_copy_ms_per_step:.2f} ms)")
    return out


def _median(runs: list[RunResult]) -> RunResult:
    """The run of median tasks/s, the lower middle one of an even count (a median that
    never flatters), noting the others when repeated."""
    runs = sorted(runs, key=lambda r: r.tasks_per_s)
    median = runs[(len(runs) - 1) // 2]
    if len(runs) == 1:
        return median
    spread = ", ".join(f"{r.tasks_per_s:.3f}" for r in runs)
    return replace(median, notes=median.notes + (f"median of {len(runs)} runs: {spread} tasks/s",))


def _row(rounds: list[list[RunResult]]) -> RunResult:
    """One system's row at one W from its runs by round: the median run of them all and,
    over several rounds, each round's median tasks/s (None: that round failed), so a reader
    pairs systems round by round."""
    row = _median([r for runs in rounds for r in runs])
    if len(rounds) == 1:
        return row
    return replace(row, round_tasks_per_s=tuple(
        _median(runs).tasks_per_s if runs else None for runs in rounds))


if __name__ == "__main__":
    raise SystemExit(main())
