"""The ``react-multilora`` and ``mapreduce-multilora`` workloads (seed 001) on TorchBackend.

W agents, each its own LoRA adapter (rank 16 on q, k, v, o), share one static context of C
tokens; each adds a 16-token instruction. ``react``: T turns of generate G greedily (EOS
ignored) -> tool pause -> append a 100-token observation. ``mapreduce``: W mappers read the
context and generate G; then a reducer (agent 0) reads the context plus every mapper's
output and generates G. Systems, one engine each, run side by side:

* ``unified``        per-adapter merged K/V: prefix caching cannot share across adapters.
* ``disaggregated``  ForkKV: one shared base cache, a rank-r residual per agent, each agent
                     computing its residual with its own forward pass (``own_forward``).
* ``disaggregated_base``  the same layout with ``residual_source = base_activations``: one
                     base-model pass over the context writes every agent's residual.
* ``adaptive``       per session, merged K/V (unified's speed) while the base pool has room,
                     ForkKV's split form once it would pass its high-water mark (seed 003, D3).
* ``full_reuse``     merged K/V shared across adapters (the lossy upper bound).
* ``no_lora``        every agent is the base model (the ideal sharing).

Agent 0 prefills the shared context first; the others then find it published. The KV
budget is fixed in bytes for every system. One backend serves every W of a system, with
its kernels compiled and its decode graphs captured before the timed runs (as a server
would at start-up). A workflow is admitted when the pools can hold
its whole footprint (context + instruction + every turn), so memory contention shows as
waiting, the way a serving engine queues requests it cannot fit.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from forkserve.config import ForkServeConfig, KVLayout
from forkserve.bench.provenance import source_commit
from forkserve.control.layout_policy import KVForm
from forkserve.engine import Engine
from forkserve.errors import OutOfPagesError

SYSTEMS = ("unified", "disaggregated", "disaggregated_base", "adaptive", "full_reuse", "no_lora")
LAYOUTS = {"unified": KVLayout.UNIFIED, "disaggregated": KVLayout.DISAGGREGATED,
           "disaggregated_base": KVLayout.DISAGGREGATED, "adaptive": KVLayout.ADAPTIVE,
           "full_reuse": KVLayout.FULL_REUSE, "no_lora": KVLayout.UNIFIED}
TARGETS = ("q", "k", "v", "o")


@dataclass(frozen=True)
class MultiLoraParams:
    workload: str = "react"
    workflows: int = 8
    context: int = 8192
    instruction: int = 16
    turns: int = 3
    gen: int = 64
    observation: int = 100
    pause_s: float = 0.1
    rank: int = 16
    kv_budget_gib: float = 24.0
    residual_share: float = 0.1   # of the budget, for the disaggregated residual pool
    lockstep: bool = True
    page_size: int = 16


@dataclass
class RunResult:
    system: str
    workflows: int
    tasks_per_s: float
    makespan_s: float
    turn_latency_p50_s: float
    turn_latency_p99_s: float
    peak_kv_bytes: int
    per_agent_kv_bytes: float
    prefix_hit_rate: float        # prompt tokens whose base (or unified) KV came from the index
    mean_decode_batch: float
    # The shared context's KV per agent (its pages counted once however many agents hold
    # them), at the most agents holding it at once: seed 001's M_R measured.
    context_kv_per_agent_bytes: float
    prefill_tick_s: float         # wall time of ticks that prefilled (maybe decoding too)
    decode_tick_s: float          # wall time of decode-only ticks
    prefill_tokens: int
    decode_tokens: int
    waited_s: float
    notes: list = field(default_factory=list)
    decode_ms_per_step: float = 0.0  # mean wall time of a decode-only tick
    cascade: bool = True             # the backend's shared-prefix (cascade) attention
    commit: str = ""


def random_adapter(model_cfg, name: str, rank: int, device: torch.device, seed: int):
    """A LoRA adapter of random A and B (std 0.01, B nonzero), as workloads.md specifies."""
    from forkserve.backend.torch.lora import LoraAdapter, target_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for layer in range(model_cfg.num_layers):
        for t in TARGETS:
            fan_in, fan_out = target_shapes(model_cfg)[t]
            a = torch.randn(rank, fan_in, generator=gen, device=device) * 0.01
            b = torch.randn(fan_out, rank, generator=gen, device=device) * 0.01
            weights[(layer, t)] = (a, b)
    return LoraAdapter(name=name, rank=rank, scaling=2.0, weights=weights)


def _budget_pages(backend_cls_pages: dict, params: MultiLoraParams, layout: KVLayout) -> tuple[int, int]:
    budget = params.kv_budget_gib * 2 ** 30
    base_bytes, res_bytes = backend_cls_pages["base"], backend_cls_pages["residual"]
    if layout.has_residual_pool:
        res_pages = int(budget * params.residual_share // res_bytes)
        return int(budget * (1 - params.residual_share) // base_bytes), max(res_pages, 1)
    return int(budget // base_bytes), 1


def page_bytes(model_cfg, rank: int, page_size: int, dtype: torch.dtype) -> dict:
    elem = torch.finfo(dtype).bits // 8
    kv = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * elem * page_size
    res = 2 * model_cfg.num_layers * rank * elem * page_size
    return {"base": kv, "residual": res}


class Workflow:
    """One agent's closed loop over the engine: its turns, pauses and latencies."""

    def __init__(self, index: int, adapter, prompt: list[int], params: MultiLoraParams) -> None:
        self.index, self.adapter, self.prompt, self.params = index, adapter, prompt, params
        self.session: int | None = None
        self.turn = 0
        self.turn_started = 0.0
        self.resume_at: float | None = None
        self.latencies: list[float] = []
        self.outputs: list[list[int]] = []
        self.done = False
        self.needs: dict | None = None   # pages per pool reserved at admission
        self.split = False

    def footprint_tokens(self) -> int:
        p = self.params
        return len(self.prompt) + p.turns * (p.gen + p.observation)


