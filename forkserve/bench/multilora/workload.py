"""The workload's parameters and result, and one timed run of a system (systems.py).

Every system gets the same KV budget in bytes; one backend serves every W of a system."""
from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from forkserve.bench.gc_pauses import GcWatch
from forkserve.bench.gpu_clocks import ClockSampler, card_of
from forkserve.bench.kernel_compiles import KernelCompiles
from forkserve.bench.multilora.driver import Driver, Workflow
from forkserve.bench.multilora.recompute_choice import choose
from forkserve.bench.multilora.step_profile import StepProfiler
from forkserve.bench.multilora.systems import ContextWriter, System, spec
from forkserve.config import ForkServeConfig, KVLayout
from forkserve.engine import Engine
from forkserve.engine.heap import settle

TARGETS = ("q", "k", "v", "o")
# The process's kernel builds, read around each timed run: installed at the first run, not
# at import (importing Triton first would fix its mode before a test sets TRITON_INTERPRET),
# and once (its hooks are process-wide; every run of the process reads the same counts).
_COMPILES = KernelCompiles()
_GC = GcWatch()


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
    # Of the adapters' random A and B. WORKLOADS.md's 0.01 barely moves a tiny model's greedy
    # tokens; a test that must see an adapter's effect (aLoRA's exactness) raises it.
    adapter_std: float = 0.01
    kv_budget_gib: float = 24.0
    residual_share: float = 0.1   # of the budget, for the disaggregated residual pool
    lockstep: bool = True
    page_size: int = 16
    # Memory pressure (D1): a host tier for evicted residual pages, pause pins of the base
    # pages, and stateless turns (each turn closes its session and the next re-opens the
    # whole history, as an OpenAI client does), which is what pins and the host tier serve.
    host_residual_gib: float = 0.0
    pause_pin: bool = False
    reopen: bool = False
    # The drift profile the recompute<N> systems take their layers from ("": the committed
    # SmolLM2 one; recompute_choice.py).
    drift: str = ""

    @property
    def turns_run(self) -> int:
        """Turns each workflow reports (a mapper has one)."""
        return self.turns if self.workload == "react" else 1


