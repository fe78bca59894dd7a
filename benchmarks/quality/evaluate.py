"""Evaluate trained adapters through forkserve's Engine + TorchBackend in every KV layout.

    python -m benchmarks.quality.evaluate --adapters benchmarks/results/quality_adapters --tag h200

Round r: the held-out item r of each of the K tasks; the K agents (agent i = task i's adapter)
share one system message, the function catalog of all K items plus distractors, and each asks
its own question. One agent, the writer (round r: agent r mod K), opens first and generates;
then the other K - 1 open, finding the writer's published pages where the layout shares them,
and decode together. The layouts and sharing modes (unified, disaggregated, full_reuse,
base_activations, neutral, recompute<N>, offset<R>, no_lora; alora_unified and alora with
``--alora-adapters``) are the strategies of ``modes.py``; a mode with a prelude (a base-model
pass) runs it over the shared context before the writer opens. ``recompute<N>`` needs
``--drift`` (``drift.py``'s output): its N layers are the most drifting ones there;
``offset<R>`` fits its offset tables on training prompts before its unit runs, and runs eager
attention whatever ``--attention`` says (``offsets.py``). The aLoRA modes run the adapters of
``train.py --alora``, whose invocation (the assistant-turn opener) every prompt must hold after
the shared catalog: checked before anything runs.

Per agent: accuracy (ast_check), token F1 of the call text, its tokens (report.py pairs
them with its mode's reference: unified, or alora_unified for the aLoRA rows), and, with
hidden states on, for the agents that read a context cached by another (the readers) the
cosine similarity of the residual stream after each layer to the reference's, over the
agent's own tokens (question and answer) up to the first token where its answer leaves the
reference's.

The work is cut into units (units.py): one layout over one block of rounds, saved as it
ends. A rerun skips saved units, ``--layouts`` and ``--first/--end`` pick a subset, and
``--deadline-s`` stops starting units that would not finish in time (a device call's limit).
``--jobs N`` runs the modes in N worker processes (the reference modes first when hidden states
are recorded); each process builds a mode's backend once for all its units.
Hidden states cost speed (every step eager); ``--no-hidden --dtype bfloat16 --attention
triton --cuda-graphs`` is the fast accuracy-only pass.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from benchmarks.quality import modes, offsets, units
from benchmarks.quality.ast_check import check, token_f1
from benchmarks.quality.data import DEFAULT_CATEGORIES, Round, build_tasks, eval_rounds
from benchmarks.quality.hidden_states import RecordingBackend, layer_cosines, stack
from benchmarks.quality.modes import Adapters, Mode, Prelude
from benchmarks.quality.units import AgentResult, Unit
from benchmarks.quality.workers import die_with_parent, worker_env
from forkserve.bench.multilora.recompute_choice import load_drift
from forkserve.bench.output import DEFAULT_OUT
from forkserve.bench.provenance import source_commit
from forkserve.control.activation import Invocation
from forkserve.control.recompute_policy import LayerDrift

LAYOUTS = modes.DEFAULT
DEFAULT_CACHE = Path("/tmp/forkserve-quality-cache")


@dataclass(frozen=True)
class EvalParams:
    rounds: int = 40
    distractors: int = 4
    max_new: int = 128
    page_size: int = 16
    heldout: int = 40
    seed: int = 0
    categories: tuple[str, ...] = DEFAULT_CATEGORIES
    device: str = "cpu"
    dtype: str = "float32"
    attention: str = "eager"
    cuda_graphs: bool = False
    hidden: bool = True   # record hidden states (every step eager) for the cosine columns
    block: int = 10       # rounds per saved unit


@dataclass(frozen=True)
class Inputs:
    """What every unit of one evaluation shares: loaded once per process."""

    rounds: tuple[Round, ...]
    prompts: tuple[tuple[list[int], ...], ...]
    model_config: Any
    weights: Any
    adapters: Mapping[str, Any]  # task -> its plain LoRA adapter
    tokenizer: Any
    alora: Mapping[str, Any]     # task -> its activated LoRA adapter; empty without them
    anchors: tuple[tuple[int, ...], ...] = ()  # offset correction's fit prompts (training items)

    def adapters_of(self, mode: Mode) -> Mapping[str, Any]:
        """The adapters ``mode``'s backend loads (the base-model mode loads the plain ones and
        runs none of them)."""
        return self.alora if mode.adapters is Adapters.ALORA else self.adapters


@dataclass(frozen=True)
class Reference:
    """The reference mode's answers and hidden states over the rounds of one unit: what the
    cosines compare with."""

    tokens: Mapping[units.AgentKey, tuple[int, ...]]
    hidden: Mapping[units.AgentKey, torch.Tensor]


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def fingerprint(folder: Path) -> str:
    """Of the adapter weights: units of retrained adapters must not merge with these."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*/adapter_model.safetensors")):
        h.update(f.parent.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def setting(params: EvalParams, model: Path) -> dict[str, Any]:
    d = asdict(params)
    del d["block"]  # how the rounds are cut does not change a result
    d["categories"] = list(d["categories"])
    return dict(d, model=model.name)


def mode_setting(base: Mapping[str, Any], mode: Mode, plain: str | None, alora: str | None,
                 offset_fit: Mapping[str, Any]) -> dict[str, Any]:
    """A unit's setting: ``base`` (``setting``), plus the fingerprint of the adapters the mode
    loads (``plain`` or the aLoRA ones ``alora``), and for an offset mode what its tables were
    fitted from and the attention it ran (units.OPTIONAL: only some units carry each, so that
    adding rows keeps every saved unit)."""
    if mode.adapters is Adapters.ALORA:
        if alora is None:
            raise ValueError(f"{mode.name} runs activated-LoRA adapters: give --alora-adapters "
                             "(train.py --alora)")
        return dict(base, alora_adapters=alora)
    if plain is None:
        raise ValueError(f"{mode.name} runs the plain adapters: give --adapters (train.py)")
    if mode.corrects:
        return dict(base, adapters=plain, offset_fit=dict(offset_fit))
    return dict(base, adapters=plain)


def check_activation(rounds: Sequence[Round], prompts: Sequence[Sequence[Sequence[int]]],
                     alora: Mapping[str, Any]) -> None:
    """Every aLoRA agent's prompt holds its adapter's invocation after the round's shared
    catalog; otherwise the adapter would apply nowhere (or inside the catalog) and the rows
    would measure something else."""
    for rnd, round_prompts in zip(rounds, prompts, strict=True):
        shared = common_prefix(round_prompts)
        for example, p in zip(rnd.examples, round_prompts, strict=True):
            task = example.task
            tokens = alora[task].invocation_tokens
            if tokens is None:
                raise ValueError(f"the aLoRA adapter of {task} has no alora_invocation_tokens: "
                                 "train it with train.py --alora")
            start = Invocation(tokens).last_start(p, 0)
            if start is None or start < shared:
                raise ValueError(f"round {rnd.index}, {task}: the prompt has no invocation "
                                 f"{tokens} after its {shared}-token shared context (found at "
                                 f"{start}); the adapters and this tokenizer's chat template "
                                 "disagree")


@dataclass
class ModeRun:
    """One mode's backend and engine, built once and reused by every unit of that mode a
    process runs (a build captures CUDA graphs and fits offset tables: seconds a unit would
    repeat). Each round ends with every session closed and the cache evicted, so a unit
    finds it as a fresh one would."""

    layout: str
    mode: Mode
    backend: Any
    engine: Any
    layers: tuple[int, ...]
    table: Any  # offset tables, for a mode that corrects


def open_mode(layout: str, inputs: Inputs, params: EvalParams,
              drift: LayerDrift | None = None) -> ModeRun | None:
    """``layout``'s backend and engine, sized for the longest prompt of every round; None for
    a recompute mode without a drift profile to choose its layers from."""
    from forkserve.engine import Engine

    mode = modes.mode(layout)
    layers = modes.recompute_layers(mode, drift)
    if layers is None:
        return None
    k = len(inputs.rounds[0].examples)
    longest = max(len(p) for ps in inputs.prompts for p in ps)
    pages = 2 * k * (-(-(longest + params.max_new) // params.page_size)) + 64
    dtype = getattr(torch, params.dtype)
    backend = RecordingBackend.from_weights(
        mode.config(layers, page_size=params.page_size, num_pages=pages, num_residual_pages=pages,
                    max_batch_tokens=4096),
        inputs.model_config, inputs.weights, inputs.adapters_of(mode), device=params.device,
        dtype=dtype, attention=offsets.ATTENTION if mode.corrects else params.attention,
        use_cuda_graphs=params.cuda_graphs, compile_fusions=False)
    table = None
    if mode.corrects:
        table = offsets.fit(inputs.model_config, inputs.weights, inputs.adapters_of(mode),
                            inputs.anchors, mode.offset_rank, params.device, dtype,
                            params.page_size)
        backend.install_offsets(table)
    return ModeRun(layout, mode, backend, Engine(backend), layers, table)


def run_unit(layout: str, first: int, end: int, inputs: Inputs, params: EvalParams,
             config: Mapping[str, Any], reference: Reference | None,
             drift: LayerDrift | None = None, run: ModeRun | None = None
             ) -> tuple[Unit, dict[units.AgentKey, torch.Tensor]]:
    """Rounds first .. end-1 in one layout or mode; (the unit, each agent's hidden states from
    the shared prefix on). ``reference``: the reference mode's hidden states for the
    cosines, if recorded; ``drift``: the profile recompute modes choose their layers from;
    ``run``: ``layout``'s backend from an earlier unit (built here when None)."""
    if run is None:
        run = open_mode(layout, inputs, params, drift)
    if run is None:
        return Unit(layout, first, end, False, "needs a drift profile (--drift, drift.py's "
                    "output) to choose its layers; not run", config,
                    commit=source_commit()), {}
    mode, backend, engine, layers, table = run.mode, run.backend, run.engine, run.layers, run.table
    rounds, prompts = inputs.rounds[first:end], inputs.prompts[first:end]
    k = len(rounds[0].examples)
    flops = 0
    prefill_before = engine.metrics.prefill_tokens
    lora = mode.adapters is not Adapters.NONE
    record = params.hidden and lora and (mode.is_reference or reference is not None)
    context_bytes = 0
    stop = inputs.tokenizer.eos_token_ids
    agents: list[AgentResult] = []
    hidden: dict[units.AgentKey, torch.Tensor] = {}
    start = time.perf_counter()
    for rnd, round_prompts in zip(rounds, prompts, strict=True):
        names = [e.task for e in rnd.examples]
        ids = [backend.adapter_id(n) if lora else None for n in names]
        shared = common_prefix(round_prompts)
        if record:
            backend.watch({aid: shared for aid in ids if aid is not None})
        prelude(engine, mode, round_prompts[0][:shared], ids)
        context_bytes += mode.context_kv_bytes(backend.kv_bytes_per_token(), shared, k)
        writer = rnd.index % k
        sessions, reused = {}, {}
        for i in [writer] + [j for j in range(k) if j != writer]:
            before = engine.metrics.base_hit_tokens
            sessions[i] = engine.open(round_prompts[i], adapter=ids[i],
                                      reuse_prefix=mode.reuse_prefix).id
            reused[i] = engine.metrics.base_hit_tokens - before
            if i == writer:  # the writer's pages are published before anyone else opens
                engine.generate(sessions[i], params.max_new, stop=stop)
            else:
                engine.start_generate(sessions[i], params.max_new, stop=stop)
        while any(engine.generation(s) is None for s in sessions.values()):
            if not engine.tick():
                raise RuntimeError(f"{layout}: generation stalled in round {rnd.index}")
        kept = backend.take() if record else {}
        for i, example in enumerate(rnd.examples):
            out = list(engine.generation(sessions[i]).tokens)
            text = inputs.tokenizer.decode([t for t in out if t not in stop])
            verdict = check(text, example.item.ground_truth, example.item.functions)
            key = (rnd.index, example.task)
            mine = stack(kept, ids[i], shared) if record else None
            cos: tuple[float, ...] = ()
            compared = 0
            if table is not None:  # the prefill and each decode step re-correct what it reused
                flops += offsets.extra_flops(table, inputs.model_config.kv_size,
                                             inputs.model_config.num_layers, reused[i], len(out))
            if mine is not None and mode.is_reference:
                hidden[key] = mine
            elif mine is not None and reference is not None and reused[i] > 0:
                same = common_prefix([out, list(reference.tokens[key])])
                # The question, then the answer while it still equals the reference's.
                cos, compared = layer_cosines(mine, reference.hidden[key],
                                              len(round_prompts[i]) - shared + same)
            agents.append(AgentResult(rnd.index, example.task, example.item.id, i == writer,
                                      len(round_prompts[i]), shared, reused[i], tuple(out), text,
                                      verdict.valid, verdict.error, token_f1(text, example.target),
                                      cos, compared))
        for s in sessions.values():
            engine.close(s)
        engine.evict_all()  # the next round has another catalog: nothing left to hit
    unit = Unit(layout, first, end, True, "" if record or not params.hidden or not lora
                else "no reference hidden states for these rounds: no cosines", config,
                tuple(agents), engine.metrics.prefill_tokens - prefill_before,
                time.perf_counter() - start,
                context_bytes, layers, table.nbytes if table is not None else 0, flops,
                source_commit())
    return unit, hidden


def prelude(engine: Any, mode: Mode, context: Sequence[int], ids: Sequence[int | None]) -> None:
    """What writes the shared context before the round's writer opens, if anything."""
    if mode.prelude is Prelude.BASE_ACTIVATIONS:
        engine.prefill_shared(context, ids)
    elif mode.prelude is Prelude.NEUTRAL:
        session = engine.open(context, adapter=None).id  # the base model: BASE pages
        engine.generate(session, 1)
        engine.close(session)


def load_inputs(model: Path, adapter_dir: Path | None, params: EvalParams,
                alora_dir: Path | None = None) -> Inputs:
    from forkserve.backend.torch import load_model
    from forkserve.backend.torch.lora import load_peft_adapter
    from forkserve.backend.torch.tokenizer import Tokenizer

    tasks = build_tasks(params.categories, params.heldout, params.seed)
    rounds = eval_rounds(tasks, params.rounds, params.distractors, params.seed)
    tokenizer = Tokenizer.load(model)
    prompts = tuple(tuple(tokenizer.apply_chat_template(e.messages(False)) for e in r.examples)
                    for r in rounds)
    model_cfg, weights = load_model(model, torch.device(params.device),
                                    getattr(torch, params.dtype))
    adapters = {} if adapter_dir is None else \
        {t.name: load_peft_adapter(adapter_dir / t.name, t.name) for t in tasks}
    alora = {} if alora_dir is None else \
        {t.name: load_peft_adapter(alora_dir / t.name, t.name) for t in tasks}
    if alora:
        check_activation(rounds, prompts, alora)
    anchors = offsets.anchor_prompts(tasks, tokenizer, params.distractors, params.seed)
    return Inputs(tuple(rounds), prompts, model_cfg, weights, adapters, tokenizer, alora, anchors)


def evaluate(model: Path, adapter_dir: Path | None, params: EvalParams, out: Path, cache: Path,
             layouts: Sequence[str] = LAYOUTS, first: int = 0, end: int | None = None,
             deadline_s: float | None = None, log: Any = print,
             drift: Path | None = None, alora_dir: Path | None = None) -> list[Unit]:
    """Run the units of ``layouts`` x blocks of rounds [first, end) not saved in ``out`` yet,
    each saved as it ends; returns the units run now. Stops before a unit that would end
    past ``deadline_s`` (seconds from now, judged by the longest unit so far). ``drift``:
    ``drift.py``'s JSON, which the recompute modes choose their layers from; ``alora_dir``:
    the activated-LoRA adapters (``train.py --alora``) the aLoRA modes run."""
    base = setting(params, model)
    plain = fingerprint(adapter_dir) if adapter_dir is not None else None
    alora = fingerprint(alora_dir) if alora_dir is not None else None
    # An unknown name, or a mode without its adapters, is refused before anything runs.
    def config_of(layout: str) -> dict[str, Any]:
        return mode_setting(base, modes.mode(layout), plain, alora, offsets.SETTING)

    configs = {layout: config_of(layout) for layout in layouts}
    t0 = time.perf_counter()
    profile = load_drift(drift) if drift is not None else None
    # Mode by mode, so that consecutive units share their mode's backend (``ModeRun``); the
    # reference mode comes first (modes.order_key), as the others' cosines read its units.
    todo = [(layout, a, b) for layout in sorted(dict.fromkeys(layouts), key=modes.order_key)
            for a, b in units.blocks(params.rounds, params.block)
            if a >= first and (end is None or b <= end)
            and units.find(out, layout, a, b, configs[layout]) is None]
    if not todo:
        return []
    inputs = load_inputs(model, adapter_dir, params, alora_dir)
    done: list[Unit] = []
    run: ModeRun | None = None
    for layout, a, b in todo:
        elapsed = time.perf_counter() - t0
        longest = max((u.seconds for u in done), default=0.0)
        if deadline_s is not None and elapsed + 1.25 * longest > deadline_s:
            log(f"deadline: {len(todo) - len(done)} units left for the next run")
            break
        if run is None or run.layout != layout:
            run = None  # the last mode's backend goes before the next one is built
            run = open_mode(layout, inputs, params, profile)
        unit, hidden = run_unit(layout, a, b, inputs, params, configs[layout],
                                reference_for(layout, a, b, params, out, cache,
                                              config_of(modes.mode(layout).reference)),
                                profile, run)
        if hidden:
            cache.mkdir(parents=True, exist_ok=True)
            torch.save(hidden, units.hidden_path(cache, layout, a, b))
        units.save(unit, out)
        done.append(unit)
        log(f"{unit.name}: {len(unit.agents)} agents in {unit.seconds:.1f} s "
            f"({time.perf_counter() - t0:.0f} s since start) {unit.note}")
    return done


def reference_for(layout: str, first: int, end: int, params: EvalParams, out: Path, cache: Path,
                  config: Mapping[str, Any]) -> Reference | None:
    """The saved answers and cached hidden states of ``layout``'s reference mode for these
    rounds, when both exist (``config``: the reference's setting)."""
    mode = modes.mode(layout)
    if mode.is_reference or not params.hidden:
        return None
    unit = units.find(out, mode.reference, first, end, config)
    path = units.hidden_path(cache, mode.reference, first, end)
    if unit is None or not path.exists():
        return None
    return Reference({a.key: a.tokens for a in unit.agents}, torch.load(path))


def partition(layouts: Sequence[str], jobs: int) -> list[list[str]]:
    """``layouts`` in at most ``jobs`` groups of about equal work, each group in the order
    ``evaluate`` runs them: an offset mode (eager attention, tables fitted first) weighs about
    what four others do (SmolLM2 on the H200: 14-23 s a unit against 4-9)."""
    def weight(layout: str) -> int:
        return 4 if modes.mode(layout).corrects else 1

    groups: list[list[str]] = [[] for _ in range(min(jobs, len(layouts)))]
    load = [0] * len(groups)
    for layout in sorted(layouts, key=lambda x: (-weight(x), modes.order_key(x))):
        i = load.index(min(load))
        groups[i].append(layout)
        load[i] += weight(layout)
    return [sorted(g, key=modes.order_key) for g in groups if g]


def run_jobs(argv: Sequence[str], layouts: Sequence[str], jobs: int, hidden: bool,
             deadline_s: float | None) -> int:
    """``layouts`` split among ``jobs`` worker processes (``partition``), each this module
    with its own ``--layouts``, saving its units into the one folder; 1 if any worker failed
    (the units the others saved are kept). With hidden states the reference modes run first:
    the others' cosines read the hidden states they leave in the cache folder."""
    t0 = time.perf_counter()
    first = [x for x in layouts if hidden and modes.mode(x).is_reference]
    failed: list[str] = []
    for phase in (first, [x for x in layouts if x not in first]):
        if not phase:
            continue
        left = [] if deadline_s is None else \
            ["--deadline-s", f"{deadline_s - (time.perf_counter() - t0):.0f}"]
        groups = partition(phase, jobs)
        env = worker_env(len(groups))
        print(f"{len(phase)} modes in {len(groups)} worker processes: "
              + "; ".join(",".join(g) for g in groups), flush=True)
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.quality.evaluate", *argv,
                                   *left, "--layouts", ",".join(g), "--jobs", "1", "--worker"],
                                  env=env)
                 for g in groups]
        failed += [",".join(g) for g, p in zip(groups, procs, strict=True) if p.wait() != 0]
    for group in failed:
        print(f"the worker of {group} failed (its saved units are kept; run again)",
              file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.report import write_outputs

    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None,
                    help=".gguf or HF folder (default: SmolLM2 GGUF)")
    ap.add_argument("--adapters", type=Path, default=None,
                    help="folder with one PEFT folder per task (train.py --out); every mode but "
                         "the activated-LoRA ones runs them")
    ap.add_argument("--tag", default="h200",
                    help="units in RESULTS/quality_<tag>/, the report in RESULTS/quality_<tag>.*")
    ap.add_argument("--results", type=Path, default=DEFAULT_OUT,
                    help="output folder; benchmarks/results holds the committed runs")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help="unified's hidden states, per unit (large; not results)")
    ap.add_argument("--alora-adapters", type=Path, default=None,
                    help="the activated-LoRA adapters (train.py --alora): adds the aLoRA modes")
    ap.add_argument("--layouts", default=None,
                    help="layouts and modes (modes.py), recompute<N> for any N (default: "
                         "modes.DEFAULT, and modes.ALORA with --alora-adapters)")
    ap.add_argument("--drift", type=Path, default=None,
                    help="drift.py's JSON: the recompute modes take its most drifting layers")
    ap.add_argument("--rounds", type=int, default=EvalParams.rounds)
    ap.add_argument("--first", type=int, default=0, help="run only the blocks from this round on")
    ap.add_argument("--end", type=int, default=None, help="... and before this round")
    ap.add_argument("--block", type=int, default=EvalParams.block, help="rounds per saved unit")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no unit that would end later than this many seconds from now")
    ap.add_argument("--distractors", type=int, default=EvalParams.distractors)
    ap.add_argument("--max-new", type=int, default=EvalParams.max_new)
    ap.add_argument("--heldout", type=int, default=EvalParams.heldout)
    ap.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=EvalParams.dtype, choices=("float32", "bfloat16"))
    ap.add_argument("--attention", default=EvalParams.attention, choices=("eager", "triton"))
    ap.add_argument("--cuda-graphs", action="store_true", help="decode through CUDA graphs")
    ap.add_argument("--no-hidden", action="store_true",
                    help="accuracy only: no hidden-state cosines (steps may use CUDA graphs)")
    ap.add_argument("--label", default="", help="what the adapters are (printed with the table)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the modes in up to this many worker processes at once (a small "
                         "model's decode leaves the GPU mostly idle)")
    # A worker of --jobs: runs its --layouts, leaves the report to its parent.
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.worker:
        die_with_parent()
    if args.model is None:
        from forkserve.backend.torch import find_smollm2_gguf
        args.model = find_smollm2_gguf()
    params = EvalParams(args.rounds, args.distractors, args.max_new, 16, args.heldout, args.seed,
                        tuple(args.categories.split(",")), args.device, args.dtype, args.attention,
                        args.cuda_graphs, not args.no_hidden, args.block)
    folder = args.results / f"quality_{args.tag}"
    layouts = tuple(args.layouts.split(",")) if args.layouts else \
        (LAYOUTS if args.adapters else ()) + (modes.ALORA if args.alora_adapters else ())
    if not layouts:
        ap.error("nothing to run: give --adapters, --alora-adapters or both")
    for layout in layouts:
        modes.mode(layout)  # an unknown name is refused here, not in every worker
    rc = 0
    if args.jobs > 1 and len(layouts) > 1:
        rc = run_jobs(argv, layouts, args.jobs, not args.no_hidden, args.deadline_s)
    else:
        evaluate(args.model, args.adapters, params, folder, args.cache / args.tag, layouts,
                 args.first, args.end, args.deadline_s, drift=args.drift,
                 alora_dir=args.alora_adapters)
    if not args.worker:
        print(write_outputs(folder, args.label))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
