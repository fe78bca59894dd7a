"""vLLM 0.26 under the ForkServe control plane, side by side with ForkServe's own engine.

    python benchmarks/vllm_side_by_side.py            # on the H200 (docs/VLLM_BACKEND.md)
    python benchmarks/vllm_side_by_side.py --tiny     # CPU: ours run, vLLM runs skipped (missing)

1. react-multilora (forkserve/bench/multilora/, same driver and KV budget) at W = 1, 8, 32:
   ForkServe's TorchBackend systems through ``run_system``; ``vllm`` / ``vllm_no_lora``:
   the same Engine and driver on ``VllmBackend`` (one LoRA per agent / base model); and
   ``vllm_native``: plain vLLM, no control plane, each turn one lockstep batch of every
   agent's whole history with its LoRA (forkserve/backend/vllm/native.py). vLLM's KV pool is
   fixed at the budget's pages plus a small headroom for the partial tail blocks it
   recomputes, so no system gets more KV than the budget (plus that headroom).
   Our systems run as the CLI (``forkserve bench react``) runs them: one backend per system,
   built for the largest W, warmed up once (``warm_up``: an untimed 2-agent run, then the
   decode graphs captured), rehearsed untimed at each W (``rehearse``) and reused for every W
   (``--no-warmup``: cold, as before); the
   report says which (``"warmup"``).
2. decode ms/step at prompt 512, batch 1 and 64 (64 over 32 adapters with LoRA): our
   TorchBackend (no_lora's / unified's backend, decode graphs captured first; decode_bench's
   ``Bench.decode``, median after 2 warm steps), and, where a vLLM engine runs,
   ``VllmBackend.step`` (one vLLM request per sequence per step) beside vLLM's own decode
   loop (``LLM.generate`` of the same prompts), i.e. what the translation costs.

One vLLM engine (Llama-3-8B shape, dummy bf16 weights, token ids only) serves every vLLM run;
pins are released and the prefix cache reset between runs. Writes vllm_side_by_side.json
to --out (default ./forkserve-bench-results) after every run, so a timeout loses nothing;
``--stop-at`` (a Unix time) records the runs not started by then as skipped, so one GPU
call ends on time. ``--rows-from`` merges an earlier report: this run's rows replace its
rows of the same (system, W, cascade, overlap), its decode entries are merged by (batch,
LoRA), this run's fields winning. ``main(argv, harness)`` reuses a vLLM engine the caller started
(benchmarks/h200_vllm.py shares one across its tests, fan-out and this).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork  # noqa: E402
from forkserve.bench.multilora import (  # noqa: E402
    SYSTEMS,
    MultiLoraParams,
    RunResult,
    budget_pages,
    build_backend,
    format_table,
    page_bytes,
    random_adapter,
    rehearse,
    run_system,
    run_workload,
    tiny_config,
    warm_up,
)
from forkserve.bench.multilora.driver import observation  # noqa: E402
from forkserve.bench.multilora.scale import FULL, TINY, tiny_threads  # noqa: E402
from forkserve.bench.multilora.workload import agent_prompts  # noqa: E402
from forkserve.bench.output import add_out_argument, write_json  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.config import ForkServeConfig, KVLayout  # noqa: E402
from forkserve.engine import Engine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import Bench  # noqa: E402

VLLM_SYSTEMS = ("vllm", "vllm_no_lora", "vllm_native")
PAGE, RANK = 16, 16  # tokens per KV page, LoRA rank (the workload's)
DECODE_PROMPT = 512
DECODE_CASES = ((1, False), (1, True), (64, False), (64, True))  # (batch, LoRA)
DECODE_ADAPTERS = 32  # batch 64 with LoRA: sequence i runs agent{i % 32}
DECODE_WARM_STEPS = 2
# The decode entries' columns (absent where not run), with their labels.
DECODE_COLUMNS = (("torch_backend_ms_per_step", "TorchBackend"),
                  ("vllm_backend_ms_per_step", "Engine on VllmBackend"),
                  ("native_vllm_ms_per_step", "vLLM's own loop"))


@dataclass
class VllmHarness:
    """The one vLLM engine every vLLM run shares (its start takes 50-95 s on the H200)."""

    llm: Any
    api: Any
    pinner: Any
    gauge: Any  # KvGauge: vLLM's most referenced blocks
    model_cfg: Any
    assets: Path
    kv_pages: int
    agents: int  # adapters agent0..agent{agents-1}, rank RANK

    def lora_modules(self) -> dict[str, str]:
        """Every agent's adapter, whatever W a run uses: vLLM caches a LoRA by its int id,
        so ids (1..n in name order, AdapterTable) must mean the same adapter in every run."""
        from forkserve.backend.vllm.bench_assets import write_peft_adapter

        modules = {}
        for i in range(self.agents):
            path = self.assets / f"agent{i}"
            if not path.exists():
                # Drawn where TorchBackend's bench draws its own (build_backend): the same
                # seed on the same device gives both engines the same deltas, and fast.
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                adapter = random_adapter(self.model_cfg, f"agent{i}", RANK, device, seed=i)
                write_peft_adapter(adapter, path)
            modules[f"agent{i}"] = str(path)
        return modules

    def lora_ref(self, i: int) -> Any:
        from forkserve.backend.vllm.adapters import AdapterTable

        return AdapterTable(self.lora_modules()).resolve(f"agent{i}")


def start_vllm(model_cfg, budget_pages: int, max_workflows: int, rank: int, page: int,
               utilization: float, cow_blocks: bool) -> VllmHarness:
    from forkserve.backend.vllm.bench_assets import write_model_dir
    from forkserve.backend.vllm.block_pinner import KvManagerPinner
    from forkserve.backend.vllm.kv_gauge import KvGauge
    from forkserve.backend.vllm.vllm_loader import api, build_llm

    assets = Path(tempfile.mkdtemp(prefix="forkserve_vllm_"))
    model = write_model_dir(model_cfg, assets / "model")
    # Headroom beyond the budget's pages (which pins may fill): a running request holds at
    # most a partial tail block and a recomputed last block, and a step runs a few requests
    # per workflow (the spine and its speculative children).
    blocks = budget_pages + 8 * max(32, max_workflows)
    cfg = ForkServeConfig(page_size=page, num_pages=budget_pages, max_context=model_cfg.max_context,
                          vocab_size=model_cfg.vocab_size)
    llm = build_llm(str(model), cfg, max_loras=max_workflows, gpu_memory_utilization=utilization,
                    max_lora_rank=rank, llm_kwargs=dict(
                        load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                        num_gpu_blocks_override=blocks, max_num_seqs=max(256, 2 * max_workflows)))
    pinner = None
    if cow_blocks:
        try:
            pinner = KvManagerPinner.attach(llm.llm_engine)
        except RuntimeError as exc:  # the engine took a minute to start: run without pins
            print(f"WARNING: {exc}; every VllmBackend run is cow_blocks=False", flush=True)
    return VllmHarness(llm, api(), pinner, KvGauge.attach(llm.llm_engine), model_cfg, assets,
                       budget_pages, max_workflows)


def run_vllm_system(system: str, params: MultiLoraParams, harness: VllmHarness,
                    two_class: bool) -> RunResult:
    """``run_system``'s body with VllmBackend in place of the TorchBackend it builds."""
    from forkserve.backend.vllm import VllmBackend

    model_cfg = harness.model_cfg
    sizes = page_bytes(model_cfg, params.rank, params.page_size, torch.bfloat16)
    num_pages, _ = budget_pages(sizes, params, KVLayout.UNIFIED)
    cfg = ForkServeConfig(page_size=params.page_size, num_pages=num_pages, num_residual_pages=1,
                          kv_layout=KVLayout.UNIFIED, hbm_tokens=num_pages * params.page_size,
                          max_batch_tokens=16384, max_context=model_cfg.max_context,
                          node_ttl_s=None, vocab_size=model_cfg.vocab_size)
    lora = {} if system == "vllm_no_lora" else harness.lora_modules()
    harness.llm.reset_prefix_cache()
    backend = VllmBackend.on_engine(cfg, harness.llm.llm_engine, harness.api, pinner=harness.pinner,
                                    lora_modules=lora, two_class=two_class,
                                    cow_blocks=harness.pinner is not None)
    adapter_of = None if system == "vllm_no_lora" else (lambda i: backend.adapter_id(f"agent{i}"))
    notes = [{"two_class": two_class, "cow_blocks": harness.pinner is not None}]
    try:
        result = run_workload(system, params, Engine(backend), sizes, adapter_of, notes=notes)
    finally:
        backend.close()
    result.notes[0]["vllm"] = backend.stats.as_dict()
    return result