@dataclass(frozen=True)
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
    notes: tuple = ()
    decode_ms_per_step: float = 0.0  # mean wall time of a decode-only tick
    cascade: bool = True             # the backend's shared-prefix (cascade) attention
    overlap: bool = False            # the engine planned each decode step behind the last one
    commit: str = ""                 # the source measured (bench/provenance.py)
    # Device idle between consecutive decode steps over their device time (GpuTimeline);
    # None where the backend records no timeline.
    gpu_idle_share: float | None = None
    # D1 under pressure: residual tokens brought back from the host tier vs computed by
    # prefill, and pause pins reused by the next turn vs given up (broken or expired).
    restored_tokens: int = 0
    residual_prefill_tokens: int = 0
    pins_kept: int = 0
    pins_lost: int = 0
    # D1's host copies (one batch per call): over the run, and per decode-only tick, with
    # the host's ms inside the backend's offload/restore calls.
    host_copy_calls: int = 0
    host_copy_bytes: int = 0
    host_copy_ms: float = 0.0
    decode_host_copies_per_step: float = 0.0
    decode_host_copy_bytes_per_step: float = 0.0
    decode_host_copy_ms_per_step: float = 0.0
    # Where the time of a few ticks of each kind went (step_profile.py); None unless asked.
    step_profile: dict | None = None
    # Wall time of the pass that wrote the shared context before any agent opened
    # (base_activations' prefill_shared, neutral's base-model request; 0 where the first
    # agent writes it in its own ticks): in the makespan, in neither tick bucket. Device
    # work it leaves in flight is charged to the first tick.
    context_write_s: float = 0.0
    # SHA-256 of every agent's generated tokens (agent by agent, turn by turn, the reducer's
    # last): two runs of one workload generated the same tokens iff equal. It tells an exact
    # system from an approximate one (alora against the same agents with nothing shared).
    outputs_sha256: str = ""
    # Decode graphs a step of the run captured itself (its key was not captured ahead):
    # each cost that tick two eager forwards and a capture.
    graphs_captured_in_run: int = 0
    # The layers each reader recomputed (recompute<N> systems; the note says what chose them).
    recompute_layers: tuple = ()
    # Ticks that prefilled (``prefill_tick_s``'s ticks) and the prefill tokens each carried:
    # the same prefill tokens over more or emptier ticks cost more device time.
    prefill_ticks: int = 0
    prefill_tokens_per_tick: float = 0.0      # mean over the prefill ticks
    prefill_tokens_per_tick_max: int = 0
    # Kernels first built inside the timed run (bench/kernel_compiles.py): Triton
    # specializations the warm-up missed, the seconds they took (compile or on-disk cache
    # load), the kernels that built most, and graphs dynamo compiled. 0 in a fair row.
    kernels_built_in_run: int = 0
    kernel_build_s_in_run: float = 0.0
    kernels_built: tuple = ()
    dynamo_graphs_in_run: int = 0
    kernels_built_specs: tuple = ()  # the first few builds' specializations
    fa4_compiled_in_run: int = 0  # FlashAttention-4 kernels compiled in the run (~3 s each)
    # The prefill attention routes the run's layer calls took (KernelAttention.prefill_routes).
    prefill_routes: tuple = ()
    # The cycle collector inside the run (gc_pauses.py): full passes, and all passes' seconds.
    gc_full_passes_in_run: int = 0
    gc_pause_s_in_run: float = 0.0
    # --rounds: each round's median tasks/s (None: the round failed), in round order, the
    # systems' order reversed every other round; the row is the median run of them all.
    # Empty: one round.
    round_tasks_per_s: tuple = ()
    # The card through the timed run (gpu_clocks.ClockSummary as a dict): prefill runs at
    # the power cap, where the clock follows the card's heat. None off CUDA.
    gpu_clocks: dict | None = None

    @classmethod
    def from_json(cls, row: dict) -> RunResult:
        """A row as the bench's JSON holds it (``asdict``): its tuple fields came back as
        lists."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in row.items()})


def tiny_config():
    """A 2-layer Llama of hidden size 128: the CPU stand-in for the 8B shape."""
    from forkserve.backend.torch.model_config import ModelConfig
    from forkserve.backend.torch.rope import RopeConfig

    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                       rope=RopeConfig(), max_context=16384, attention_bias=False,
                       tie_word_embeddings=False)


def random_adapter(model_cfg, name: str, rank: int, device: torch.device, seed: int,
                   invocation: tuple[int, ...] | None = None, std: float = 0.01):
    """A LoRA adapter of random A and B (B nonzero; ``std`` 0.01 as docs/WORKLOADS.md says);
    ``invocation``: an activated LoRA's invocation tokens (None: a plain LoRA)."""
    from forkserve.backend.torch.lora import LoraAdapter, target_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for layer in range(model_cfg.num_layers):
        for t in TARGETS:
            fan_in, fan_out = target_shapes(model_cfg)[t]
            a = torch.randn(rank, fan_in, generator=gen, device=device) * std
            b = torch.randn(fan_out, rank, generator=gen, device=device) * std
            weights[(layer, t)] = (a, b)
    return LoraAdapter(name=name, rank=rank, scaling=2.0, weights=weights,
                       invocation_tokens=invocation)


def page_bytes(model_cfg, rank: int, page_size: int, dtype: torch.dtype,
               recompute_layers: int = 0) -> dict[str, int]:
    """Bytes of one base (K/V) page and of one residual (rank-r) page; a residual page also
    holds full K/V in each of ``recompute_layers`` (the backend's own layout, kv_pool.py)."""
    from forkserve.backend.protocol import PageKind
    from forkserve.backend.torch.kv_pool import kv_bytes_per_token

    per_token = kv_bytes_per_token(model_cfg, KVLayout.DISAGGREGATED, rank, dtype,
                                   recompute_layers)
    return {"base": per_token[PageKind.BASE] * page_size,
            "residual": per_token[PageKind.RESIDUAL] * page_size}