def _observation(turn: int, index: int, length: int, vocab: int) -> list[int]:
    return [(97 + 31 * turn + 7 * index + i) % (vocab - 3) + 3 for i in range(length)]


def build_backend(system: str, params: MultiLoraParams, max_workflows: int, model_cfg, weights, device,
                  dtype):
    """One backend per system, with an adapter for each of up to ``max_workflows`` agents."""
    from forkserve.backend.torch import TorchBackend

    layout = LAYOUTS[system]
    sizes = page_bytes(model_cfg, params.rank, params.page_size, dtype)
    num_pages, num_res = _budget_pages(sizes, params, layout)
    cfg = ForkServeConfig(page_size=params.page_size, num_pages=num_pages, num_residual_pages=num_res,
                          kv_layout=layout, hbm_tokens=num_pages * params.page_size,
                          max_batch_tokens=16384, max_context=model_cfg.max_context, node_ttl_s=None,
                          vocab_size=model_cfg.vocab_size)
    adapters = {} if system == "no_lora" else {
        f"agent{i}": random_adapter(model_cfg, f"agent{i}", params.rank, device, seed=i)
        for i in range(max_workflows)}
    backend = TorchBackend.from_weights(cfg, model_cfg, weights, adapters, device=device, dtype=dtype,
                                        max_adapters=max(1, len(adapters)), max_lora_rank=params.rank,
                                        lora_targets=TARGETS if adapters else None)
    return backend, sizes


def run_system(system: str, params: MultiLoraParams, backend, sizes: dict,
               progress: tqdm | None = None) -> RunResult:
    """One timed run on a fresh Engine over ``backend`` (its pools start empty)."""
    adapter_of = None if system == "no_lora" else (lambda i: backend.adapter_id(f"agent{i}"))
    return run_workload(system, params, Engine(backend), sizes, adapter_of, progress,
                        shared_by_base_pass=system == "disaggregated_base")


