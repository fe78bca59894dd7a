"""The ``fanout`` workload on real engines, beside the cost model's figures (issue 17).

Three rows per workload size, one engine each, the same token ids:

* ``cuda``          the Engine (cascade on) over TorchBackend;
* ``vllm_backend``  the same Engine over VllmBackend (vLLM's prefix cache under the control
                    plane);
* ``vllm``          plain vLLM, prefix caching on: per session, the trunk + each thought as
                    one request, all of a session's requests submitted together (how
                    docs/ANCHORS.md measured it).

The cascade here runs without disaggregation (one GPU, no connector), so the cost model
beside each row is the MockBackend with that same config. Scores come from the same scorers
the MockBackend run uses (loop + legality over the workload's byte-level text), so every
engine sees the same cascade decisions up to the early-abort probe, whose tokens the model
writes. Each row runs once untimed (CUDA graphs, Triton and vLLM warm-up), then timed from
empty caches. This module imports neither torch nor vLLM; callers pass built backends.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.vllm.native import run_batch
from forkserve.backend.vllm.phase_runner import EngineLike, VllmApi
from forkserve.bench.fanout import FanoutParams, build_workload, drive, engine_config, run_system
from forkserve.config import ForkServeConfig
from forkserve.control.scorers import CompositeScorer, LegalityScorer, LoopScorer
from forkserve.engine import Engine

SIZES = {  # docs/WORKLOADS.md `fanout`, and the large size of issue 17
    "small": FanoutParams(sessions=10, trunk=256, residual=32, fanout=4),
    "large": FanoutParams(sessions=10, trunk=4096, residual=256, fanout=8),
}


@dataclass(frozen=True)
class MeasuredRow:
    system: str                 # cuda | vllm_backend | vllm
    size: str
    distinct_trunks: bool
    submitted_tokens: int       # Engine rows: prefill the control plane asked; vllm: prompts
    computed_tokens: int        # prompt tokens the GPU computed
    wall_ms: float
    peak_kv_tokens: int         # summed per-session peak (the seed's definition)
    vllm_peak_blocks: int | None  # vLLM's own most-referenced blocks (pins included)
    pruned: int
    actions: dict               # residuals per cascade stage
    model_prefill_tokens: int   # the cost model's prediction for this system
    model_peak_kv_tokens: int


def real_config(params: FanoutParams, vocab_size: int, max_context: int) -> ForkServeConfig:
    """The cascade config a real engine runs (one GPU: no disaggregated prefill)."""
    return engine_config("cascade", params, disaggregated_prefill=False, vocab_size=vocab_size,
                         max_context=max_context)


def workload_scorer() -> CompositeScorer:
    """The MockBackend's scorers: the workload's ids are byte-level text whatever the model."""
    return CompositeScorer([LoopScorer(), LegalityScorer(ByteTokenizer().decode)])


def engine_row(system: str, size: str, params: FanoutParams, backend: Any, *,
               computed: Callable[[], int] | None = None, gauge: Any = None,
               reset: Callable[[], object] = lambda: None) -> MeasuredRow:
    """The cascade on ``backend`` (built with ``real_config``). ``computed()``: tokens the
    GPU has computed so far (default: what the Engine prefilled); ``reset()`` empties the
    backend's caches after the warm-up and after the timed run."""
    drive(Engine(backend, scorer=workload_scorer()), "cascade", params)
    reset()
    if gauge is not None:
        gauge.reset()
    engine = Engine(backend, scorer=workload_scorer())
    before = computed() if computed is not None else 0
    t0 = time.perf_counter()
    peak = drive(engine, "cascade", params)
    wall_ms = (time.perf_counter() - t0) * 1e3
    m = engine.metrics
    done = computed() - before if computed is not None else m.prefill_tokens
    reset()
    model = run_system("cascade", params, disaggregated_prefill=False)
    return MeasuredRow(system, size, params.distinct_trunks, m.prefill_tokens, done,
                       round(wall_ms, 3), peak, None if gauge is None else gauge.peak_blocks,
                       m.pruned, dict(m.actions), model.prefill_tokens, model.peak_kv_tokens)


@dataclass(frozen=True)
class NativeRun:
    """Plain vLLM over a fan-out: what it was asked, computed, took and held."""
    submitted_tokens: int
    computed_tokens: int
    wall_ms: float
    peak_kv_tokens: int           # summed per-session most referenced blocks (0: no gauge)
    vllm_peak_blocks: int | None  # the most at any one time


