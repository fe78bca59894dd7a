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
* ``alora``          every adapter an activated LoRA, invoked at the start of each agent's
                     instruction: the context is the base model's for every agent, prefilled
                     once and shared exactly (unified layout, its pages keyed BASE).
* ``neutral``        disaggregated with ``share_base = neutral``: a base-model request writes
                     the context's base pages, every agent reads them with its own residual
                     (docs/QUALITY.md, mode a).
* ``recompute<N>``   disaggregated, each reader keeping the N most drifting layers exact
                     (mode b; ``recompute_choice`` picks them from a drift profile). By name
                     only: N must fit the model.

Each system names the quality benchmark's mode it runs as (``System.quality_mode``, through
``forkserve/sharing_mode.py``), so ``benchmarks/sharing_tradeoff.py`` can join the two.

The KV budget is fixed in bytes for every system. One backend serves every W of a system,
with its kernels compiled and its decode graphs captured before the timed runs (as a server
would at start-up).

Modules: ``systems`` (each system's layout and setup), ``recompute_choice`` (the recompute
systems' layers), ``workload`` (parameters, one run),
``driver`` (the agents' closed loop and admission), ``report`` (table and plot), ``cli``
(``forkserve bench react|mapreduce``).
"""
from forkserve.bench.multilora.cli import main
from forkserve.bench.multilora.report import FailedRun, format_table, plot
from forkserve.bench.multilora.systems import SPECS, SYSTEMS, System, spec
from forkserve.bench.multilora.workload import (
    TARGETS,
    MultiLoraParams,
    RunResult,
    budget_pages,
    build_backend,
    page_bytes,
    random_adapter,
    rehearse,
    run_system,
    run_workload,
    tiny_config,
    warm_up,
)

__all__ = ["SPECS", "SYSTEMS", "TARGETS", "FailedRun", "MultiLoraParams", "RunResult", "System",
           "budget_pages", "build_backend", "format_table", "main", "page_bytes", "plot",
           "random_adapter", "rehearse", "run_system", "run_workload", "spec",
           "tiny_config", "warm_up"]