def run_workload(system: str, params: MultiLoraParams, engine: Engine, sizes: dict,
                 adapter_of, progress: tqdm | None = None, shared_by_base_pass: bool = False,
                 notes: list | None = None) -> RunResult:
    """Drive the workload over any engine (our backends, or vLLM's in
    benchmarks/vllm_side_by_side.py) and read the figures back. ``adapter_of(i)`` is agent
    i's adapter id (``None``: every agent is the base model)."""
    vocab = engine.config.vocab_size
    context = [(i * 7919) % (vocab - 3) + 3 for i in range(params.context)]
    flows = []
    for i in range(params.workflows):
        instruction = [(i * 131 + j * 17) % (vocab - 3) + 3 for j in range(params.instruction)]
        adapter = None if adapter_of is None else adapter_of(i)
        flows.append(Workflow(i, adapter, context + instruction, params))
    driver = _Driver(engine, flows, params, sizes, progress, context if shared_by_base_pass else None)
    start = time.perf_counter()
    if params.workload == "react":
        driver.react()
    else:
        driver.mapreduce(context)
    makespan = time.perf_counter() - start
    m = engine.metrics
    lat = sorted(x for f in flows for x in f.latencies)
    hit_rate = m.base_hit_tokens / max(1, driver.prompt_tokens)
    return RunResult(system, params.workflows, params.workflows / makespan, makespan,
                     _pct(lat, 50), _pct(lat, 99), driver.peak_bytes,
                     driver.peak_bytes / params.workflows, hit_rate,
                     m.decode_tokens / max(1, driver.decode_ticks), driver.context_kv_per_agent,
                     driver.prefill_tick_s, driver.decode_tick_s, m.prefill_tokens,
                     m.decode_tokens, driver.waited_s, notes=list(notes or []),
                     decode_ms_per_step=driver.decode_tick_s * 1e3 / max(1, driver.decode_only_ticks))