def run_native_react(params: MultiLoraParams, harness: VllmHarness) -> RunResult:
    """Plain vLLM on react-multilora: each turn, every agent's whole history in one lockstep
    batch (``gen`` tokens, greedy, its LoRA), then the pause and the observation, as the
    Engine's driver does; vLLM's prefix cache supplies what it still holds."""
    from forkserve.backend.vllm.native import run_batch

    vocab = harness.model_cfg.vocab_size
    sizes = page_bytes(harness.model_cfg, params.rank, params.page_size, torch.bfloat16)
    _, histories = agent_prompts(params, vocab)
    loras = [harness.lora_ref(i) for i in range(params.workflows)]
    harness.llm.reset_prefix_cache()
    harness.gauge.reset()
    engine = harness.llm.llm_engine
    prompt = cached = 0
    turns: list[float] = []
    start = time.perf_counter()
    for turn in range(params.turns):
        if turn:
            time.sleep(params.pause_s)
        batch = run_batch(engine, harness.api, histories, params.gen, loras)
        turns.append(batch.seconds)
        prompt, cached = prompt + batch.prompt_tokens, cached + batch.cached_tokens
        for i, out in enumerate(batch.tokens):
            histories[i] += list(out) + observation(turn + 1, i, params.observation, vocab)
    makespan = time.perf_counter() - start
    peak = harness.gauge.peak_blocks * sizes["base"]
    lat = sorted(turns)
    decode = params.workflows * params.turns * params.gen
    return RunResult("vllm_native", params.workflows, params.workflows / makespan, makespan,
                     statistics.median(lat), lat[-1], peak, peak / params.workflows,
                     cached / max(1, prompt), float(params.workflows), 0.0, sum(turns), 0.0,
                     prompt - cached, decode, 0.0, notes=({"vllm": {
                         "prompt_tokens": prompt, "cached_tokens": cached,
                         "peak_blocks": harness.gauge.peak_blocks}},))


