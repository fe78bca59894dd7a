"""TorchBackend decode and prefill speed on a Llama-3-8B-shaped model (random bf16 weights).

    python benchmarks/decode_bench.py --out benchmarks/results        # on the H200
    python benchmarks/decode_bench.py --tiny --out /tmp/bench          # plumbing check on CPU
    python benchmarks/decode_bench.py --engine-only --out benchmarks/results  # Engine rows only

Measures, through the Backend protocol (TorchBackend.step: batch building, CUDA-graph
replay, greedy sampling, host sync, i.e. what the Engine pays):

* ceilings: device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate;
* decode ms/step, prompt 512, unified layout: batch 1 and 64, without and with LoRA
  (rank 16 on q,k,v,o; batch 64 spread over 32 adapters), against the roofline
  (weight bytes + KV bytes read per step) / copy bandwidth; batch 1 eager (no graph) too;
  the disaggregated layout at batch 64 with LoRA (ResidualAttention);
* prefill tokens/s of one 8K prompt (without / with LoRA) against the bf16 compute roofline,
  and the prefill routes the engine's attention dispatch took (``--prefill-only``: just these);
* decode ms/step of 32 agents over one 8K context (the same pages, 16 own tokens each; the
  react workload's step), shared-prefix (cascade) attention on and off;
* decode ms/step through the Engine (``engine_decode`` rows; ``--engine-only``: just these):
  batch 1 and 64, and 64 over 32 adapters with LoRA, sessions that generate ``--steps``
  tokens, ``config.overlap`` off and on (the next step planned while one runs): the tick
  loop's wall time per step, host work included;
* Hugging Face `generate` (sdpa, bf16) at batch 1 and 64 on the same shape, per new token.

Each backend is freed before the next is built (two 64 GiB pools do not fit one H200).
Writes decode_bench.json (after every case) and decode_bench.png to --out and prints a
table last.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forkserve.backend.decode_batch import DecodeBatch  # noqa: E402
from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork  # noqa: E402
from forkserve.backend.torch import TorchBackend  # noqa: E402
from forkserve.backend.torch.lora import LoraAdapter, target_shapes  # noqa: E402
from forkserve.backend.torch.model_config import ModelConfig, llama3_8b_config  # noqa: E402
from forkserve.backend.torch.rope import RopeConfig  # noqa: E402
from forkserve.backend.torch.weights import random_weights  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.config import ForkServeConfig, KVForm, KVLayout  # noqa: E402
from forkserve.control.sharing import PrefixSharing  # noqa: E402
from forkserve.engine import Engine  # noqa: E402
from forkserve.kernels.skinny_gemm import SkinnyTuning  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_trace  # noqa: E402

# docs/ANCHORS.md
VLLM = {"b1": 4.90, "b1_lora": 7.04, "b64": 6.70, "b64_lora": 20.93, "prefill_lora_tok_s": 20000}
PAGE = 16
TARGETS = ("q", "k", "v", "o")


def tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                       rope=RopeConfig(),
                       max_context=16384, attention_bias=False, tie_word_embeddings=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (median of 10)."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def matmul_rate(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n bf16 matmul on random data (median of 10)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def random_adapter(cfg: ModelConfig, name: str, rank: int, device: torch.device,
                   seed: int) -> LoraAdapter:
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for t in TARGETS:
            fan_in, fan_out = target_shapes(cfg)[t]
            a = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in ** 0.5
            b = torch.randn(fan_out, rank, generator=gen, device=device) / rank ** 0.5 * 0.1
            weights[(layer, t)] = (a, b)
    return LoraAdapter(name=name, rank=rank, scaling=1.0, weights=weights)


class Bench:
    def __init__(self, backend: TorchBackend, pages_per_seq: int) -> None:
        self.backend, self.pages_per_seq = backend, pages_per_seq
        self.disaggregated = backend.layout is KVLayout.DISAGGREGATED
        self._pages: dict[int, tuple[int, ...]] = {}  # each sequence's page tuple
        self._columns: dict[int, DecodeBatch] = {}  # per batch size: its standing columns

    def pages(self, seq: int, end: int) -> tuple[int, ...]:
        """The pages that cover positions [0, end) of ``seq``, as a control plane holds them
        (``PageTable.frozen``): one tuple per sequence, the same object while its page count
        stands and a new one only when that changes (a page boundary), not one per step."""
        held = self._pages.get(seq, ())
        need = -(-end // PAGE)
        if len(held) != need:
            first = seq * self.pages_per_seq
            held = self._pages[seq] = tuple(range(first, first + need))
        return held

    def item(self, seq: int, tokens: list[int], start: int, adapter: int | None,
             decode: bool = False) -> SeqWork:
        pages = self.pages(seq, start + len(tokens))
        res = pages if self.disaggregated and adapter is not None else None
        return SeqWork(seq, tuple(tokens), start, KVSlots(pages, res), adapter, GREEDY,
                       decode=decode, form=KVForm.SPLIT if res is not None else KVForm.MERGED)

    def decode_batch(self, batch: int, tokens: Sequence[int], pos: int,
                     adapters: list[int | None]) -> DecodeBatch:
        """Sequences ``0..batch`` writing ``tokens`` at ``pos`` as one ``DecodeBatch``: the
        columns that stand (ids, page tuples, forms, adapters, sampling, groups) are built
        once and kept while the rows' page tuples stand, as the steady set keeps them."""
        pages = tuple(self.pages(i, pos + 1) for i in range(batch))
        kept = self._columns.get(batch)
        if kept is None or any(a is not b for a, b in zip(kept.pages, pages, strict=True)):
            split = [self.disaggregated and a is not None for a in adapters]
            kept = self._columns[batch] = DecodeBatch(
                seq_ids=tuple(range(batch)), tokens=(), positions=np.zeros(batch, np.int64),
                pages=pages, residual_pages=tuple(p if s else None
                                                  for p, s in zip(pages, split, strict=True)),
                forms=tuple(KVForm.SPLIT if s else KVForm.MERGED for s in split),
                adapter_ids=tuple(adapters), adapter_starts=np.zeros(batch, np.int64),
                sampling=(GREEDY,) * batch, shared_prefix=(None,) * batch)
        return dataclasses.replace(kept, tokens=tokens,
                                   positions=np.full(batch, pos, dtype=np.int64))

    def decode(self, batch: int, prompt: int, adapters: list[int | None], steps: int,
               warmup: int = 10, host_profile: bool = False, timeline: bool = False,
               trace: Path | None = None, columns: bool = False) -> dict:
        """Backend decode steps of ``batch`` sequences: ms per step (median, min, max), the
        caller's ``SeqWork`` building included, as a control plane would pay it (a fresh item
        per sequence and step over the page tuple it holds, ``pages``).
        ``warmup``: untimed steps first (the graph's capture, then the steps after it: with 3,
        the first rows of a process read 0.1-0.4 ms over the same rows timed later in it,
        ``decode_bench_step_round18b.json``). ``host_profile``: the timed steps under cProfile
        instead, reporting where the host's
        time goes (``host_top``, ms per step by self time; the wait for the device is in it,
        under whichever call blocks). ``timeline``: also the device's busy and idle time per
        timed step (``GpuTimeline``: idle from one step's forward end to the next one's start
        mark, which follows the step's validation and row building), and the host's phases
        (medians, ms): building the items, ``launch`` (validation, rows, the input copy and
        the graph's launch are queued when it returns) and ``result`` (the wait for the
        tokens and the host's half of the step; ``step`` is ``launch(...).result()``).
        ``trace``: the timed steps under ``torch.profiler`` instead, the trace saved there
        (gzipped) and cut into the step's intervals (``step_trace.summarize``).
        ``columns``: each step a ``DecodeBatch`` instead of items, as the Engine's steady-decode
        set hands its rows (``engine/steady.py``): the columns that stand kept from step to
        step, the positions one int64 array advanced, the tokens the last step's (no
        ``SeqWork`` per row; the backend reads the columns, ``decode_rows.of_batch``)."""
        gen = torch.Generator().manual_seed(batch)
        vocab = self.backend.model_config.vocab_size
        prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(batch)]
        ads = [adapters[i % len(adapters)] for i in range(batch)]
        nxt = []
        for lo in range(0, batch, 8):  # prefill 8 sequences per step
            chunk = range(lo, min(batch, lo + 8))
            nxt += self.backend.step([self.item(i, prompts[i], 0, ads[i])
                                      for i in chunk]).next_tokens
        pos = prompt
        times: list[float] = []
        phases: dict[str, list[float]] = {"items_ms": [], "launch_ms": [], "result_ms": []}
        functions = cProfile.Profile()

        def run(first: int, count: int) -> None:
            nonlocal nxt, pos
            tracing = trace is not None and first >= warmup
            for s in range(first, first + count):
                if host_profile and s == warmup:
                    functions.enable()
                if timeline and s == warmup:
                    self.backend.record_gpu_timeline()
                t0 = time.perf_counter()
                with step_trace.mark("items", tracing):
                    if columns:
                        work, rows = [], self.decode_batch(batch, nxt, pos, ads)
                    else:
                        work, rows = [self.item(i, [nxt[i]], pos, ads[i], decode=True)
                                      for i in range(batch)], None
                t1 = time.perf_counter()
                with step_trace.mark("launch", tracing):
                    handle = self.backend.launch(work, rows)
                t2 = time.perf_counter()
                with step_trace.mark("result", tracing):
                    nxt = handle.result().next_tokens
                t3 = time.perf_counter()
                if s >= warmup:
                    times.append((t3 - t0) * 1e3)
                    for name, (a, b) in zip(phases, ((t0, t1), (t1, t2), (t2, t3)), strict=True):
                        phases[name].append((b - a) * 1e3)
                pos += 1

        run(0, warmup)
        if trace is None:
            run(warmup, steps)
        else:
            events = step_trace.record(lambda: run(warmup, steps), self.backend.device)
        functions.disable()
        row = {"batch": batch, "prompt": prompt, "steps": steps,
               "ms_per_step": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
               "last_tokens": list(nxt[:8])}  # the same sequences, whichever variant ran them
        if host_profile:
            row["host_top"] = host_top(functions, steps)
        if timeline:
            spans = self.backend.gpu_timeline.summary()
            self.backend.gpu_timeline = None
            pairs = max(1, spans.decode_steps - 1)
            row |= {"gpu_busy_ms": spans.busy_ms / pairs, "gpu_idle_ms": spans.idle_ms / pairs,
                    "host": {name: statistics.median(v) for name, v in phases.items()}}
        if trace is not None:
            step_trace.save(events, trace)
            row |= {"trace": step_trace.summarize(events), "trace_file": trace.name}
        return row

    def engine_decode(self, batch: int, prompt: int, adapters: list[int | None], steps: int,
                      overlap: bool, warmup: int = 4) -> dict:
        """The same decode through the Engine (steady-decode set, ``config.overlap`` off or on):
        ``batch`` sessions opened on ``prompt`` random tokens generate ``warmup`` tokens
        (prefill, graph capture; untimed), then ``steps`` more each: the wall time of that
        tick loop, host work included, per token of one sequence."""
        backend = self.backend
        # The Engine reads its config from the backend (as the multilora bench's runs do).
        backend.config = backend.config.replace(overlap=overlap)
        engine = Engine(backend)
        gen = torch.Generator().manual_seed(1000 + batch)
        vocab = backend.model_config.vocab_size
        handles = [engine.open(torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                               adapter=adapters[i % len(adapters)]) for i in range(batch)]

        def generate(n: int) -> float:  # n tokens per session: n backend steps
            sync(backend.device)
            t0 = time.perf_counter()
            for h in handles:
                engine.start_generate(h.id, n)
            while engine.tick():
                pass
            engine.sync()
            sync(backend.device)
            elapsed = time.perf_counter() - t0
            for h in handles:
                assert len(engine.generation(h.id).tokens) == n
            return elapsed

        generate(warmup)
        elapsed = generate(steps)
        for h in handles:
            engine.close(h.id)
        return {"batch": batch, "prompt": prompt, "lora": adapters[0] is not None,
                "overlap": overlap, "steps": steps,
                "ms_per_step": elapsed / steps * 1e3}

    def shared_decode(self, agents: int, context: int, steps: int, cascade: bool,
                      warmup: int = 3) -> dict:
        """``agents`` over one page-aligned ``context`` (sequence 0's pages, written once),
        16 own tokens each on their own pages, then decode steps marked by the control
        plane's PrefixSharing, as the Engine marks them."""
        self.backend.cascade_attention = cascade
        gen = torch.Generator().manual_seed(context)
        vocab = self.backend.model_config.vocab_size
        shared = tuple(range(context // PAGE))
        self.backend.step([SeqWork(
            0, tuple(torch.randint(0, vocab, (context,), generator=gen).tolist()), 0,
            KVSlots(shared))])

        def item(i: int, tokens: list[int], start: int, decode: bool = False) -> SeqWork:
            first = (i + 1) * self.pages_per_seq  # region 0 holds the context
            own = tuple(range(first, first + -(-(start + len(tokens)) // PAGE) - len(shared)))
            return SeqWork(i, tuple(tokens), start, KVSlots(shared + own), None, GREEDY,
                           decode=decode)

        nxt = []
        for lo in range(0, agents, 8):
            nxt += self.backend.step([
                item(i, torch.randint(0, vocab, (16,), generator=gen).tolist(), context)
                for i in range(lo, min(agents, lo + 8))]).next_tokens
        sharing = PrefixSharing(PAGE)
        pos, times = context + 16, []
        for s in range(warmup + steps):
            work = sharing.annotate([item(i, [nxt[i]], pos, decode=True) for i in range(agents)])
            t0 = time.perf_counter()
            nxt = self.backend.step(work).next_tokens
            if s >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
            pos += 1
        return {"agents": agents, "context": context, "cascade": cascade, "steps": steps,
                "ms_per_step": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}

    def prefill(self, tokens: int, adapter: int | None, reps: int = 3) -> dict:
        vocab = self.backend.model_config.vocab_size
        prompt = torch.randint(0, vocab, (tokens,),
                               generator=torch.Generator().manual_seed(7)).tolist()
        # Which prefill route the engine's dispatch took (KernelAttention counts its layer calls).
        routes = getattr(self.backend.attention, "prefill_routes", None)
        before = dict(routes or {})
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            self.backend.step([self.item(0, prompt, 0, adapter)])
            times.append(time.perf_counter() - t0)
        best = statistics.median(times[1:])
        taken = {k: n - before.get(k, 0) for k, n in (routes or {}).items() if n > before.get(k, 0)}
        return {"tokens": tokens, "s": best, "tokens_per_s": tokens / best, "prefill_routes": taken}


def profile_decode(bench: Bench, batch: int, adapters: list[int | None], prompt: int) -> dict:
    """Where a decode step's time goes: graph replay alone (GPU time) vs the whole step (host
    included), and the top kernels of one eager step by CUDA time."""
    backend = bench.backend
    step = bench.decode(batch, prompt, adapters, steps=5)
    replay = graph_replay_ms(bench, batch, adapters[0] is not None)
    backend.runner.use_cuda_graphs = False
    items = [bench.item(i, [1], prompt + 10, adapters[i % len(adapters)], decode=True)
             for i in range(batch)]
    backend.step(items)
    launches, kernel_ms, top = top_kernels(lambda: backend.step(items), 20)
    backend.runner.use_cuda_graphs = True
    return {"batch": batch, "step_ms": step["ms_per_step"],
            "graph_replay_ms": replay,
            "eager_kernels": launches, "eager_kernel_ms": kernel_ms, "top_kernels": top}


def ab_decode(variants: dict[str, tuple[Bench, dict]], batch: int, prompt: int, steps: int,
              rounds: int) -> dict[str, dict]:
    """``Bench.decode`` of each variant (a backend and ``decode``'s keywords) in turn,
    ``rounds`` times (A, B, A, B, ...: a drift of the clocks or of the process falls on all
    alike), no LoRA: per variant its median round (by ms per step) with every round's median
    beside it."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (bench, kwargs) in variants.items():
            runs[name].append(bench.decode(batch, prompt, [None], steps, **kwargs))
    out = {}
    for name, rows in runs.items():
        ranked = sorted(rows, key=lambda r: r["ms_per_step"])
        out[name] = {**ranked[len(ranked) // 2],
                     "rounds_ms": [r["ms_per_step"] for r in rows]}
    return out


def graph_replay_ms(bench: Bench, batch: int, lora: bool) -> float:
    """Median device time of the captured decode graph for ``batch`` rows replayed alone:
    the step's GPU part, no host work, no input copy, no sampling (its launch latency
    included: the device idles until the graph's launch reaches it; ``graph_launch``)."""
    return graph_launch(bench, batch, lora)["idle_device_ms"]


def graph_launch(bench: Bench, batch: int, lora: bool, reps: int = 20) -> dict:
    """What launching the decode graph costs, medians in ms over ``reps`` replays:
    ``call_ms`` the host's time inside ``replay()`` (``cudaGraphLaunch``), ``idle_device_ms``
    a replay's device time from an event recorded just before it on an idle device (what a
    synchronous step pays: the graph's kernels wait for its launch), ``queued_device_ms``
    the same with the device kept busy behind a sleep kernel while the host launches (the
    graph's kernels alone); ``exposed_launch_ms`` their difference."""
    graph = next(g for k, g in bench.backend.runner._graphs.items()
                 if k[0] >= batch and k[2] == lora)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, idle, queued = [], [], []
    for queue in (False, True) * reps:
        torch.cuda.synchronize()
        if queue:
            torch.cuda._sleep(2_000_000)  # ~1 ms at the H200's clock: the launch lands behind it
        start.record()
        t0 = time.perf_counter()
        graph.graph.replay()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        (queued if queue else idle).append(start.elapsed_time(end))
        calls.append((t1 - t0) * 1e3)
    row = {"call_ms": statistics.median(calls), "idle_device_ms": statistics.median(idle),
           "queued_device_ms": statistics.median(queued)}
    return row | {"exposed_launch_ms": row["idle_device_ms"] - row["queued_device_ms"]}


def host_top(functions: cProfile.Profile, steps: int, count: int = 25) -> list[dict]:
    """The ``count`` functions with the most self time in ``functions``, in ms per step."""
    stats = pstats.Stats(functions).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:count]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls / steps,
             "self_ms": tottime / steps * 1e3, "cumulative_ms": cumulative / steps * 1e3}
            for (file, line, name), (_, calls, tottime, cumulative, _) in top]


def top_kernels(run, count: int = 24) -> tuple[int, float, list[dict]]:
    """The CUDA kernels of ``run()`` by device time: (launches, total ms, the top ``count``)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages()
              if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.device_time_total)
    top = [{"name": e.key[:80], "count": e.count, "ms": e.device_time_total / 1e3}
           for e in events[:count]]
    return (sum(e.count for e in events), sum(e.device_time_total for e in events) / 1e3, top)


def profile_prefill(bench: Bench, tokens: int, adapter: int | None) -> dict:
    """Where an 8K prefill's time goes: its wall time and the kernels of one step by CUDA time
    (the gap between the two is host work and GPU idle)."""
    wall = bench.prefill(tokens, adapter, reps=2)
    vocab = bench.backend.model_config.vocab_size
    prompt = torch.randint(0, vocab, (tokens,),
                           generator=torch.Generator().manual_seed(7)).tolist()
    launches, kernel_ms, top = top_kernels(
        lambda: bench.backend.step([bench.item(0, prompt, 0, adapter)]))
    return {"tokens": tokens, "lora": adapter is not None, "step_s": wall["s"],
            "kernels": launches, "kernel_ms": kernel_ms, "top_kernels": top}


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """Matmul FLOPs of a causal prefill (embedding lookup excluded; lm_head on the last token
    only)."""
    linear = cfg.num_parameters() - 2 * cfg.vocab_size * cfg.hidden_size  # per-token matmul weights
    # QK^T and PV, causal half
    attn = 2 * 2 * cfg.num_layers * cfg.q_size * tokens * (tokens + 1) / 2
    return 2 * linear * tokens + attn + 2 * cfg.vocab_size * cfg.hidden_size


def hf_generate(cfg: ModelConfig, device: torch.device, batch: int, prompt: int, new: int) -> dict:
    """HF transformers generate (sdpa, bf16, random weights): ms per new token, prefill excluded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         max_position_embeddings=cfg.max_context, rope_theta=cfg.rope.theta)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    run(2)
    short, long = run(1), run(1 + new)
    return {"batch": batch, "prompt": prompt, "new_tokens": new,
            "ms_per_token": (long - short) / new * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: check the plumbing")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-fusions", action="store_true",
                    help="skip torch.compile of the glue kernels")
    ap.add_argument("--profile", action="store_true",
                    help="only: where decode (batch 1, 64, 64 LoRA) and 8K prefill time goes "
                         "(GPU); writes decode_profile.json")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only: the 8K prefill without / with LoRA (unified layout); writes "
                         "decode_bench_prefill.json")
    ap.add_argument("--engine-only", action="store_true",
                    help="only: decode through the Engine, overlap off / on (batch 1 and 64, "
                         "64 with LoRA); writes decode_bench_engine.json")
    ap.add_argument("--step-only", action="store_true",
                    help="only: decode through TorchBackend.step and through the Engine "
                         "(batch 1 and 64, 64 with LoRA; unified layout); writes "
                         "decode_bench_step.json")
    ap.add_argument("--no-skinny", action="store_true",
                    help="the projections through cuBLAS everywhere (the skinny GEMM's "
                         "baseline); the JSON's name gains '_cublas'")
    ap.add_argument("--ab-rounds", type=int, default=3,
                    help="--step-only: the no-LoRA decode rows (batch 1, 64) of items, of "
                         "columns (decode_b*_columns: a DecodeBatch, as the Engine's steady "
                         "set hands them) and, on CUDA, of a backend with cuBLAS everywhere "
                         "(decode_b*_cublas) and of one with the norms outside the skinny GEMMs "
                         "(decode_b*_unfolded), over the same weights, timed in turn this "
                         "many rounds (the rows are each variant's median round); 0: items "
                         "only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_name = ("decode_bench_prefill.json" if args.prefill_only else
                 "decode_profile.json" if args.profile else
                 "decode_bench_engine.json" if args.engine_only else
                 "decode_bench_step.json" if args.step_only else "decode_bench.json")
    if args.no_skinny:
        json_name = json_name.replace(".json", "_cublas.json")
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = tiny_config() if args.tiny else llama3_8b_config()
    dtype = torch.bfloat16
    prompt, big_batch, n_adapters, rank = 512, 64, 32, 16
    # --step-only prefills nothing past the 512-token prompts: small pools, so a second
    # backend (the A/B baseline) fits beside the first.
    prefill_tokens = 1024 if args.tiny else (prompt if args.step_only else 8192)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "model": "tiny" if args.tiny else "llama3-8b-shape",
                 "dtype": "bf16", "commit": source_commit(), "errors": {}}
    res["copy_bandwidth_Bps"] = copy_bandwidth(device, 64 << 20 if args.tiny else 2 << 30)
    res["matmul_flops"] = matmul_rate(device, 1024 if args.tiny else 8192)
    weights = random_weights(cfg, device, dtype)
    res["weight_bytes"] = weights.nbytes()
    adapters = {f"a{i}": random_adapter(cfg, f"a{i}", rank, device, seed=i)
                for i in range(n_adapters)}
    pages_per_seq = -(-max(prompt + 64, prefill_tokens) // PAGE)
    kv_token_bytes = 2 * cfg.num_layers * cfg.kv_size * 2

    def make(layout: KVLayout, fusions: bool, skinny: bool | None = None,
             fold_norms: bool = True) -> TorchBackend:
        fs = ForkServeConfig(page_size=PAGE, num_pages=big_batch * pages_per_seq,
                             num_residual_pages=(big_batch * pages_per_seq
                                                 if layout is KVLayout.DISAGGREGATED else 1),
                             kv_layout=layout, vocab_size=cfg.vocab_size)
        return TorchBackend.from_weights(fs, cfg, weights, adapters, device=device, dtype=dtype,
                                         max_adapters=n_adapters, max_lora_rank=rank,
                                         lora_targets=TARGETS, compile_fusions=fusions,
                                         skinny_linear=fusions and not args.no_skinny
                                         if skinny is None else skinny,
                                         fold_norms=fold_norms)

    def attempt(name: str, fn, *args, **kwargs) -> None:
        try:
            res[name] = fn(*args, **kwargs)
            print(name, res[name], flush=True)
        except Exception:  # one failed measurement must not lose the others
            res["errors"][name] = traceback.format_exc()
            print(name, "FAILED\n", res["errors"][name], flush=True)
        (out / json_name).write_text(json.dumps(res, indent=1))

    def roofline(batch: int, lora: bool) -> float:
        lora_bytes = (n_adapters * cfg.num_layers * rank * 2
                      * sum(sum(target_shapes(cfg)[t]) for t in TARGETS))
        kv = batch * (prompt + 16) * kv_token_bytes
        nbytes = (res["weight_bytes"] - cfg.vocab_size * cfg.hidden_size * 2 + kv
                  + (lora_bytes if lora else 0))
        return nbytes / res["copy_bandwidth_Bps"] * 1e3

    def decode_case(bench: Bench, batch: int, lora: bool) -> dict:
        ids = [bench.backend.adapter_id(f"a{i}") for i in range(n_adapters)] if lora else [None]
        return {**bench.decode(batch, prompt, ids, args.steps),
                "roofline_ms": roofline(batch, lora)}

    def prefill_case(bench: Bench, lora: bool) -> dict:
        flops = prefill_flops(cfg, prefill_tokens)
        adapter = bench.backend.adapter_id("a0") if lora else None
        return {**bench.prefill(prefill_tokens, adapter),
                "roofline_tokens_per_s": prefill_tokens / (flops / res["matmul_flops"])}

    def engine_case(bench: Bench, batch: int, lora: bool, ids: list[int | None],
                    overlap: bool) -> dict:
        return {**bench.engine_decode(batch, prompt, ids, args.steps, overlap),
                "roofline_ms": roofline(batch, lora)}

    def engine_cases(bench: Bench) -> None:
        # decode_b1, decode_b64 (and decode_b64_lora) through the Engine: host work included
        res.setdefault("engine_decode", [])
        for batch, lora in ((1, False), (big_batch, False), (big_batch, True)):
            for overlap in (False, True):
                name = f"engine_decode_b{batch}" + ("_lora" if lora else "") + \
                    ("_overlap" if overlap else "")
                ids = [bench.backend.adapter_id(f"a{i}") for i in range(n_adapters)] if lora \
                    else [None]
                attempt(name, engine_case, bench, batch, lora, ids, overlap)
                if name in res:
                    res["engine_decode"].append(res.pop(name))
                    (out / json_name).write_text(json.dumps(res, indent=1))
        bench.backend.config = bench.backend.config.replace(overlap=False)

    fusions = device.type == "cuda" and not args.no_fusions
    bench = Bench(make(KVLayout.UNIFIED, fusions), pages_per_seq)
    res["attention"] = type(bench.backend.attention).__name__
    t0 = time.perf_counter()
    attempt("first_decode_step", bench.decode, 1, 16, [None], 1, 0)
    # no Inductor here: measure without fusions
    if "first_decode_step" in res["errors"] and fusions:
        res["fusions_error"] = res["errors"].pop("first_decode_step")
        fusions = False
        bench = Bench(make(KVLayout.UNIFIED, fusions), pages_per_seq)
    res["fusions"] = fusions
    res["skinny_linear"] = fusions and not args.no_skinny
    if args.no_skinny:  # issue15_goals leaves baselines out
        res["baseline"] = "cublas"
    if res["skinny_linear"] and device.type == "cuda":  # the tiles this run's device reads
        res["skinny_tuning"] = SkinnyTuning.packaged().to_json().get(res["device"], {})
    res["first_decode_step_s"] = time.perf_counter() - t0  # compile + capture, once per process
    adapter_ids = [bench.backend.adapter_id(f"a{i}") for i in range(n_adapters)]
    if args.prefill_only:
        for lora in (False, True):
            attempt("prefill" + ("_lora" if lora else ""), prefill_case, bench, lora)
        print_table(res)
        return
    if args.engine_only:
        engine_cases(bench)
        print_table(res)
        return
    if args.profile:
        attempt("profile_b1", profile_decode, bench, 1, [None], prompt)
        attempt("profile_b64", profile_decode, bench, big_batch, [None], prompt)
        attempt("profile_b64_lora", profile_decode, bench, big_batch, adapter_ids, prompt)
        for lora in (False, True):
            attempt("profile_prefill" + ("_lora" if lora else ""), profile_prefill, bench,
                    prefill_tokens, adapter_ids[0] if lora else None)
        return
    ab = args.step_only and args.ab_rounds > 0
    variants = {"items": (bench, {}), "columns": (bench, {"columns": True})}
    baseline = unfolded = None
    if ab and res["skinny_linear"] and device.type == "cuda":
        baseline = Bench(make(KVLayout.UNIFIED, fusions, skinny=False), pages_per_seq)
        # The RMSNorms and residual adds outside the skinny GEMMs (TorchBackend(fold_norms=
        # False)): what folding them in, the default, saves.
        unfolded = Bench(make(KVLayout.UNIFIED, fusions, fold_norms=False), pages_per_seq)
        variants |= {"cublas": (baseline, {}), "unfolded": (unfolded, {})}
    for batch in (1, big_batch):
        for lora in (False, True):
            if ab and not lora:
                attempt(f"ab_b{batch}", ab_decode, variants, batch, prompt, args.steps,
                        args.ab_rounds)
                for variant, row in res.get(f"ab_b{batch}", {}).items():
                    res[f"decode_b{batch}" + ("" if variant == "items" else f"_{variant}")] = \
                        {**row, "roofline_ms": roofline(batch, False)}
                continue
            attempt(f"decode_b{batch}" + ("_lora" if lora else ""), decode_case, bench, batch, lora)
    # Freed here, not by a later collection: one that ran inside a graph capture and freed
    # this backend's graphs would abort the process (cuda_graph.collector_paused).
    del baseline, unfolded, variants
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine_cases(bench)  # after the backend rows: their graphs are captured
    if args.step_only:
        for batch in (1, big_batch):
            attempt(f"host_profile_b{batch}", bench.decode, batch, prompt, [None], args.steps,
                    host_profile=True)
            attempt(f"timeline_b{batch}", bench.decode, batch, prompt, [None], args.steps,
                    timeline=True)
            if device.type == "cuda":
                attempt(f"graph_launch_b{batch}", graph_launch, bench, batch, False)
                if f"graph_launch_b{batch}" in res:  # the graph alone, from the same replays
                    res[f"graph_replay_b{batch}"] = res[f"graph_launch_b{batch}"][
                        "idle_device_ms"]
        for batch in (1, big_batch):  # last: traced, the process's graph launches stay slow
            attempt(f"trace_b{batch}", bench.decode, batch, prompt, [None], 8,
                    trace=out / f"step_trace_b{batch}.json.gz")
        if device.type == "cuda":  # what the traces left behind (step_trace.py)
            for batch in (1, big_batch):
                attempt(f"graph_launch_b{batch}_after_trace", graph_launch, bench, batch, False)
        print_table(res)
        return
    runner = bench.backend.runner
    runner.use_cuda_graphs = False
    attempt("decode_b1_eager_no_graph", bench.decode, 1, prompt, [None], 10)
    runner.use_cuda_graphs = device.type == "cuda"
    for lora in (False, True):
        attempt("prefill" + ("_lora" if lora else ""), prefill_case, bench, lora)
    for cascade in (True, False):
        attempt("decode_b32_shared_context" + ("" if cascade else "_no_cascade"),
                bench.shared_decode, 32, prefill_tokens, args.steps, cascade)
    res["graphs_captured"] = [list(k) for k in runner.captured_graphs]
    del bench, runner
    gc.collect()  # the unified pools and graphs go before the disaggregated ones are allocated
    if device.type == "cuda":
        torch.cuda.empty_cache()
    disaggregated = Bench(make(KVLayout.DISAGGREGATED, fusions), pages_per_seq)
    attempt("decode_b64_lora_disaggregated", decode_case, disaggregated, big_batch, True)
    del disaggregated
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_hf:
        for batch in (1, big_batch):
            attempt(f"hf_generate_b{batch}", hf_generate, cfg, device, batch, prompt, 16)
    res["vllm_0.26_anchors"] = VLLM
    (out / "decode_bench.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "decode_bench.png")
    print_table(res)


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from forkserve.bench.output import save_figure
    except ImportError:
        return
    rows = [("b1", "decode_b1"), ("b1 LoRA", "decode_b1_lora"), ("b64", "decode_b64"),
            ("b64 LoRA", "decode_b64_lora")]
    vllm = [VLLM["b1"], VLLM["b1_lora"], VLLM["b64"], VLLM["b64_lora"]]
    ours = [res.get(k, {}).get("ms_per_step", 0) for _, k in rows]
    roof = [res.get(k, {}).get("roofline_ms", 0) for _, k in rows]
    engine = {(r["batch"], r["lora"]): r["ms_per_step"]
              for r in res.get("engine_decode", ()) if r["overlap"]}
    overlapped = [engine.get((b, lora), 0) for b, lora in ((1, False), (1, True), (64, False),
                                                          (64, True))]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.3 for i in x], ours, 0.2, label="ForkServe TorchBackend.step")
    ax.bar([i - 0.1 for i in x], overlapped, 0.2, label="ForkServe Engine, overlap on")
    ax.bar([i + 0.1 for i in x], vllm, 0.2, label="vLLM 0.26 (docs/ANCHORS.md)")
    ax.bar([i + 0.3 for i in x], roof, 0.2, label="roofline (bytes / copy BW)")
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_ylabel("decode ms / step (prompt 512)")
    ax.set_title(f"Llama-3-8B shape, bf16, {res['device']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, quiet=True)


def print_table(res: dict) -> None:
    print(f"\ncopy BW {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
          f"matmul {res['matmul_flops'] / 1e12:.0f} TFLOP/s, "
          f"weights {res['weight_bytes'] / 1e9:.2f} GB, attention {res.get('attention')}")
    print(f"{'case':34s} {'ms/step':>8s} {'roofline':>8s} {'ratio':>6s}")
    for key in ("decode_b1", "decode_b1_lora", "decode_b64", "decode_b64_lora",
                "decode_b64_lora_disaggregated", "decode_b1_eager_no_graph"):
        r = res.get(key)
        if r:
            roof = r.get("roofline_ms")
            ratio = f"{r['ms_per_step'] / roof:6.2f}" if roof else ""
            print(f"{key:34s} {r['ms_per_step']:8.2f} {roof or 0:8.2f} {ratio}")
    for r in res.get("engine_decode", ()):
        key = (f"engine_b{r['batch']}" + (" LoRA" if r["lora"] else "")
               + (" overlap" if r["overlap"] else ""))
        print(f"{key:34s} {r['ms_per_step']:8.2f} {r['roofline_ms']:8.2f} "
              f"{r['ms_per_step'] / r['roofline_ms']:6.2f}")
    for key in ("decode_b32_shared_context", "decode_b32_shared_context_no_cascade"):
        r = res.get(key)
        if r:
            print(f"{key:34s} {r['ms_per_step']:8.2f}")
    for key in ("prefill", "prefill_lora"):
        r = res.get(key)
        if r:
            print(f"{key:34s} {r['tokens_per_s']:8.0f} tok/s "
                  f"(roofline {r['roofline_tokens_per_s']:.0f}) "
                  f"routes {r.get('prefill_routes')}")
    for key in ("hf_generate_b1", "hf_generate_b64"):
        r = res.get(key)
        if r:
            print(f"{key:34s} {r['ms_per_token']:8.2f} ms/token")
    for key in res["errors"]:
        print(f"FAILED: {key}")


if __name__ == "__main__":
    main()