def _pct(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


class _Driver:
    def __init__(self, engine: Engine, flows: list[Workflow], params: MultiLoraParams, sizes: dict,
                 progress: tqdm | None, shared_context: list[int] | None = None) -> None:
        self.engine, self.flows, self.params, self.progress = engine, flows, params, progress
        self.shared_context = shared_context
        self.base_bytes = sizes["base"]
        self.res_bytes = sizes["residual"]
        self.peak_bytes = 0
        self.decode_ticks = 0
        self.waited_s = 0.0
        self.prompt_tokens = 0
        self.reserved: dict = {}
        self.admitted: list[Workflow] = []
        self.context_pages = params.context // params.page_size
        self.context_kv_per_agent = 0.0
        self._context_holders = 0
        self.prefill_tick_s = 0.0
        self.decode_tick_s = 0.0
        self.decode_only_ticks = 0

    def _tick(self) -> bool:
        m = self.engine.metrics
        before, prefill_before = m.decode_tokens, m.prefill_tokens
        t0 = time.perf_counter()
        did = self.engine.tick()
        elapsed = time.perf_counter() - t0
        if m.prefill_tokens > prefill_before:
            self.prefill_tick_s += elapsed
        elif m.decode_tokens > before:
            self.decode_tick_s += elapsed
            self.decode_only_ticks += 1
        if m.decode_tokens > before:
            self.decode_ticks += 1
        used = self.engine.pool.num_used * self.base_bytes
        if self.engine.residual_pool is not None:
            used += self.engine.residual_pool.num_used * self.res_bytes
        self.peak_bytes = max(self.peak_bytes, used)
        return did

    def _needs(self, flow: Workflow) -> dict:
        """Pages per pool this workflow will hold at its peak. Where its form shares the base
        side across agents, the shared context is counted once (by the first agent)."""
        if flow.needs is not None:
            return flow.needs
        p = self.params.page_size
        total = -(-flow.footprint_tokens() // p)
        layout = self.engine.config.kv_layout
        split = flow.adapter is not None and self.engine.residual_pool is not None and (
            self.engine.layout_form(flow.prompt, adapter=flow.adapter) is KVForm.SPLIT)
        shared = layout is KVLayout.FULL_REUSE or split or flow.adapter is None
        base = total - (self.context_pages if shared and self._shares_context(split) else 0)
        needs = {self.engine.pool: base}
        if split:
            needs[self.engine.residual_pool] = total
        return needs

    def _measure_context_kv(self, flows: list[Workflow]) -> None:
        """Bytes of the pages holding the shared context, each page counted once, over the
        agents holding it — kept at the most agents seen at once."""
        tables = [self.engine.node(f.session, self.engine.tip(f.session)).table for f in flows]
        tables = [kv for kv in tables if kv.length >= self.params.context]
        if len(tables) <= self._context_holders:
            return
        n = self.context_pages
        base = {page for kv in tables for page in kv.base.pages[:n]}
        residual = {page for kv in tables if kv.residual is not None for page in kv.residual.pages[:n]}
        self._context_holders = len(tables)
        self.context_kv_per_agent = (len(base) * self.base_bytes + len(residual) * self.res_bytes) / len(tables)

    def _shares_context(self, split: bool) -> bool:
        """Whether a running workflow of the same form holds the context written (so the index
        cannot evict it, and a new agent finds it instead of writing its own copy)."""
        if self.shared_context is not None:
            return True
        return any(f.split == split and f.session is not None
                   and self.engine.node(f.session, self.engine.tip(f.session)).kv_len >= self.params.context
                   for f in self.admitted)

    def _fits(self, flow: Workflow) -> bool:
        """Admit a workflow only if what every admitted workflow may still claim fits."""
        needs = self._needs(flow)
        if all(self.reserved.get(pool, 0) + n <= pool.num_pages for pool, n in needs.items()):
            for pool, n in needs.items():
                self.reserved[pool] = self.reserved.get(pool, 0) + n
            flow.needs, flow.split = needs, self.engine.residual_pool in needs
            self.admitted.append(flow)
            return True
        return False

    def _close(self, flow: Workflow) -> None:
        self.engine.close(flow.session)
        for pool, n in self._needs(flow).items():
            self.reserved[pool] -= n
        self.admitted.remove(flow)

    def _open(self, flow: Workflow) -> None:
        flow.session = self.engine.open(flow.prompt, adapter=flow.adapter).id
        self.prompt_tokens += len(flow.prompt)
        flow.turn_started = time.perf_counter()
        self.engine.start_generate(flow.session, self.params.gen)

    def _open_first(self) -> tuple[list[Workflow], list[Workflow]]:
        """Agent 0 prefills the shared context and the rest find it published; with
        base_activations one base pass publishes it for every agent first.
        Returns (active, waiting)."""
        if self.shared_context is not None:
            self.engine.prefill_shared(self.shared_context, [f.adapter for f in self.flows])
            return [], list(self.flows)
        first = self.flows[0]
        if not self._fits(first):
            raise RuntimeError("one workflow needs more KV than the whole budget")
        self._open(first)
        while self.engine.node(first.session, self.engine.tip(first.session)).kv_len < len(first.prompt) - 1:
            self._tick()
        return [first], self.flows[1:]

    def _admit(self, active: list[Workflow], waiting: list[Workflow]) -> None:
        while waiting and self._fits(waiting[0]):
            flow = waiting.pop(0)
            self._open(flow)
            active.append(flow)
        if waiting and not active:  # nothing holds a reservation, and still it does not fit
            raise RuntimeError("a workflow needs more KV than the whole budget")

    def react(self) -> None:
        active, waiting = self._open_first()
        while active or waiting:
            now = time.perf_counter()
            self._admit(active, waiting)
            for flow in list(active):
                if flow.resume_at is None and self.engine.generation(flow.session) is not None:
                    flow.latencies.append(time.perf_counter() - flow.turn_started)
                    flow.outputs.append(list(self.engine.generation(flow.session).tokens))
                    flow.turn += 1
                    if flow.turn == 1:
                        self._measure_context_kv(active)
                    if self.progress is not None:
                        self.progress.update(1)
                    if flow.turn == self.params.turns:
                        self._close(flow)
                        active.remove(flow)
                        continue
                    flow.resume_at = now + self.params.pause_s
            if self.params.lockstep and all(f.resume_at is not None for f in active) and active:
                resume = max(f.resume_at for f in active)
                for f in active:
                    f.resume_at = resume
            for flow in active:
                if flow.resume_at is not None and now >= flow.resume_at:
                    obs = _observation(flow.turn, flow.index, self.params.observation,
                                       self.engine.config.vocab_size)
                    self.engine.commit(flow.session, self.engine.tip(flow.session), obs, wait=False)
                    self.prompt_tokens += len(obs)
                    self.engine.start_generate(flow.session, self.params.gen)
                    flow.turn_started, flow.resume_at = time.perf_counter(), None
            if not self._tick():
                pending = [f.resume_at for f in active if f.resume_at is not None]
                if pending:
                    sleep = min(pending) - time.perf_counter()
                    if sleep > 0:
                        time.sleep(sleep)
                else:
                    t0 = time.perf_counter()
                    time.sleep(0.001)
                    self.waited_s += time.perf_counter() - t0

    def mapreduce(self, context: list[int]) -> None:
        active, waiting = self._open_first()
        while active or waiting:
            self._admit(active, waiting)
            for flow in list(active):
                if self.engine.generation(flow.session) is not None:
                    self._measure_context_kv(active)
                    flow.latencies.append(time.perf_counter() - flow.turn_started)
                    flow.outputs.append(list(self.engine.generation(flow.session).tokens))
                    self._close(flow)
                    active.remove(flow)
                    if self.progress is not None:
                        self.progress.update(1)
            self._tick()
        reducer = self.flows[0]
        merged = list(reducer.prompt) + [t for f in self.flows for t in f.outputs[-1]]
        start = time.perf_counter()
        session = self.engine.open(merged, adapter=reducer.adapter).id
        self.prompt_tokens += len(merged)
        self.engine.start_generate(session, self.params.gen)
        while self.engine.generation(session) is None:
            self._tick()
        reducer.latencies.append(time.perf_counter() - start)
        self.engine.close(session)


def main(argv: list[str] | None = None) -> list[RunResult]:
    from forkserve.backend.torch.model_config import llama3_8b_config
    from forkserve.backend.torch.weights import random_weights

    ap = argparse.ArgumentParser(prog="forkserve bench react|mapreduce", description=__doc__.split("\n")[0])
    ap.add_argument("workload", choices=["react", "mapreduce"])
    ap.add_argument("--workflows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--kv-budget-gib", type=float, default=None,
                    help="KV bytes for every system (default 24 GiB; 0.02 GiB with --tiny)")
    ap.add_argument("--residual-share", type=float, default=None,
                    help="share of the budget for the residual pool (default 0.1; 0.5 with --tiny, "
                         "whose rank-16 residual is a quarter of its 64-dim K/V)")
    ap.add_argument("--closed-loop", action="store_true", help="default: lockstep turns (as the vLLM anchor)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model for CPU runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                    help="per system, one untimed 2-agent run at the full context and the decode "
                         "graphs captured before the timed runs (default on CUDA)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs per system and W; the one with the median tasks/s is reported")
    ap.add_argument("--cascade", nargs="+", choices=["on", "off"], default=["on"],
                    help="shared-prefix (cascade) attention of the backend; both: each W runs twice")
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_cfg = _tiny_config() if args.tiny else llama3_8b_config()
    budget = args.kv_budget_gib if args.kv_budget_gib is not None else (0.02 if args.tiny else 24.0)
    share = args.residual_share if args.residual_share is not None else (0.5 if args.tiny else 0.1)
    weights = random_weights(model_cfg, device, dtype)
    results, errors = [], []
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.workload}_multilora{'_tiny' if args.tiny else ''}{'_' + args.tag if args.tag else ''}"
    commit = source_commit()

    def save() -> None:  # after every run, so a later failure or timeout loses nothing
        (args.out / f"{stem}.json").write_text(json.dumps({
            "workload": f"{args.workload}-multilora",
            "driver": "closed-loop" if args.closed_loop else "lockstep",
            "model": "tiny" if args.tiny else "llama3-8b-shape", "device": str(device), "commit": commit,
            "context": args.context, "turns": args.turns, "gen": args.gen, "kv_budget_gib": budget,
            "results": [asdict(r) for r in results], "errors": errors}, indent=2))

    total = (sum(w * (args.turns if args.workload == "react" else 1) for w in args.workflows)
             * len(args.systems) * args.repeat * len(args.cascade))
    with tqdm(total=total, desc=f"{args.workload}-multilora", leave=False) as bar:
        for system in args.systems:
            def params(w: int, **over) -> MultiLoraParams:
                fields = dict(workload=args.workload, workflows=w, context=args.context, turns=args.turns,
                              gen=args.gen, kv_budget_gib=budget, residual_share=share,
                              lockstep=not args.closed_loop) | over
                return MultiLoraParams(**fields)

            top = max(args.workflows)
            backend, sizes = build_backend(system, params(top), max(top, 2), model_cfg, weights, device, dtype)
            if args.warmup:  # compile kernels and capture graphs outside the timed runs
                run_system(system, params(2, turns=min(2, args.turns), gen=4), backend, sizes)
                backend.capture_decode_graphs(top, args.context + params(top).instruction
                                              + args.turns * (args.gen + params(top).observation))
            for w, cascade in ((w, c) for w in args.workflows for c in args.cascade):
                backend.cascade_attention = cascade == "on"
                try:
                    runs = sorted((run_system(system, params(w), backend, sizes, bar) for _ in range(args.repeat)),
                                  key=lambda r: r.tasks_per_s)
                    median = runs[len(runs) // 2]
                    if args.repeat > 1:
                        median.notes.append(f"median of {args.repeat} runs: "
                                            f"{', '.join(f'{r.tasks_per_s:.3f}' for r in runs)} tasks/s")
                    median.cascade, median.commit = cascade == "on", commit
                    results.append(median)
                except (RuntimeError, OutOfPagesError, torch.cuda.OutOfMemoryError) as exc:
                    errors.append({"system": system, "workflows": w, "cascade": cascade,
                                   "error": f"{type(exc).__name__}: {exc}"})
                save()
            del backend
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(format_table(results, args.workload))
    for e in errors:
        print(f"FAILED {e['system']} W={e['workflows']}: {e['error']}")
    plot(results, args.out / f"{stem}.png", args.workload)
    return results


def _tiny_config():
    from forkserve.backend.torch.model_config import ModelConfig
    from forkserve.backend.torch.rope import RopeConfig

    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                       rope=RopeConfig(), max_context=16384, attention_bias=False,
                       tie_word_embeddings=False)


def format_table(results: list[RunResult], workload: str) -> str:
    lines = [f"{'system':<18} {'cascade':>7} {'W':>3} {'tasks/s':>8} {'p50 s':>6} {'p99 s':>6} {'peak GiB':>8} "
             f"{'agent MiB':>9} {'ctx MiB/agent':>13} {'hit':>5} {'batch':>5} {'prefill s':>9} {'decode s':>8} "
             f"{'ms/step':>7}", "-" * 128]
    for r in results:
        lines.append(f"{r.system:<18} {'on' if r.cascade else 'off':>7} {r.workflows:>3} {r.tasks_per_s:>8.3f} {r.turn_latency_p50_s:>6.2f} "
                     f"{r.turn_latency_p99_s:>6.2f} {r.peak_kv_bytes / 2**30:>8.2f} "
                     f"{r.per_agent_kv_bytes / 2**20:>9.1f} {r.context_kv_per_agent_bytes / 2**20:>13.1f} "
                     f"{r.prefix_hit_rate:>5.2f} {r.mean_decode_batch:>5.1f} {r.prefill_tick_s:>9.2f} "
                     f"{r.decode_tick_s:>8.2f} {r.decode_ms_per_step:>7.2f}")
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path, workload: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for system in SYSTEMS:
        for cascade in (True, False):
            rows = [r for r in results if r.system == system and r.cascade == cascade]
            if rows:
                label = system + ("" if cascade else " (cascade off)")
                style = "o-" if cascade else "x--"
                ax1.plot([r.workflows for r in rows], [r.tasks_per_s for r in rows], style, label=label)
                ax2.plot([r.workflows for r in rows], [r.per_agent_kv_bytes / 2**20 for r in rows], style,
                         label=label)
    ax1.set(xlabel="workflows W", ylabel="tasks/s", title=f"{workload}-multilora throughput")
    ax2.set(xlabel="workflows W", ylabel="MiB per agent", title="per-agent KV", yscale="log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