def budget_pages(sizes: dict[str, int], params: MultiLoraParams,
                 layout: KVLayout) -> tuple[int, int]:
    """(base pages, residual pages) the byte budget buys in ``layout``."""
    budget = params.kv_budget_gib * 2 ** 30
    if layout.has_residual_pool:
        res_pages = int(budget * params.residual_share // sizes["residual"])
        return int(budget * (1 - params.residual_share) // sizes["base"]), max(res_pages, 1)
    return int(budget // sizes["base"]), 1


def engine_config(system: System, params: MultiLoraParams, sizes: dict[str, int],
                  model_cfg) -> ForkServeConfig:
    """The engine's config for ``system`` under the byte budget: every system the same."""
    layout = system.layout
    num_pages, num_res = budget_pages(sizes, params, layout)
    host_pages = int(params.host_residual_gib * 2 ** 30 // sizes["residual"]) \
        if layout.has_residual_pool else 0
    return system.config(recompute_layers(system, params, model_cfg).layers
                         if system.recompute else (),
                         page_size=params.page_size, num_pages=num_pages,
                         num_residual_pages=num_res, host_residual_pages=host_pages,
                         pause_pin=params.pause_pin, hbm_tokens=num_pages * params.page_size,
                         max_batch_tokens=16384, max_context=model_cfg.max_context,
                         node_ttl_s=None, vocab_size=model_cfg.vocab_size)


def recompute_layers(system: System, params: MultiLoraParams, model_cfg):
    """The layers a recompute system's readers keep exact, chosen from ``params.drift``."""
    return choose(system.recompute, model_cfg.num_layers, params.drift or None)


def build_backend(system: str, params: MultiLoraParams, max_workflows: int, model_cfg, weights,
                  device, dtype):
    """One backend per system, with an adapter for each of up to ``max_workflows`` agents."""
    from forkserve.backend.torch import TorchBackend

    system_spec = spec(system)
    sizes = page_bytes(model_cfg, params.rank, params.page_size, dtype, system_spec.recompute)
    cfg = engine_config(system_spec, params, sizes, model_cfg)
    adapters = {} if not system_spec.lora else {
        f"agent{i}": random_adapter(model_cfg, f"agent{i}", params.rank, device, seed=i,
                                    invocation=system_spec.invocation, std=params.adapter_std)
        for i in range(max_workflows)}
    backend = TorchBackend.from_weights(cfg, model_cfg, weights, adapters, device=device,
                                        dtype=dtype, max_adapters=max(1, len(adapters)),
                                        max_lora_rank=params.rank,
                                        lora_targets=TARGETS if adapters else None)
    return backend, sizes


def run_system(system: str, params: MultiLoraParams, backend, sizes: dict[str, int],
               on_turn: Callable[[], object] | None = None,
               profile_ticks: int = 0, settle_heap: bool = False,
               timed: bool = True) -> RunResult:
    """One run on a fresh Engine over ``backend`` (its pools start empty);
    ``profile_ticks``: ticks of each kind profiled (step_profile.py), 0 for none;
    ``settle_heap``: start on a settled heap (engine/heap.py: earlier runs' garbage collected,
    the rest frozen), as a server runs; one full collection before the timer (~0.5 s in a
    test process, which the CPU plumbing runs skip); ``timed``: False for the warm-up and
    rehearsal runs, whose figures nobody reads, so no ``nvidia-smi`` child samples the card."""
    system_spec = spec(system)
    adapter_of = None if not system_spec.lora else (lambda i: backend.adapter_id(f"agent{i}"))
    timeline = backend.gpu_timeline
    if timeline is not None:
        timeline.reset()
    captured = backend.runner.captured_on_use
    if settle_heap:
        settle()
    built = _COMPILES.install().window()
    paused = _GC.install().window()
    routes = getattr(backend.attention, "prefill_routes", None)
    routes_before = Counter(routes or {})
    notes = (recompute_layers(system_spec, params, backend.model_config).note(),) \
        if system_spec.recompute else ()
    with ClockSampler(card_of(backend.device) if timed else None) as clocks:
        result = run_workload(system, params, Engine(backend), sizes, adapter_of, on_turn,
                              writer=system_spec.writer, notes=notes,
                              profiler=StepProfiler(profile_ticks) if profile_ticks else None,
                              invocation=system_spec.invocation)
    compiles = _COMPILES.since(built)
    pauses = _GC.since(paused)
    result = replace(result, graphs_captured_in_run=backend.runner.captured_on_use - captured,
                     recompute_layers=backend.config.recompute_layers,
                     kernels_built_in_run=compiles.triton,
                     kernel_build_s_in_run=compiles.triton_s, kernels_built=compiles.top,
                     dynamo_graphs_in_run=compiles.dynamo_graphs,
                     kernels_built_specs=compiles.specs, fa4_compiled_in_run=compiles.fa4,
                     prefill_routes=tuple(sorted((Counter(routes or {}) - routes_before).items())),
                     gc_full_passes_in_run=pauses.full, gc_pause_s_in_run=pauses.seconds,
                     gpu_clocks=asdict(clocks.summary) if clocks.summary else None)
    if timeline is None:
        return result
    return replace(result, gpu_idle_share=timeline.summary().idle_share)


def warm_up(system: str, params: MultiLoraParams, backend, sizes: dict[str, int]) -> int:
    """Compile the kernels and capture the decode graphs outside the timed runs, as a server
    would at start-up: one untimed 2-agent run (at most 2 turns of 4 tokens) on ``backend``,
    then the decode graphs of up to ``params.workflows`` sequences as long as a run of
    ``params`` (the largest W the backend will serve) grows, and the cold-prefill attention
    plans of every prompt length up to that (``TorchBackend.warm_cold_prefill``; without
    them the first system of a process would pay ~42 ms per new length inside its timed
    runs). Returns the graphs captured."""
    run_system(system, replace(params, workflows=2, turns=min(2, params.turns), gen=4), backend,
               sizes, timed=False)
    longest = params.context + params.instruction + params.turns * (params.gen + params.observation)
    backend.warm_cold_prefill(longest)
    return backend.capture_decode_graphs(params.workflows, longest)


def rehearse(system: str, params: MultiLoraParams, backend, sizes: dict[str, int]) -> RunResult:
    """One untimed run of ``params``' shape (its W, context and generation length, at most 2
    turns) on ``backend``, before the timed runs at that W. Triton builds a kernel per
    specialization (constexpr modes, integer arguments' divisibility), and a W-agent run's
    prefill and mixed ticks meet ones that ``warm_up``'s 2-agent run and graph captures do
    not: on an empty on-disk Triton cache, 10 of them compiled inside a timed W = 32 run
    (5.3 s of its 16.1 s of prefill; ``kernels_built_in_run``). A rehearsal of 16-token turns
    still left adaptive's W = 32 run 2 decode kernels (1.8 s) that only its longer turns'
    mixed ticks meet, so the turns keep their length. Returns the run, whose own
    ``kernels_built_in_run`` lists what this rehearsal built."""
    return run_system(system, replace(params, turns=min(2, params.turns)), backend, sizes,
                      timed=False)


def agent_prompts(params: MultiLoraParams, vocab: int, invocation: tuple[int, ...] | None = None
                  ) -> tuple[list[int], list[list[int]]]:
    """The shared context and each agent's first prompt (context + its instruction).
    ``invocation``: the first tokens of every instruction (an aLoRA's, so it activates right
    after the shared context); the instruction keeps its length, so prompts compare."""
    context = [(i * 7919) % (vocab - 3) + 3 for i in range(params.context)]
    lead = list(invocation or ())
    return context, [context + lead + [(i * 131 + j * 17) % (vocab - 3) + 3
                                       for j in range(len(lead), params.instruction)]
                     for i in range(params.workflows)]


def run_workload(system: str, params: MultiLoraParams, engine: Engine, sizes: dict[str, int],
                 adapter_of, on_turn: Callable[[], object] | None = None,
                 writer: ContextWriter = ContextWriter.AGENT,
                 notes: tuple = (), profiler: StepProfiler | None = None,
                 invocation: tuple[int, ...] | None = None) -> RunResult:
    """Drive the workload over any engine (our backends, or vLLM's in
    benchmarks/vllm_side_by_side.py) and read the figures back. ``adapter_of(i)`` is agent
    i's adapter id (``None``: every agent is the base model); ``on_turn()`` is called as each
    agent turn ends (a progress bar); ``writer``: what writes the shared context first;
    ``invocation``: as ``agent_prompts``."""
    context, prompts = agent_prompts(params, engine.config.vocab_size, invocation)
    flows = [Workflow(i, None if adapter_of is None else adapter_of(i), prompt, params)
             for i, prompt in enumerate(prompts)]
    driver = Driver(engine, flows, params, sizes, on_turn, context, writer, profiler)
    start = time.perf_counter()
    if params.workload == "react":
        driver.react()
    else:
        driver.mapreduce()
    makespan = time.perf_counter() - start
    m = engine.metrics
    lat = sorted(x for f in flows for x in f.latencies)
    hit_rate = m.base_hit_tokens / max(1, driver.prompt_tokens)
    if profiler is not None:
        notes = (*notes, f"{profiler.profiled} ticks profiled (their wall time is in the totals)")
    steps = max(1, driver.decode_only_ticks)
    return RunResult(system, params.workflows, params.workflows / makespan, makespan,
                     _pct(lat, 50), _pct(lat, 99), driver.peak_bytes,
                     driver.peak_bytes / params.workflows, hit_rate,
                     m.decode_tokens / max(1, driver.decode_ticks), driver.context_kv_per_agent,
                     driver.prefill_tick_s, driver.decode_tick_s, m.prefill_tokens,
                     m.decode_tokens, driver.waited_s, notes=tuple(notes),
                     decode_ms_per_step=driver.decode_tick_s * 1e3 / steps,
                     context_write_s=driver.context_write_s,
                     restored_tokens=m.restored_tokens,
                     residual_prefill_tokens=m.residual_prefill_tokens,
                     pins_kept=m.pins_resumed, pins_lost=m.pins_broken + m.pins_expired,
                     step_profile=None if profiler is None else profiler.summary(),
                     host_copy_calls=m.host_offload_calls + m.host_restore_calls,
                     host_copy_bytes=(m.offloaded_pages + m.restored_pages) * sizes["residual"],
                     host_copy_ms=m.host_copy_ms,
                     decode_host_copies_per_step=driver.decode_copy_calls / steps,
                     decode_host_copy_bytes_per_step=driver.decode_copy_pages
                     * sizes["residual"] / steps,
                     decode_host_copy_ms_per_step=driver.decode_copy_ms / steps,
                     outputs_sha256=_outputs_sha256(flows),
                     prefill_ticks=len(driver.prefill_tick_tokens),
                     prefill_tokens_per_tick=sum(driver.prefill_tick_tokens)
                     / max(1, len(driver.prefill_tick_tokens)),
                     prefill_tokens_per_tick_max=max(driver.prefill_tick_tokens, default=0))


def _outputs_sha256(flows: list[Workflow]) -> str:
    digest = hashlib.sha256()
    for flow in flows:
        for tokens in flow.outputs:
            digest.update(repr(tokens).encode())
    return digest.hexdigest()


def _pct(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]