def run_native(sessions: Sequence[Sequence[Sequence[int]]], page_size: int, engine: EngineLike,
               api: VllmApi, *, gauge: Any = None,
               reset: Callable[[], object] = lambda: None) -> NativeRun:
    """Each session's prompts (trunk + one child each) submitted together, sessions one after
    another, one token each, after an untimed pass (how docs/ANCHORS.md measured the fan-out)."""
    for prompts in sessions:  # warm-up
        run_batch(engine, api, prompts, 1)
    reset()
    submitted = computed = peak = vllm_peak = 0
    t0 = time.perf_counter()
    for prompts in sessions:
        if gauge is not None:
            gauge.reset()
        batch = run_batch(engine, api, prompts, 1)
        submitted += batch.prompt_tokens
        computed += batch.computed_tokens
        if gauge is not None:
            peak += gauge.peak_blocks * page_size
            vllm_peak = max(vllm_peak, gauge.peak_blocks)
    wall_ms = (time.perf_counter() - t0) * 1e3
    reset()
    return NativeRun(submitted, computed, round(wall_ms, 3), peak,
                     vllm_peak if gauge is not None else None)


def native_row(size: str, params: FanoutParams, engine: EngineLike, api: VllmApi, *,
               gauge: Any = None, reset: Callable[[], object] = lambda: None) -> MeasuredRow:
    """Plain vLLM on the workload's token ids (``run_native``)."""
    trunks, thoughts = build_workload(params)
    run = run_native([[trunk + t for t in thoughts] for trunk in trunks], params.page_size,
                     engine, api, gauge=gauge, reset=reset)
    model = run_system("apc", params)
    return MeasuredRow("vllm", size, params.distinct_trunks, run.submitted_tokens,
                       run.computed_tokens, run.wall_ms, run.peak_kv_tokens,
                       run.vllm_peak_blocks, 0, {}, model.prefill_tokens, model.peak_kv_tokens)


def variants(sizes: dict[str, FanoutParams] = SIZES) -> list[tuple[str, FanoutParams]]:
    """Every size with distinct trunks (the anchors' measurement) and the seed's shared one."""
    return [(name, replace(p, distinct_trunks=d)) for name, p in sizes.items()
            for d in (True, False)]


def format_rows(rows: list[MeasuredRow]) -> str:
    head = (f"{'system':<13} {'size':<6} {'trunks':<8} {'computed':>9} {'model':>7} "
            f"{'wall ms':>9} {'peak KV':>8} {'model':>7} {'vLLM blk':>8} {'pruned':>6}  stages")
    lines = [head, "-" * len(head)]
    for r in rows:
        trunks = "distinct" if r.distinct_trunks else "shared"
        lines.append(f"{r.system:<13} {r.size:<6} {trunks:<8} "
                     f"{r.computed_tokens:>9} {r.model_prefill_tokens:>7} {r.wall_ms:>9.1f} "
                     f"{r.peak_kv_tokens:>8} {r.model_peak_kv_tokens:>7} "
                     f"{'-' if r.vllm_peak_blocks is None else r.vllm_peak_blocks:>8} "
                     f"{r.pruned:>6}  {r.actions}")
    for r in rows:
        base = next((b for b in rows if b.system == "vllm" and b.size == r.size
                     and b.distinct_trunks == r.distinct_trunks), None)
        if base is not None and r is not base and base.computed_tokens and base.wall_ms:
            lines.append(f"{r.system} / vllm ({r.size}, "
                         f"{'distinct' if r.distinct_trunks else 'shared'}): computed "
                         f"{r.computed_tokens / base.computed_tokens:.2f}x, wall "
                         f"{r.wall_ms / base.wall_ms:.2f}x")
    return "\n".join(lines)


PLOT_TITLE = "fanout on the H200: cascade on TorchBackend / VllmBackend vs plain vLLM"


def plot(rows: Sequence[Any], path, title: str = PLOT_TITLE) -> None:
    """Computed tokens, wall ms and peak KV per (size, trunks), engines side by side (rows:
    anything with ``MeasuredRow``'s system, size, distinct_trunks and those three fields)."""
    from forkserve.bench.output import new_figure, save_figure

    groups = sorted({(r.size, r.distinct_trunks) for r in rows})
    systems = sorted({r.system for r in rows})
    fig, axes = new_figure(3, width=14, height=4.0)
    figures = (("prompt tokens computed", lambda r: r.computed_tokens),
               ("wall ms", lambda r: r.wall_ms), ("peak KV tokens", lambda r: r.peak_kv_tokens))
    width = 0.8 / max(1, len(systems))
    for ax, (label, value) in zip(axes, figures, strict=True):
        for k, system in enumerate(systems):
            xs, ys = [], []
            for g, (size, distinct) in enumerate(groups):
                row = next((r for r in rows if r.system == system and r.size == size
                            and r.distinct_trunks == distinct), None)
                if row is not None:
                    xs.append(g + k * width)
                    ys.append(value(row))
            ax.bar(xs, ys, width, label=system, color=f"C{k}")
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                      [f"{s}\n{'distinct' if d else 'shared'}" for s, d in groups])
        ax.set(title=label, yscale="log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)