def decode_side_by_side(harness: VllmHarness, batch: int, lora: bool, steps: int,
                        page: int) -> dict:
    """ms per decode step: VllmBackend.step (with the config's default decode-ahead K, one
    request per sequence per K steps; K = 1: one per step) and vLLM's own loop (one
    ``LLM.generate`` of ``steps`` tokens) on the same prompts."""
    from forkserve.backend.vllm import VllmBackend

    vocab = harness.model_cfg.vocab_size
    adapters = harness.lora_modules() if lora else {}
    names = [f"agent{i % harness.agents}" if lora else None for i in range(batch)]
    prompts = [[(b * 977 + j * 31) % (vocab - 3) + 3 for j in range(DECODE_PROMPT)]
               for b in range(batch)]
    pages_per_seq = -(-(DECODE_PROMPT + steps + 1) // page)
    cfg = ForkServeConfig(page_size=page, num_pages=batch * pages_per_seq,
                          max_context=harness.model_cfg.max_context, vocab_size=vocab)
    harness.llm.reset_prefix_cache()
    backend = VllmBackend.on_engine(cfg, harness.llm.llm_engine, harness.api, pinner=harness.pinner,
                                    lora_modules=adapters, cow_blocks=harness.pinner is not None)
    slots = [KVSlots(tuple(range(b * pages_per_seq, (b + 1) * pages_per_seq)))
             for b in range(batch)]
    first = backend.step([SeqWork(b, tuple(prompts[b]), 0, slots[b], names[b], GREEDY)
                          for b in range(batch)])
    tokens = [list(p) + [t] for p, t in zip(prompts, first.next_tokens, strict=True)]
    times = []
    for _ in range(steps):
        work = [SeqWork(b, (tokens[b][-1],), len(tokens[b]) - 1, slots[b], names[b], GREEDY,
                        decode=True) for b in range(batch)]
        t0 = time.perf_counter()
        out = backend.step(work)
        times.append((time.perf_counter() - t0) * 1000)
        for b, t in enumerate(out.next_tokens):
            tokens[b].append(t)
    backend.close()
    refs = [backend.adapters.resolve(n) for n in names]
    lreqs = [harness.api.lora_request(lora_name=r.name, lora_int_id=r.int_id, lora_path=r.path)
             for r in refs] if lora else None
    batch_prompts = [{"prompt_token_ids": p} for p in prompts]

    def params(n: int) -> Any:
        return harness.api.sampling_params(n=1, max_tokens=n, temperature=0.0, ignore_eos=True,
                                           detokenize=False)

    # Prompts cached first (as VllmBackend's were by its untimed first step), then timed.
    harness.llm.generate(batch_prompts, params(1), lora_request=lreqs, use_tqdm=False)
    t0 = time.perf_counter()
    harness.llm.generate(batch_prompts, params(steps), lora_request=lreqs, use_tqdm=False)
    native_ms = (time.perf_counter() - t0) * 1000 / steps
    return {"batch": batch, "lora": lora, "steps": steps,
            "vllm_decode_ahead": cfg.vllm_decode_ahead,
            # The mean, as vLLM's loop is timed: with decode-ahead most steps are served
            # from the lookahead and a median would report those alone.
            "vllm_backend_ms_per_step": statistics.fmean(times),
            "vllm_backend_ms_per_step_median": statistics.median(times),
            "native_vllm_ms_per_step": native_ms,
            "vllm_stats": backend.stats.as_dict()}


def torch_decode_backend(lora: bool, steps: int, model_cfg, weights, device: torch.device,
                         dtype: torch.dtype):
    """Our backend for the decode comparison: unified's (32 adapters) with LoRA, no_lora's
    without, its KV pool just large enough for 64 sequences of the decode prompt and steps."""
    pages_per_seq = -(-(DECODE_PROMPT + DECODE_WARM_STEPS + steps + 1) // PAGE)
    sizes = page_bytes(model_cfg, RANK, PAGE, dtype)
    pages = max(b for b, _ in DECODE_CASES) * pages_per_seq + 2  # + 2: no float rounding short
    params = MultiLoraParams("react", DECODE_ADAPTERS, DECODE_PROMPT, rank=RANK, page_size=PAGE,
                             kv_budget_gib=pages * sizes["base"] / 2 ** 30)
    backend, _ = build_backend("unified" if lora else "no_lora", params, DECODE_ADAPTERS,
                               model_cfg, weights, device, dtype)
    return backend, pages_per_seq


def torch_decode(backend, pages_per_seq: int, batch: int, lora: bool, steps: int) -> dict:
    """ms per decode step of TorchBackend.step (batch building, graph replay, greedy sampling,
    host sync: what the Engine pays), prompt DECODE_PROMPT, with LoRA ``batch`` sequences over
    DECODE_ADAPTERS adapters; the decode graphs are captured first, as our engine does."""
    ids = ([backend.adapter_id(f"agent{i}") for i in range(DECODE_ADAPTERS)] if lora
           else [None])
    backend.capture_decode_graphs(batch, DECODE_PROMPT + DECODE_WARM_STEPS + steps + 1)
    r = Bench(backend, pages_per_seq).decode(batch, DECODE_PROMPT, ids, steps,
                                             warmup=DECODE_WARM_STEPS)
    return {"batch": batch, "lora": lora, "steps": steps,
            "torch_backend_ms_per_step": r["ms_per_step"]}


def _row_key(r: dict) -> tuple:
    return r["system"], r["workflows"], r.get("cascade", True), r.get("overlap", False)


def merge_reports(report: dict, earlier: dict | None, source: str = "") -> dict:
    """``report`` (this run) over ``earlier`` (``--rows-from``): each row of this run replaces
    the earlier row of its (system, W, cascade, overlap), in place; an earlier error of a
    (system, W) this run measured or failed goes; decode entries merge by (batch, LoRA), this
    run's fields winning. The rest of the report (workload, warm-up, ...) is this run's."""
    if earlier is None:
        return report
    mine = {_row_key(r): r for r in report["results"]}
    results = [mine.pop(_row_key(r), r) for r in earlier["results"]] + list(mine.values())
    done = {(e["system"], e["workflows"]) for e in report["results"] + report["errors"]}
    errors = [e for e in earlier["errors"] if (e["system"], e["workflows"]) not in done]
    decode: dict[tuple, dict] = {}
    for d in [*earlier.get("decode", []), *report["decode"]]:
        key = (d["batch"], d["lora"])
        decode[key] = {**decode.get(key, {}), **d}
    return {**report, "results": results, "errors": errors + report["errors"],
            "decode": [decode[k] for k in sorted(decode)], "merged_from": source}


def decode_line(d: dict) -> str:
    """One decode entry, whichever columns it has."""
    cols = "; ".join(f"{label} {d[k]:.2f}" for k, label in DECODE_COLUMNS if k in d)
    return f"decode b={d['batch']:<3} lora={d['lora']!s:<5} {cols} (ms/step)"


def main(argv: list[str] | None = None, harness: VllmHarness | None = None) -> int:
    """Returns the exit status: 1 when a run of this call failed (vLLM missing is not a
    failure, nor an error an earlier report of ``--rows-from`` records).
    ``harness``: a vLLM engine already started (``start_vllm``), used instead of a new one."""
    from forkserve.backend.torch.model_config import llama3_8b_config

    argv = list(sys.argv[1:] if argv is None else argv)
    scale = TINY if "--tiny" in argv else FULL
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workflows", type=int, nargs="+", default=list(scale.workflows), metavar="W",
                    help="the W values")
    ap.add_argument("--systems", nargs="+", default=[*SYSTEMS, *VLLM_SYSTEMS],
                    choices=[*SYSTEMS, *VLLM_SYSTEMS], metavar="SYSTEM",
                    help=f"of {', '.join([*SYSTEMS, *VLLM_SYSTEMS])}")
    ap.add_argument("--context", type=int, default=scale.context, help="shared context tokens C")
    ap.add_argument("--turns", type=int, default=scale.turns, help="react turns T")
    ap.add_argument("--gen", type=int, default=scale.gen, help="tokens G per turn")
    ap.add_argument("--kv-budget-gib", type=float, default=scale.kv_budget_gib,
                    help="KV bytes for every system")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                    help="vLLM's share of GPU memory")
    ap.add_argument("--two-class", action="store_true",
                    help="VllmBackend: committed, then speculative phase")
    ap.add_argument("--no-cow-blocks", action="store_true",
                    help="VllmBackend: plain LRU prefix cache, no pins")
    ap.add_argument("--decode-steps", type=int, default=32, help="steps of the decode comparison")
    ap.add_argument("--skip-decode", action="store_true", help="skip the decode comparison")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction,
                    default=torch.cuda.is_available(),
                    help="per system of ours, one untimed 2-agent run and the decode graphs "
                         "captured before the timed runs, as the CLI (on by default on CUDA)")
    ap.add_argument("--decode-first", action="store_true",
                    help="run the decode comparison before react-multilora")
    ap.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME",
                    help="start no run after this time (the rest is recorded as skipped)")
    ap.add_argument("--rows-from", type=Path, default=None, metavar="JSON",
                    help="an earlier run's vllm_side_by_side.json (same workload flags, e.g. "
                         "our systems in an earlier GPU call): its rows join this report, "
                         "this run's replacing those of the same system, W, cascade, overlap")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model with small defaults (CPU plumbing check; add it to "
                         "--help to see those defaults)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_cfg = tiny_config() if args.tiny else llama3_8b_config()
    report: dict = {"workload": "react-multilora",
                    "model": "tiny" if args.tiny else "llama3-8b-shape", "device": str(device),
                    "commit": source_commit(), "warmup": args.warmup,
                    "context": args.context, "turns": args.turns, "gen": args.gen,
                    "kv_budget_gib": args.kv_budget_gib, "results": [], "decode": [], "errors": [],
                    "skipped": []}
    earlier = None
    if args.rows_from is not None and args.rows_from.exists():
        earlier = json.loads(args.rows_from.read_text())
        differ = [k for k in ("model", "context", "turns", "gen", "kv_budget_gib")
                  if earlier[k] != report[k]]
        if differ:
            ap.error(f"--rows-from {args.rows_from} ran another workload ({differ} differ)")
    out = args.out / "vllm_side_by_side.json"
    runs = _Runs(args, model_cfg, device, dtype, report, out, harness, earlier)
    decode = args.decode_first and not args.skip_decode
    with tiny_threads(device, args.tiny):  # a no-op on a GPU
        if decode:
            runs.decode()
        # System by system: one backend of ours at a time, built and warmed once, every W.
        for system in args.systems:
            for w in args.workflows:
                runs.run(system, w)
        runs.release()
        if not decode and not args.skip_decode:
            runs.decode()
    merged = runs.merged()
    print(format_table([RunResult(**r) for r in merged["results"]], "react"))
    for d in merged["decode"]:
        print(decode_line(d))
    for e in merged["errors"]:
        print(f"FAILED {e['system']} W={e['workflows']}: {e['error']}")
    if report["skipped"]:
        print(f"skipped {len(report['skipped'])} runs: "
              f"{sorted({s['why'] for s in report['skipped']})}")
    runs.save()
    print(f"wrote {out}")
    if merged["results"] or merged["decode"]:
        plot(merged, args.out / "vllm_side_by_side.png")
    return 1 if report["errors"] else 0


def plot(report: dict, path: Path) -> None:
    """tasks/s against W per system, and decode ms/step: TorchBackend, VllmBackend and vLLM's
    loop, whichever of them ran."""
    from forkserve.bench.output import new_figure, save_figure

    fig, (tput, dec) = new_figure(2, width=12, height=4.4)
    systems = list(dict.fromkeys(r["system"] for r in report["results"]))
    for i, system in enumerate(systems):
        rows = [r for r in report["results"] if r["system"] == system]
        tput.plot([r["workflows"] for r in rows], [r["tasks_per_s"] for r in rows], "o-",
                  color=f"C{i}", label=system)
    tput.set(xscale="log", yscale="log", xlabel="W (agents)", ylabel="tasks/s",
             title=f"react-multilora, {report['kv_budget_gib']} GiB KV, T={report['turns']}")
    if systems:
        tput.legend(fontsize=8)
    labels = [f"b={d['batch']}{' LoRA' if d['lora'] else ''}" for d in report["decode"]]
    xs = range(len(labels))
    columns = [(k, label) for k, label in DECODE_COLUMNS if any(k in d for d in report["decode"])]
    width = 0.8 / max(1, len(columns))
    for i, (key, label) in enumerate(columns):
        dec.bar([x + (i - (len(columns) - 1) / 2) * width for x in xs],
                [d.get(key, float("nan")) for d in report["decode"]], width, label=label)
    dec.set_xticks(list(xs), labels)
    dec.set(ylabel="ms / decode step", title=f"decode, prompt {DECODE_PROMPT}")
    if columns:
        dec.legend(fontsize=8)
    save_figure(fig, path)


class _Runs:
    """One run per (system, W) into the report, saved after each so a timeout loses nothing;
    the vLLM engine and our weights are built once, on first use."""

    def __init__(self, args: argparse.Namespace, model_cfg, device: torch.device,
                 dtype: torch.dtype, report: dict, out: Path,
                 harness: VllmHarness | None, earlier: dict | None = None) -> None:
        self.args, self.model_cfg, self.device, self.dtype = args, model_cfg, device, dtype
        self.report, self.out, self.earlier = report, out, earlier
        self.weights = None
        self.harness = harness
        self.vllm_missing: str | None = None
        self.ours: tuple[str, Any, dict[str, int]] | None = None  # (system, backend, sizes)

    def merged(self) -> dict:
        """This run's report over the ``--rows-from`` one (merge_reports)."""
        return merge_reports(self.report, self.earlier, str(self.args.rows_from))

    def save(self) -> None:
        write_json(self.out, self.merged(), quiet=True)

    def release(self) -> None:
        """Free our backend (the GPU holds one at a time) before another is built."""
        self.ours = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def out_of_time(self) -> bool:
        return self.args.stop_at is not None and time.time() >= self.args.stop_at

    def decode(self) -> None:
        """The decode comparison: our TorchBackend always, the vLLM columns on the vLLM engine
        if one was started (none: they are left out, not an error)."""
        self.release()
        steps = self.args.decode_steps
        backends: dict[bool, tuple] = {}
        try:
            for batch, lora in DECODE_CASES:
                if self.out_of_time():
                    return
                entry: dict = {}
                try:
                    if lora not in backends:
                        backends[lora] = torch_decode_backend(lora, steps, self.model_cfg,
                                                              self._weights(), self.device,
                                                              self.dtype)
                    entry.update(torch_decode(*backends[lora], batch, lora, steps))
                except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                    self._error(f"decode b={batch} lora={lora} TorchBackend", batch, exc)
                if self.harness is not None and not self.out_of_time():
                    try:
                        entry.update(decode_side_by_side(self.harness, batch, lora, steps, PAGE))
                    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                        self._error(f"decode b={batch} lora={lora}", batch, exc)
                if entry:
                    self.report["decode"].append(entry)
                self.save()
        finally:
            backends.clear()
            self.release()

    def _error(self, system: str, w: int, exc: BaseException) -> None:
        self.report["errors"].append({"system": system, "workflows": w,
                                      "error": f"{type(exc).__name__}: {exc}"})

    def run(self, system: str, w: int) -> None:
        args = self.args
        params = MultiLoraParams("react", w, args.context, turns=args.turns, gen=args.gen,
                                 kv_budget_gib=args.kv_budget_gib)
        if self.out_of_time():
            self.report["skipped"].append({"system": system, "workflows": w,
                                           "why": "out of time (--stop-at)"})
            self.save()
            return
        try:
            if system in VLLM_SYSTEMS:
                if self.vllm_missing is not None:
                    self._skip(system, w)
                    return
                self.release()
                harness = self._vllm(params)
                result = (run_native_react(params, harness) if system == "vllm_native" else
                          run_vllm_system(system, params, harness, args.two_class))
            else:
                result = self._ours(system, params)
            # Each row names the source it measured: a merged report holds rows of several.
            self.report["results"].append(asdict(replace(result, commit=self.report["commit"])))
            print(f"{system:<14} W={w:<3} {result.tasks_per_s:.3f} tasks/s", flush=True)
        except ImportError as exc:  # vLLM is not installed: say so once, keep our systems
            self.vllm_missing = f"vLLM is missing: {exc}"
            print(self.vllm_missing, flush=True)
            self._skip(system, w)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            self._error(system, w, exc)
        self.save()

    def _skip(self, system: str, w: int) -> None:
        self.report["skipped"].append({"system": system, "workflows": w, "why": self.vllm_missing})

    def _vllm(self, params: MultiLoraParams) -> VllmHarness:
        if self.harness is None:
            sizes = page_bytes(self.model_cfg, RANK, PAGE, torch.bfloat16)
            pages, _ = budget_pages(sizes, params, KVLayout.UNIFIED)
            self.harness = start_vllm(self.model_cfg, pages, max(self.args.workflows), RANK, PAGE,
                                      self.args.gpu_memory_utilization,
                                      not self.args.no_cow_blocks)
        return self.harness

    def _weights(self):
        if self.weights is None:
            from forkserve.backend.torch.weights import random_weights
            self.weights = random_weights(self.model_cfg, self.device, self.dtype)
        return self.weights

    def _ours(self, system: str, params: MultiLoraParams) -> RunResult:
        """A timed run on the system's one backend: built for the largest W (as the CLI) and
        warmed up when first used, the previous system's released first."""
        if self.ours is None or self.ours[0] != system:
            self.release()
            top = replace(params, workflows=max(self.args.workflows))
            backend, sizes = build_backend(system, top, max(top.workflows, 2), self.model_cfg,
                                           self._weights(), self.device, self.dtype)
            self.ours = (system, backend, sizes)
            del backend
            if self.args.warmup:
                print(f"{system:<14} warm-up: {warm_up(system, top, *self.ours[1:])} decode "
                      "graphs captured", flush=True)
        _, backend, sizes = self.ours
        if self.args.warmup:
            rehearse(system, params, backend, sizes)
        return run_system(system, params, backend, sizes)


if __name__ == "__main__":
    raise SystemExit(main())
