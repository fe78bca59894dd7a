"""Kernel benchmark: ResidualAttention vs unified paged attention, SDPA and the eager path.

Run on a GPU (bf16, Llama-3-8B attention: 32 heads, 8 KV heads, head_dim 128, rank 16):

    python benchmarks/kernel_bench.py --out benchmarks/results

Measures, for one attention layer:

* copy bandwidth (device-to-device copy of 2 GiB, bytes read + written): the ceiling;
* decode, contexts 1K-32K x batch 1-64, equal tokens per sequence, pages shuffled:
  unified paged decode (ours), ResidualAttention decode (ours), torch SDPA on K/V that
  was gathered beforehand (the gather is not timed), and the eager reconstruct path
  (gather base + residual, K = K_base + RoPE(K_res B_k), V = V_base + V_res B_v, SDPA);
  achieved bytes/s of our kernels (bytes that must be read: K/V pages, residual rows);
* prefill (whole-context causal at batch 1 over 1K-32K, and 8 chunks of 512 tokens over 8K
  cached keys), timed eagerly as the engine runs it: our Triton paged kernel (tuned, plus
  Hopper tiles), the packed routes (K/V gathered, then FlashAttention-2 varlen or SDPA per
  sequence), ResidualAttention fused / merged / packed with the rebuild, the FRESH route of
  a cold prefill (SDPA over the step's own K/V, no gather), the engine's dispatch
  (``KernelAttention.forward``) with and without FRESH, and baselines on K/V gathered
  beforehand (FlashAttention-2 varlen, SDPA default / flash / cuDNN);
* shared-prefix decode at 32 agents vs 32 independent decodes of the same pages: unified,
  and the split form (ResidualAttention, each agent its own adapter) as two-pass and as msc.

Writes ``kernel_bench.json`` and ``kernel_bench.png`` to ``--out`` and prints a table.
``--prefill`` runs only the prefill part (``kernel_bench_prefill.json`` / ``.png``).
``--mixed`` runs only mixed steps (a prefill chunk beside one-token rows, one layer call):
the whole batch on its prefill route, as before ``backend/torch/step_rows.py``, against the
chunk on its route plus the rows through the decode kernel, each half alone, and the split
output checked against the whole one (``kernel_bench_<tag>.json`` / ``.png``, tag "mixed").
``--decode-short`` runs only unified decode of short sequences (512-4K keys, batch 1 / 8 / 64)
in tables as wide as the keys and 8K / 32K wide (a decode graph's), the static split plan of
before against the dynamic one, plus the dynamic plan at forced split counts
(``kernel_bench_decode_short.json`` / ``.png``, written after every row).
``--cascade-prefill`` runs only prefill chunks of a group over one shared prefix (agents
each prefilling an observation over one context): the engine's layer call ungrouped (its
route, and the paged route pinned) against grouped, the prefix read once per group
(``kernel_bench_cascade_prefill.json`` / ``.png``, written after every row).
``--smoke`` runs tiny shapes on CPU under the Triton interpreter to check the plumbing;
``--regs`` needs no GPU: it reports registers and spills of the kernels for sm_90a.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forkserve import kernels  # noqa: E402
from forkserve.bench.provenance import source_commit  # noqa: E402
from forkserve.kernels import reference  # noqa: E402
from forkserve.kernels.decode_attention import paged_decode_triton  # noqa: E402
from forkserve.kernels.prefill_attention import paged_prefill_triton, residual_prefill_triton  # noqa: E402
from forkserve.kernels.residual_decode_triton import residual_decode_triton  # noqa: E402
from forkserve.kernels.rope import apply_rope, default_inv_freq  # noqa: E402
from forkserve.kernels.shared_prefix import (  # noqa: E402
    PREFIX_TUNING,
    cascade_residual_decode_triton,
    shared_prefix_decode_triton,
)


class Setup:
    """Shapes and one shared set of pools, sized for the largest case."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        if smoke:
            self.n_heads, self.n_kv, self.head_dim, self.rank = 4, 2, 32, 16
            self.contexts, self.batches = [64, 128], [1, 2]
            self.prefill_contexts, self.agents, self.suffix = [64], 4, 16
            self.mixed_contexts, self.mixed_chunk, self.mixed_rows = [64], 16, [2, 3]
            self.cascade_prefixes, self.cascade_members, self.cascade_new = [64], [2, 3], [4, 8]
            self.short_keys, self.short_widths, self.short_batches = [16, 40], [0, 256], [1, 3]
            self.split_prefixes, self.split_agents, self.split_suffix = [64], [2, 4], 24
            self.max_tokens = 1024
        else:
            self.n_heads, self.n_kv, self.head_dim, self.rank = 32, 8, 128, 16
            self.contexts = [1024, 2048, 4096, 8192, 16384, 32768]
            self.batches = [1, 8, 32, 64]
            self.prefill_contexts = [1024, 4096, 8192, 32768]
            self.agents, self.suffix = 32, 128
            # A mixed tick (docs/MULTILORA.md "Round 4"): a ~200-token chunk beside decode rows.
            self.mixed_contexts, self.mixed_chunk, self.mixed_rows = [8192, 32768], 202, [8, 28]
            # --cascade-prefill: agents each prefilling a chunk over one shared context.
            self.cascade_prefixes, self.cascade_members = [8192, 32768], [8, 32]
            self.cascade_new = [32, 128, 512]
            # --decode-short: keys per sequence, table widths (0: the keys'), batches.
            self.short_keys, self.short_widths = [512, 1024, 2048, 4096], [0, 8192, 32768]
            self.short_batches = [1, 8, 64]
            # --cascade-split: shared prefixes, agents per prefix, private suffix (react-like).
            self.split_prefixes, self.split_agents, self.split_suffix = [8192, 32768], [8, 32], 600
            self.max_tokens = 64 * 32768 + 32 * 256
        self.page = 16
        self.n_adapters = 4
        gen = torch.Generator(device=self.device).manual_seed(0)
        n_pages = self.max_tokens // self.page + 1
        kv_shape = (n_pages, self.page, self.n_kv, self.head_dim)
        # Random data, never zeros: zeros can run faster than real data.
        self.k = torch.randn(kv_shape, generator=gen, device=self.device, dtype=self.dtype)
        self.v = torch.randn(kv_shape, generator=gen, device=self.device, dtype=self.dtype)
        res_shape = (n_pages, self.page, self.rank)
        self.k_res = torch.randn(res_shape, generator=gen, device=self.device, dtype=self.dtype)
        self.v_res = torch.randn(res_shape, generator=gen, device=self.device, dtype=self.dtype)
        b_shape = (self.n_adapters, self.rank, self.n_kv * self.head_dim)
        self.b_k = (torch.randn(b_shape, generator=gen, device=self.device) * 0.1).to(self.dtype)
        self.b_v = (torch.randn(b_shape, generator=gen, device=self.device) * 0.1).to(self.dtype)
        self.inv_freq = default_inv_freq(self.head_dim, base=500000.0, device=self.device)
        self.perm = torch.randperm(n_pages - 1, generator=gen, device=self.device).to(torch.int32)
        self.gen = gen

    def tables(self, batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shuffled block tables (base and residual) and seq_lens for ``batch`` x ``ctx``."""
        per = -(-ctx // self.page)
        assert batch * per <= self.perm.numel(), "pool too small for this case"
        bt = self.perm[: batch * per].view(batch, per).contiguous()
        rbt = torch.roll(self.perm, 7)[: batch * per].view(batch, per).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=self.device)
        return bt, rbt, lens

    def adapters(self, batch: int) -> torch.Tensor:
        return (torch.arange(batch, device=self.device) % self.n_adapters).to(torch.int32)

    def q(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.n_heads, self.head_dim, generator=self.gen,
                           device=self.device, dtype=self.dtype)


def bench(fn: Callable[[], object], smoke: bool) -> float:
    """Median milliseconds of ``fn`` on the GPU.

    ``fn`` is captured in a CUDA graph (after a warm-up call that compiles it), so Python
    and launch overhead stay out of the numbers; L2 is flushed (a 256 MiB write) before
    each timed replay, so a small cache is not measured from L2. Timed with CUDA events.
    """
    if smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    graph = captured(fn)
    ms = timed_median(graph.replay, most=100)
    del graph
    return ms


def captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` in a CUDA graph, after a warm-up call (compiles) and one on a side stream."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timed_interleaved(runs: dict[str, Callable[[], object]], rounds: int = 30) -> dict[str, float]:
    """Median ms of each of ``runs`` by CUDA-graph replay, the graphs replayed in turn
    (A, B, C, A, B, C, ...) so a drift of the clock or the board's temperature over the
    measurement falls on every column alike: for ratios near 1. L2 flushed before each."""
    graphs = {name: captured(fn) for name, fn in runs.items()}
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    pairs: dict[str, list] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            pairs[name].append((start, end))
    torch.cuda.synchronize()
    out = {}
    for name, events in pairs.items():
        times = sorted(a.elapsed_time(b) for a, b in events)
        out[name] = times[len(times) // 2]
    return out


def timed_median(run: Callable[[], object], most: int) -> float:
    """Median ms of ``run()`` by CUDA events, L2 flushed (a 256 MiB write) before each call;
    ~200 ms worth of calls, 5 to ``most`` of them."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def timed(n: int) -> list[float]:
        pairs = []
        for _ in range(n):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in pairs]

    first = sorted(timed(3))[1]
    times = sorted(timed(int(min(most, max(5, 200.0 / max(first, 1e-3))))))
    return times[len(times) // 2]


def measure(res: dict, what: str, fn: Callable[[], object], smoke: bool,
            timer: Callable[[Callable[[], object], bool], float] | None = None) -> float:
    """``timer(fn)`` (``bench``: CUDA-graph replays; ``bench_eager`` for what the engine runs
    eagerly), or NaN with the error recorded, so one failing case keeps the rest."""
    try:
        return (timer or bench)(fn, smoke)
    except Exception as exc:
        res.setdefault("errors", []).append(f"{what}: {exc!r}"[:600])
        print(f"ERROR {what}: {exc!r}"[:300], flush=True)
        return math.nan


def measure_interleaved(res: dict, what: str, runs: dict[str, Callable[[], object]],
                        smoke: bool, rounds: int = 30) -> dict[str, float]:
    """Each of ``runs`` timed as ``timed_interleaved`` does (graphs replayed in turn, so no
    column pays for the clock or temperature it met by its place in the order), after one
    call each: a run that fails there is NaN with its error recorded, the rest still timed.
    In smoke mode, ``bench`` each (no GPU to replay on)."""
    out, ready = {}, {}
    for name, fn in runs.items():
        if math.isnan(check(res, f"{what} {name}", lambda fn=fn: (fn(), 0.0)[1])):
            out[name] = math.nan
        else:
            ready[name] = fn
    try:
        out.update({name: bench(fn, smoke) for name, fn in ready.items()} if smoke
                   else timed_interleaved(ready, rounds=rounds))
    except Exception as exc:  # a capture failing after its eager call: all NaN, recorded
        res.setdefault("errors", []).append(f"{what} interleaved: {exc!r}"[:600])
        out.update({name: math.nan for name in ready})
    return out


def check(res: dict, what: str, fn: Callable[[], float]) -> float:
    """An accuracy figure, or NaN with the error recorded."""
    try:
        return fn()
    except Exception as exc:
        res.setdefault("errors", []).append(f"{what}: {exc!r}"[:600])
        return math.nan


def copy_bandwidth(s: Setup) -> float:
    """Bytes/s of a device-to-device copy of 4 GiB of float32 (read + write counted)."""
    n = (4 << 30) // 4 if not s.smoke else 1 << 20
    x = torch.randn(n, device=s.device, dtype=torch.float32)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), s.smoke)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def gathered_kv(s: Setup, bt: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous ``[batch, Hkv, ctx, D]`` copies of the paged K/V (for SDPA)."""
    k = reference.gather_pages(s.k, bt, ctx).transpose(1, 2).contiguous()
    v = reference.gather_pages(s.v, bt, ctx).transpose(1, 2).contiguous()
    return k, v


def eager_reconstruct(s: Setup, bt: torch.Tensor, rbt: torch.Tensor, ctx: int,
                      adapters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager disaggregated path: gather, up-project, RoPE, add. ``[batch, Hkv, ctx, D]``."""
    kb = reference.gather_pages(s.k, bt, ctx)
    vb = reference.gather_pages(s.v, bt, ctx)
    kr = reference.gather_pages(s.k_res, rbt, ctx)
    vr = reference.gather_pages(s.v_res, rbt, ctx)
    dk = torch.bmm(kr, s.b_k[adapters.long()]).unflatten(-1, (s.n_kv, s.head_dim))
    dv = torch.bmm(vr, s.b_v[adapters.long()]).unflatten(-1, (s.n_kv, s.head_dim))
    pos = torch.arange(ctx, device=s.device)
    k = kb + apply_rope(dk, pos, s.inv_freq).to(s.dtype)
    v = vb + dv
    return k.transpose(1, 2), v.transpose(1, 2)


def sdpa_decode(s: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """GQA decode through SDPA: the group's query heads become query rows of their KV head."""
    batch = q.shape[0]
    qg = q.view(batch, s.n_kv, s.n_heads // s.n_kv, s.head_dim)
    return F.scaled_dot_product_attention(qg, k, v).reshape(batch, s.n_heads, s.head_dim)


def sdpa_prefill(s: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = s.n_heads // s.n_kv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def tune_decode(s: Setup, res: dict) -> dict[str, dict]:
    """Pick block_n / num_warps / num_stages per decode kernel on two shapes."""
    if s.smoke:
        return {"unified": {"block_n": 16}, "residual": {"block_n": 16, "variant": "two_pass"}}
    shapes = [(8, 8192), (64, 8192)]
    base = [dict(block_n=32, num_warps=4, num_stages=2),
            dict(block_n=32, num_warps=4, num_stages=3),
            dict(block_n=64, num_warps=4, num_stages=2),
            dict(block_n=64, num_warps=4, num_stages=3)]
    best: dict[str, dict] = {}
    for name in ("unified", "residual"):
        scores = []
        variants = base if name == "unified" else (
            [dict(v, variant="two_pass") for v in base]
            + [dict(block_n=32, num_warps=4, num_stages=2, variant="fused", split_score=False)])
        for var in variants:
            total = 0.0
            try:
                for batch, ctx in shapes:
                    bt, rbt, lens = s.tables(batch, ctx)
                    q = s.q(batch)
                    if name == "unified":
                        fn = lambda: paged_decode_triton(q, s.k, s.v, bt, lens, max_seq_len=ctx,  # noqa: E731
                                                         **var)
                    else:
                        ad = s.adapters(batch)
                        fn = lambda: residual_decode_triton(  # noqa: E731
                            q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, ad,
                            s.inv_freq, max_seq_len=ctx, **var)
                    total += bench(fn, s.smoke)
            except Exception as exc:  # a variant that does not compile (registers, smem)
                res.setdefault("tune_errors", []).append(f"{name} {var}: {exc!r}"[:300])
                continue
            scores.append((total, var))
        scores.sort(key=lambda t: t[0])
        best[name] = scores[0][1] if scores else variants[0]
        res.setdefault("tuning", {})["decode_" + name] = [{"ms_sum": t, **v} for t, v in scores]
    return best


def run_decode(s: Setup, cfg: dict[str, dict], res: dict) -> None:
    bytes_per_token = 2 * s.n_kv * s.head_dim * s.k.element_size()
    res_bytes_per_token = 2 * s.rank * s.k_res.element_size()
    for ctx in s.contexts:
        for batch in s.batches:
            bt, rbt, lens = s.tables(batch, ctx)
            q, ad = s.q(batch), s.adapters(batch)
            row: dict = {"ctx": ctx, "batch": batch}
            uni = lambda: paged_decode_triton(q, s.k, s.v, bt, lens, max_seq_len=ctx,  # noqa: E731
                                              **cfg["unified"])
            resid = lambda: residual_decode_triton(  # noqa: E731
                q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, ad, s.inv_freq,
                max_seq_len=ctx, **cfg["residual"])
            tag = f"decode ctx={ctx} batch={batch}"
            row["unified_ms"] = measure(res, tag + " unified", uni, s.smoke)
            row["residual_ms"] = measure(res, tag + " residual", resid, s.smoke)
            kv_bytes = batch * ctx * bytes_per_token
            row["unified_GBps"] = kv_bytes / row["unified_ms"] / 1e6
            row["residual_GBps"] = ((kv_bytes + batch * ctx * res_bytes_per_token)
                                    / row["residual_ms"] / 1e6)
            row["residual_over_unified"] = row["residual_ms"] / row["unified_ms"]
            if batch * ctx <= 512 * 1024 or s.smoke:  # eager copies of the cache: cap memory/time
                k, v = gathered_kv(s, bt, ctx)
                row["sdpa_gathered_ms"] = measure(res, tag + " sdpa",
                                                  lambda: sdpa_decode(s, q, k, v), s.smoke)
                del k, v
                row["eager_reconstruct_ms"] = measure(
                    res, tag + " eager",
                    lambda: sdpa_decode(s, q, *eager_reconstruct(s, bt, rbt, ctx, ad)), s.smoke)
            if ctx == s.contexts[len(s.contexts) // 2] and batch == s.batches[-2]:
                # Diagnostic: every adapter -1 skips the residual loads but keeps the math.
                none = torch.full_like(ad, -1)
                row["residual_no_adapter_ms"] = measure(
                    res, tag + " no-adapter", lambda: residual_decode_triton(
                        q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, none,
                        s.inv_freq, max_seq_len=ctx, **cfg["residual"]), s.smoke)
            if ctx == s.contexts[len(s.contexts) // 2] and batch == s.batches[1]:
                row["residual_rel_err_vs_eager_fp32"] = check(res, tag + " check", lambda: rel_err(
                    resid(),
                    sdpa_decode(s, q.float(),
                                *(t.float() for t in eager_reconstruct(s, bt, rbt, ctx, ad)))))
                row["unified_rel_err_vs_sdpa_fp32"] = check(res, tag + " check", lambda: rel_err(
                    uni(),
                    sdpa_decode(s, q.float(), *(t.float() for t in gathered_kv(s, bt, ctx)))))
            res["decode"].append(row)
            print(f"decode ctx={ctx:6d} b={batch:3d} uni={row['unified_ms']:.4f}ms "
                  f"res={row['residual_ms']:.4f}ms ratio={row['residual_over_unified']:.3f} "
                  f"uniBW={row['unified_GBps']:.0f}GB/s resBW={row['residual_GBps']:.0f}GB/s",
                  flush=True)


# Hopper tiles for our Triton paged prefill (block_m counts tokens: x4 query rows at GQA 4),
# timed as extra columns and offered to the tuner: does our own kernel get close to flash?
PREFILL_TILES: dict[str, dict] = {
    "m32_n64_w8_s3": dict(block_m=32, block_n=64, num_warps=8, num_stages=3),
    "m32_n128_w8_s3": dict(block_m=32, block_n=128, num_warps=8, num_stages=3),
    "m32_n64_w8_s4": dict(block_m=32, block_n=64, num_warps=8, num_stages=4),
    "m16_n128_w4_s3": dict(block_m=16, block_n=128, num_warps=4, num_stages=3),
}


def bench_eager(fn: Callable[[], object], smoke: bool) -> float:
    """Median ms of ``fn`` run eagerly, as the engine runs prefill (no CUDA graph: launch and
    host overhead of a route count), L2 flushed before each call, CUDA events."""
    if smoke:
        return bench(fn, smoke)
    fn()
    return timed_median(fn, most=50)


def measure_eager(res: dict, what: str, fn: Callable[[], object], smoke: bool) -> float:
    return measure(res, what, fn, smoke, bench_eager)


def tune_prefill(s: Setup, res: dict) -> dict[str, dict]:
    """Pick block_m / block_n / num_warps / num_stages per Triton prefill kernel at 4K."""
    if s.smoke:
        return {"unified": dict(block_m=16, block_n=32),
                "residual": dict(block_m=16, block_n=32, split_score=False)}
    base = [dict(block_m=16, block_n=64, num_warps=4, num_stages=2),
            dict(block_m=32, block_n=64, num_warps=8, num_stages=2),
            dict(block_m=32, block_n=32, num_warps=4, num_stages=2)]
    ctx = 4096
    bt, rbt, lens = s.tables(1, ctx)
    q, ad = s.q(ctx), s.adapters(1)
    cu = torch.tensor([0, ctx], dtype=torch.int32, device=s.device)
    best: dict[str, dict] = {}
    for name in ("unified", "residual"):
        scores = []
        variants = ([*base, *PREFILL_TILES.values()] if name == "unified"
                    else [dict(v, split_score=sp) for v in base for sp in (True, False)])
        for var in variants:
            if name == "unified":
                fn = lambda: paged_prefill_triton(q, s.k, s.v, bt, lens, cu, max_q_len=ctx, **var)  # noqa: E731
            else:
                fn = lambda: residual_prefill_triton(  # noqa: E731
                    q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu, s.b_k, s.b_v, ad, s.inv_freq,
                    max_q_len=ctx, max_seq_len=ctx, **var)
            ms = measure_eager(res, f"tune prefill {name} {var}", fn, s.smoke)
            if not math.isnan(ms):
                scores.append((ms, var))
        scores.sort(key=lambda t: t[0])
        best[name] = scores[0][1] if scores else variants[0]
        res.setdefault("tuning", {})["prefill_" + name] = [{"ms": t, **v} for t, v in scores]
    return best


def prefill_cases(s: Setup) -> list[tuple[int, int, int]]:
    """(batch, new tokens, keys) per sequence: whole-context causal prefills at batch 1, then
    chunks over a cached prefix (8 sequences x 512 new tokens over 8K, as react's agents; 8 x
    64, a short tool result each)."""
    if s.smoke:
        return [(1, ctx, ctx) for ctx in s.prefill_contexts] + [(2, 16, 48)]
    return [(1, ctx, ctx) for ctx in s.prefill_contexts] + [(8, 512, 8192 + 512),
                                                            (8, 64, 8192 + 64)]


def sdpa_backend(s: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 backend) -> torch.Tensor:
    """Torch SDPA on contiguous ``[1, Hkv, L, D]`` K/V, GQA native, one backend or (None) torch's
    own pick; a cold prefill (square causal)."""
    from torch.nn.attention import sdpa_kernel
    qh = q.transpose(0, 1)[None]
    if backend is None:
        return F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)


def step_tensors(s: Setup, bt: torch.Tensor, rbt: torch.Tensor, batch: int, new: int,
                 keys: int) -> dict[str, torch.Tensor]:
    """A prefill step's own tensors as the model hands them to attention: q, K (with RoPE)
    and V as views into one ``[T, Hq + 2 Hkv, D]`` projection (CausalLM._project's layout:
    rows strided, not contiguous), K/V and residual rows ``[T, r]`` of each sequence's last
    ``new`` positions read from the pools (so the engine's page writes put back what is
    there), and the step's slot mappings."""
    pos = torch.arange(keys - new, keys, device=s.device)
    pages, offs = pos // s.page, pos % s.page
    slots = (bt[:, pages].long() * s.page + offs).reshape(-1)
    res_slots = (rbt[:, pages].long() * s.page + offs).reshape(-1)
    kv_rows = (-1, s.n_kv, s.head_dim)
    h, g = s.n_heads, s.n_kv
    qkv = torch.empty(batch * new, h + 2 * g, s.head_dim, device=s.device, dtype=s.dtype)
    qkv[:, :h] = s.q(batch * new)
    qkv[:, h:h + g] = s.k.view(kv_rows)[slots]
    qkv[:, h + g:] = s.v.view(kv_rows)[slots]
    return {"q": qkv[:, :h], "k": qkv[:, h:h + g], "v": qkv[:, h + g:],
            "k_res": s.k_res.view(-1, s.rank)[res_slots],
            "v_res": s.v_res.view(-1, s.rank)[res_slots], "slots": slots, "res_slots": res_slots}


def engine_call(s: Setup, own: dict, bt: torch.Tensor, rbt: torch.Tensor,
                lens: torch.Tensor, cu: torch.Tensor, ad: torch.Tensor, counts, residual: bool,
                policy, marks: tuple = ()) -> tuple[Callable[[], torch.Tensor], object]:
    """One layer call of the engine's attention dispatch (``KernelAttention.forward``: the
    page writes, the plan made once per step as the engine's layers share it, then the
    route ``policy`` picks), and that backend (its ``prefill_routes`` say what ran).
    ``marks``: each sequence's ``SharedPrefix`` (cascade prefill groups)."""
    from forkserve.backend.torch.attention import AttentionMetadata
    from forkserve.backend.torch.kernel_attention import KernelAttention
    from forkserve.backend.torch.kv_pool import LayerKV
    from forkserve.backend.torch.rope import Rope, RopeConfig
    attention = KernelAttention(use_triton=True, prefill_policy=policy)
    meta = AttentionMetadata(
        slot_mapping=own["slots"], res_slot_mapping=own["res_slots"] if residual else None,
        block_tables=bt, res_block_tables=rbt if residual else None, seq_lens=lens,
        query_starts=cu, seq_slot=ad.long() if residual else torch.full_like(ad.long(), -1),
        query_lens_host=counts.query_lens, seq_lens_host=counts.seq_lens,
        seq_slot_host=tuple(ad.tolist()) if residual else (-1,) * len(counts.seq_lens),
        decode_only=False, shared_prefix_host=marks)
    kv = LayerKV(s.k, s.v, s.k_res if residual else None, s.v_res if residual else None)
    rope = Rope(RopeConfig(theta=500000.0), s.head_dim, s.device)
    rope.inv_freq = s.inv_freq  # the bench's own (the kernels' tables key on it)
    b_k, b_v = (s.b_k, s.b_v) if residual else (None, None)
    k_res, v_res = (own["k_res"], own["v_res"]) if residual else (None, None)
    return (lambda: attention.forward(own["q"], own["k"], own["v"], k_res, v_res, kv, b_k, b_v,
                                      meta, rope)), attention


def run_prefill(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """Prefill routes side by side, per case (JSON saved after each): our Triton paged kernel
    (tuned, and the Hopper tiles), the packed routes (K/V gathered then FlashAttention-2 varlen,
    or SDPA per sequence), ResidualAttention fused / merged / packed with the rebuild, the
    FRESH route of a cold prefill (SDPA over the step's own K/V, rebuilt from its residual
    rows in the residual form: ``unified_fresh`` / ``residual_fresh``), and the baselines on
    K/V gathered beforehand (gather not timed): the varlen op, torch SDPA with its own backend
    pick and forced to flash / cuDNN, and the old expanded-K/V SDPA.

    The ``engine_*`` columns time the engine's dispatch itself (``KernelAttention.forward``,
    page writes included) with the default policy, and ``engine_*_old`` with FRESH off (the
    dispatch before it); ``policy_unified`` / ``policy_residual`` are the routes that call
    took (``prefill_routes``), joined by "+" where a step took several."""
    from torch.nn.attention import SDPBackend

    from forkserve.backend.torch.fresh_prefill import fresh_prefill
    from forkserve.backend.torch.rope import Rope, RopeConfig
    from forkserve.kernels import (
        CostPrefillPolicy,
        PrefillCounts,
        flash_support,
        paged_prefill,
        prefill_kernels,
        rebuild_kv,
        residual_prefill,
    )
    from forkserve.kernels.flash_op import flash_varlen
    from forkserve.kernels.kv_pack import ResidualPools, pack_kv
    cfg = tune_prefill(s, res)
    res["prefill_config"] = cfg
    res["prefill_tiles"] = PREFILL_TILES
    support = flash_support(s.q(1), s.k)
    res["flash_support"] = {"kernel": support.kernel, "varlen": support.varlen,
                            "paged": support.paged, "reason": support.reason}
    print(f"prefill config {cfg}; flash: {support}", flush=True)
    policy = CostPrefillPolicy()
    save()
    for batch, new, keys in prefill_cases(s):
        bt, rbt, lens = s.tables(batch, keys)
        own = step_tensors(s, bt, rbt, batch, new, keys)
        # The kernel routes' columns take q contiguous, as they did before the engine columns.
        q, ad = own["q"].contiguous(), s.adapters(batch)
        cu = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=s.device)
        cu_k = torch.arange(0, batch * keys + 1, keys, dtype=torch.int32, device=s.device)
        counts = PrefillCounts((new,) * batch, (keys,) * batch)
        residual = ResidualPools(s.k_res, s.v_res, rbt, s.b_k, s.b_v, ad, s.inv_freq)
        res_args = (q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, cu, s.b_k, s.b_v, ad, s.inv_freq)
        tag = f"prefill batch={batch} new={new} keys={keys}"
        row: dict = {"batch": batch, "new": new, "ctx": keys, "cold": new == keys,
                     "batch_policy_unified": policy.route(
                         counts, False, prefill_kernels(q, s.k, flash=support)).value,
                     "batch_policy_residual": policy.route(
                         counts, True, prefill_kernels(q, s.k, s.k_res, support)).value}
        scale = 1.0 / math.sqrt(s.head_dim)
        rope = Rope(RopeConfig(theta=500000.0), s.head_dim, s.device)
        rope.inv_freq = s.inv_freq
        cos_sin = rope.cos_sin(torch.arange(new, device=s.device), s.dtype)
        slots = tuple(ad.tolist())
        engines = {}
        for form, residual_form in (("unified", False), ("residual", True)):
            for suffix, pol in (("", policy), ("_old", CostPrefillPolicy(fresh=False))):
                engines[f"engine_{form}{suffix}"] = engine_call(
                    s, own, bt, rbt, lens, cu, ad, counts, residual_form, pol)
        uni = (q, s.k, s.v, bt, lens, cu)
        kw = dict(use_triton=True, counts=counts)  # use_triton: the kernels under --smoke too
        runs = {
            "unified_paged": lambda: paged_prefill(*uni, variant="paged", **kw, **cfg["unified"]),
            "unified_flash": lambda: paged_prefill(*uni, variant="flash", **kw),
            "unified_sdpa": lambda: paged_prefill(*uni, variant="sdpa", **kw),
            **({"unified_paged_flash": lambda: paged_prefill(*uni, variant="paged_flash", **kw)}
               if support.paged else {}),
            "residual_fused": lambda: residual_prefill(*res_args, variant="fused", **kw,
                                                       **cfg["residual"]),
            "residual_merged": lambda: residual_prefill(*res_args, variant="merged", **kw,
                                                        **cfg["unified"]),
            "residual_flash": lambda: residual_prefill(*res_args, variant="flash", **kw),
            "residual_sdpa": lambda: residual_prefill(*res_args, variant="sdpa", **kw),
            **{name: call for name, (call, _) in engines.items()},
            "pack": lambda: pack_kv(s.k, s.v, bt, lens, cu_k[:-1], batch * keys, keys),
            "pack_rebuild": lambda: pack_kv(s.k, s.v, bt, lens, cu_k[:-1], batch * keys, keys,
                                            residual),
        }
        if new == keys:  # FRESH: a cold prefill's keys are all the step's own
            contig = [t.contiguous() for t in (own["q"], own["k"], own["v"])]
            # FRESH attends as the engine's does: one FA4 varlen call where flash_support
            # found it, else SDPA per sequence (``unified_fresh_sdpa``, its column either way)
            # (the varlen offsets made once, as FreshRows does: no host copy inside a capture)
            fcu = dict(flash=support, cu_seqlens=cu)
            runs["unified_fresh"] = lambda: fresh_prefill(own["q"], own["k"], own["v"],
                                                          counts.query_lens, scale, **fcu)
            runs["unified_fresh_sdpa"] = lambda: fresh_prefill(own["q"], own["k"], own["v"],
                                                               counts.query_lens, scale)
            # the same on contiguous q/k/v: what the projection's layout costs, if anything
            runs["unified_fresh_contiguous"] = lambda: fresh_prefill(
                *contig, counts.query_lens, scale, **fcu)
            runs["residual_fresh"] = lambda: fresh_prefill(
                own["q"], own["k"], own["v"], counts.query_lens, scale, slots, own["k_res"],
                own["v_res"], s.b_k, s.b_v, cos_sin, **fcu)
            # the split form's K/V rebuild alone, first sequence (slot 0): the Triton kernel
            # (one launch) and the eager form it replaced (~6 launches)
            rebuild = (*(own[n][:new] for n in ("k", "v", "k_res", "v_res")), s.b_k[0], s.b_v[0],
                       *cos_sin)
            runs["rebuild_kv"] = lambda: rebuild_kv(*rebuild)
            runs["rebuild_kv_eager"] = lambda: rebuild_kv(*rebuild, use_triton=False)
        runs.update({f"paged_{n}": (lambda t=t: paged_prefill(*uni, variant="paged", **kw, **t))
                     for n, t in PREFILL_TILES.items()})
        for name, fn in runs.items():
            row[name + "_ms"] = measure_eager(res, f"{tag} {name}", fn, s.smoke)
        for name, (_, attention) in engines.items():
            taken = [r for r in attention.prefill_routes if r != "decode_rows"]
            row[name + "_routes"] = "+".join(sorted(taken))
        row["policy_unified"] = row["engine_unified_routes"]
        row["policy_residual"] = row["engine_residual_routes"]
        k, v = pack_kv(s.k, s.v, bt, lens, cu_k[:-1], batch * keys, keys)
        row["varlen_gathered_ms"] = measure_eager(
            res, tag + " varlen gathered",
            lambda: flash_varlen(q, k, v, cu, cu_k, new, keys, scale, support.kernel),
            s.smoke) if support.varlen else math.nan
        if new == keys and batch == 1:  # SDPA baselines: square causal only
            kh, vh = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()
            for name, backend in (("sdpa_default", None),
                                  ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                row[name + "_ms"] = measure_eager(
                    res, f"{tag} {name}", lambda b=backend: sdpa_backend(s, q, kh, vh, b), s.smoke)
            row["sdpa_expanded_ms"] = measure_eager(res, tag + " sdpa expanded",
                                                    lambda: sdpa_prefill(s, q, kh, vh), s.smoke)
            del kh, vh
        del k, v
        flops = 4 * s.n_heads * s.head_dim * counts.causal_pairs  # causal QK^T + PV
        baseline = row.get("sdpa_default_ms", row["varlen_gathered_ms"])
        row["baseline"] = "sdpa_default" if "sdpa_default_ms" in row else "varlen_gathered"
        unified = [n for n in UNIFIED_ROUTE_COLUMNS if n + "_ms" in row]
        for name in (*unified, "engine_unified", "engine_unified_old",
                     *(f"paged_{n}" for n in PREFILL_TILES)):
            row[name + "_over_baseline"] = row[name + "_ms"] / baseline
            row[name + "_TFLOPs"] = flops / row[name + "_ms"] / 1e9
        best_unified = min(row[n + "_ms"] for n in unified)
        for name in (*(n for n in RESIDUAL_ROUTE_COLUMNS if n + "_ms" in row), "engine_residual",
                     "engine_residual_old"):
            row[name + "_over_unified_paged"] = row[name + "_ms"] / row["unified_paged_ms"]
            row[name + "_over_best_unified"] = row[name + "_ms"] / best_unified
        row["engine_residual_over_engine_unified"] = (row["engine_residual_ms"]
                                                      / row["engine_unified_ms"])
        if batch == 1 and keys == s.prefill_contexts[0] or batch > 1:
            ref = lambda: residual_prefill(*(t.float() if t.is_floating_point() else t  # noqa: E731
                                             for t in res_args),
                                           use_triton=False)
            for name in ("residual_flash", "residual_sdpa", "residual_fused", "residual_fresh",
                         "engine_residual"):
                if name in runs:
                    row[name + "_rel_err_vs_eager_fp32"] = check(
                        res, f"{tag} {name} check",
                        lambda n=name: rel_err(runs[n]().view(q.shape), ref()))
            for name in ("unified_flash", "unified_paged_flash", "unified_fresh", "engine_unified"):
                if name in runs:
                    row[name + "_rel_err_vs_paged"] = check(
                        res, f"{tag} {name} check",
                        lambda n=name: rel_err(runs[n]().view(q.shape), runs["unified_paged"]()))
        if new == keys and batch == 1:
            kh, vh = (t.transpose(0, 1)[None].contiguous() for t in (own["k"], own["v"]))
            device_times(res, tag, row, {**runs, "sdpa_default": lambda: sdpa_backend(
                s, q, kh, vh, None)}, s.smoke)
            del kh, vh
        res["prefill"].append(row)
        save()
        print(f"prefill b={batch} new={new:6d} keys={keys:6d} | "
              f"paged={row['unified_paged_ms']:.3f} "
              f"flash={row['unified_flash_ms']:.3f} sdpa-route={row['unified_sdpa_ms']:.3f} "
              f"baseline({row['baseline']})={baseline:.3f} | "
              f"res fused={row['residual_fused_ms']:.3f} "
              f"merged={row['residual_merged_ms']:.3f} flash={row['residual_flash_ms']:.3f} "
              f"sdpa={row['residual_sdpa_ms']:.3f} "
              f"fresh={row.get('residual_fresh_ms', math.nan):.3f} | "
              f"pack={row['pack_ms']:.3f} rebuild={row['pack_rebuild_ms']:.3f} | engine "
              f"unified {row['engine_unified_old_ms']:.3f} -> {row['engine_unified_ms']:.3f} "
              f"({row['policy_unified']}), residual {row['engine_residual_old_ms']:.3f} -> "
              f"{row['engine_residual_ms']:.3f} ({row['policy_residual']})", flush=True)


# Cold batch-1 rows also time these by CUDA-graph replay (``*_device_ms``, interleaved):
# the device's work alone, as the decode goals are timed. The eager columns add each call's
# host launch cost, which at 1K (~0.03 ms of attention) is most of a short route's time,
# while in the engine's forward it overlaps the device's work on the layers before it.
DEVICE_COLUMNS = ("sdpa_default", "unified_paged", "unified_paged_flash", "unified_fresh",
                  "unified_fresh_sdpa", "residual_fresh")


def device_times(res: dict, tag: str, row: dict, runs: dict[str, Callable[[], object]],
                 smoke: bool) -> None:
    """``row``'s ``DEVICE_COLUMNS`` by graph replay, interleaved (``timed_interleaved``), and
    their ratios: unified FRESH over SDPA (``unified_fresh_device_over_baseline``), the
    residual FRESH route over the better unified route
    (``residual_fresh_device_over_best_unified``)."""
    chosen = {name: runs[name] for name in DEVICE_COLUMNS if name in runs}
    try:
        times = ({name: bench(fn, smoke) for name, fn in chosen.items()} if smoke
                 else timed_interleaved(chosen, rounds=30 if row["ctx"] <= 8192 else 12))
    except Exception as exc:  # one failing capture keeps the rest of the bench
        res.setdefault("errors", []).append(f"{tag} device times: {exc!r}"[:600])
        return
    for name, ms in times.items():
        row[name + "_device_ms"] = ms
    base = row.get("sdpa_default_device_ms", math.nan)
    row["unified_fresh_device_over_baseline"] = row.get("unified_fresh_device_ms", math.nan) / base
    best = min(row.get(name + "_device_ms", math.inf)
               for name in ("unified_fresh", "unified_paged", "unified_paged_flash"))
    row["residual_fresh_device_over_best_unified"] = (row.get("residual_fresh_device_ms", math.nan)
                                                      / best)


UNIFIED_ROUTE_COLUMNS = ("unified_paged", "unified_paged_flash", "unified_flash", "unified_sdpa",
                         "unified_fresh")
RESIDUAL_ROUTE_COLUMNS = ("residual_fused", "residual_merged", "residual_flash", "residual_sdpa",
                          "residual_fresh")
PREFILL_ROUTES = (*UNIFIED_ROUTE_COLUMNS, *RESIDUAL_ROUTE_COLUMNS, "engine_unified",
                  "engine_residual")


def plot_prefill_ms(res: dict, ax) -> None:
    """Batch-1 prefill ms per route and baseline."""
    pre = [r for r in res["prefill"] if r["batch"] == 1]
    ctx = [r["ctx"] for r in pre]
    for key in (*PREFILL_ROUTES, "sdpa_default", "varlen_gathered"):
        ax.plot(ctx, [r.get(key + "_ms", math.nan) for r in pre], marker="o", label=key)
    ax.set(xscale="log", yscale="log", xlabel="context", ylabel="ms (eager)",
           title="prefill, batch 1, causal")
    ax.legend(fontsize=6)


def plot_prefill_ratios(res: dict, ax_ratio) -> None:
    """Each route over the case's baseline, every case."""
    labels = [f"{r['batch']}x{r['new']}/{r['ctx']}" for r in res["prefill"]]
    x = range(len(labels))
    for i, key in enumerate(PREFILL_ROUTES):
        base = [r.get(key + "_ms", math.nan) / r.get(r["baseline"] + "_ms", math.nan)
                for r in res["prefill"]]
        width = 0.8 / len(PREFILL_ROUTES)
        ax_ratio.bar([j + (i - len(PREFILL_ROUTES) / 2) * width for j in x], base, width,
                     label=key)
    ax_ratio.axhline(1.0, color="red", linestyle=":", label="baseline")
    ax_ratio.set_xticks(list(x), labels, fontsize=7)
    ax_ratio.set(ylabel="time / baseline (SDPA default; chunks: varlen on gathered K/V)",
                 title="prefill routes over the baseline")
    ax_ratio.legend(fontsize=6)


def print_prefill(res: dict) -> None:
    print(f"prefill (eager, ms; flash: {res.get('flash_support')}; "
          f"cfg {res.get('prefill_config')})")
    print("batch new keys | paged pg-fl4 flash sdpa-rt fresh | base (which) | "
          "res fused merged flash sdpa fresh | engine uni old->new res old->new | "
          "eng-uni/base eng-res/eng-uni | policy")
    for r in res["prefill"]:
        base = r.get(r["baseline"] + "_ms", math.nan)
        print(f"{r['batch']:3d} {r['new']:6d} {r['ctx']:6d} | {r['unified_paged_ms']:7.3f} "
              f"{r.get('unified_paged_flash_ms', math.nan):7.3f} {r['unified_flash_ms']:7.3f} "
              f"{r['unified_sdpa_ms']:7.3f} "
              f"{r.get('unified_fresh_ms', math.nan):7.3f} | {base:7.3f} "
              f"({r['baseline']}) | {r['residual_fused_ms']:7.3f} {r['residual_merged_ms']:7.3f} "
              f"{r['residual_flash_ms']:7.3f} {r['residual_sdpa_ms']:7.3f} "
              f"{r.get('residual_fresh_ms', math.nan):7.3f} | "
              f"{r.get('engine_unified_old_ms', math.nan):7.3f} "
              f"{r.get('engine_unified_ms', math.nan):7.3f} "
              f"{r.get('engine_residual_old_ms', math.nan):7.3f} "
              f"{r.get('engine_residual_ms', math.nan):7.3f} | "
              f"{r.get('engine_unified_ms', math.nan) / base:5.2f} "
              f"{r.get('engine_residual_over_engine_unified', math.nan):5.2f} | "
              f"{r['policy_unified']}/{r['policy_residual']}")


def mixed_cases(s: Setup) -> list[tuple[int, int, int]]:
    """(context, new tokens of the chunk, one-token rows) of the mixed steps: every sequence
    holds ``context`` keys (the chunk's new tokens among them)."""
    return [(ctx, s.mixed_chunk, rows) for ctx in s.mixed_contexts for rows in s.mixed_rows]


def mixed_step(s: Setup, ctx: int, new: int, rows: int, residual: bool,
               found: kernels.PrefillKernels) -> tuple[dict[str, Callable[[], torch.Tensor]], dict]:
    """One attention layer call of a mixed step (one chunk of ``new`` tokens beside ``rows``
    one-token sequences, each over ``ctx`` keys), as ``KernelAttention.forward`` runs it:
    "whole", the batch on the prefill route the policy picks for all of it (before
    step_rows.py); "split", the chunk on its own route and the rows through the decode kernel
    into one output (now); "rows" and "chunk", each half alone; "reference", the whole batch
    through the kernels package's eager float32 reference (not timed). Kernel defaults, as the
    engine calls them. Returns the calls and the routes taken."""
    from forkserve import kernels
    policy = kernels.CostPrefillPolicy()
    bt, rbt, lens = s.tables(1 + rows, ctx)
    q, ad = s.q(new + rows), s.adapters(1 + rows)
    qlens = (new,) + (1,) * rows
    cu = torch.tensor((0, *(new + i for i in range(rows + 1))), dtype=torch.int32,
                      device=s.device)
    whole_counts = kernels.PrefillCounts(qlens, (ctx,) * (1 + rows))
    chunk_counts = kernels.PrefillCounts((new,), (ctx,))
    route = {"whole": policy.route(whole_counts, residual, found),
             "chunk": policy.route(chunk_counts, residual, found)}
    pools = (s.k, s.v, s.k_res, s.v_res) if residual else (s.k, s.v)
    prefill_fn = kernels.residual_prefill if residual else kernels.paged_prefill
    decode_fn = kernels.residual_decode if residual else kernels.paged_decode

    def tables(lo: int, hi: int) -> tuple:  # sequences lo .. hi-1, as step_rows' views
        return (bt[lo:hi], rbt[lo:hi]) if residual else (bt[lo:hi],)

    def rest(lo: int, hi: int) -> tuple:  # after the query starts: B stacks, slots, inv_freq
        return (s.b_k, s.b_v, ad[lo:hi], s.inv_freq) if residual else ()

    def prefill(qq: torch.Tensor, hi: int, starts: torch.Tensor, counts,
                which: str) -> torch.Tensor:
        return prefill_fn(qq, *pools, *tables(0, hi), lens[:hi], starts, *rest(0, hi),
                          use_triton=True, variant=route[which], counts=counts)

    def reference() -> torch.Tensor:
        args = (q, *pools, *tables(0, 1 + rows), lens, cu, *rest(0, 1 + rows))
        return prefill_fn(*(t.float() if t.is_floating_point() else t for t in args),
                          use_triton=False)

    def decode(qq: torch.Tensor) -> torch.Tensor:
        # The engine's host-free bound: the padded table width.
        return decode_fn(qq, *pools, *tables(1, 1 + rows), lens[1:], *rest(1, 1 + rows),
                         use_triton=True, max_seq_len=bt.shape[1] * s.page)

    def split() -> torch.Tensor:
        out = q.new_empty(q.shape)
        out[:new] = prefill(q[:new], 1, cu[:2], chunk_counts, "chunk")
        out[new:] = decode(q[new:])
        return out

    calls = {"whole": lambda: prefill(q, 1 + rows, cu, whole_counts, "whole"),
             "split": split,
             "rows": lambda: decode(q[new:]),
             "chunk": lambda: prefill(q[:new], 1, cu[:2], chunk_counts, "chunk"),
             "reference": reference}
    return calls, {k: v.value for k, v in route.items()}


MIXED_FORMS = ("unified", "residual")


def run_mixed(s: Setup, res: dict, save: Callable[[], None], forms=MIXED_FORMS) -> None:
    """Mixed steps per form and case (JSON saved after each): whole, split, rows and chunk
    timed eagerly (a prefill step runs eagerly), and split's output against whole's."""
    from forkserve.kernels import prefill_kernels
    res["flash_varlen"] = prefill_kernels(s.q(1), s.k).varlen
    for form in forms:
        found = prefill_kernels(s.q(1), s.k, s.k_res if form == "residual" else None)
        for ctx, new, rows in mixed_cases(s):
            calls, routes = mixed_step(s, ctx, new, rows, form == "residual", found)
            reference = calls.pop("reference")
            tag = f"mixed {form} ctx={ctx} chunk={new} rows={rows}"
            row: dict = {"form": form, "ctx": ctx, "chunk": new, "rows": rows,
                         "route_whole": routes["whole"], "route_chunk": routes["chunk"]}
            for name, fn in calls.items():
                row[name + "_ms"] = measure_eager(res, f"{tag} {name}", fn, s.smoke)
            row["whole_over_split"] = row["whole_ms"] / row["split_ms"]
            row["split_over_parts"] = row["split_ms"] / (row["rows_ms"] + row["chunk_ms"])
            row["split_rel_err_vs_whole"] = check(
                res, tag + " check", lambda: rel_err(calls["split"](), calls["whole"]()))
            if ctx == s.mixed_contexts[0]:  # the eager float32 reference: the first context
                for name in ("whole", "split"):
                    row[name + "_rel_err_vs_eager_fp32"] = check(
                        res, f"{tag} {name} check",
                        lambda n=name: rel_err(calls[n](), reference()))
            res["mixed"].append(row)
            save()
            print(f"{tag} | whole({row['route_whole']})={row['whole_ms']:.3f} "
                  f"split({row['route_chunk']}+decode)={row['split_ms']:.3f} "
                  f"rows={row['rows_ms']:.3f} chunk={row['chunk_ms']:.3f} ms | "
                  f"whole/split={row['whole_over_split']:.2f} "
                  f"err={row['split_rel_err_vs_whole']:.1e} "
                  f"(vs fp32: {row.get('split_rel_err_vs_eager_fp32', math.nan):.1e})", flush=True)


def print_mixed(res: dict) -> None:
    print(f"mixed step, one attention layer call (eager ms; {res['dtype']})")
    print("form      ctx chunk rows | whole (route)      split   rows  chunk | whole/split "
          "split/(rows+chunk) | split err vs whole, vs fp32")
    for r in res["mixed"]:
        print(f"{r['form']:8s} {r['ctx']:6d} {r['chunk']:4d} {r['rows']:4d} | "
              f"{r['whole_ms']:7.3f} ({r['route_whole']:6s}) {r['split_ms']:7.3f} "
              f"{r['rows_ms']:7.3f} {r['chunk_ms']:7.3f} | {r['whole_over_split']:6.2f} "
              f"{r['split_over_parts']:6.2f} | {r['split_rel_err_vs_whole']:.1e} "
              f"{r.get('split_rel_err_vs_eager_fp32', math.nan):.1e}")


def plot_mixed(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    forms = [f for f in MIXED_FORMS if any(r["form"] == f for r in res["mixed"])] or ["unified"]
    fig, ax = plt.subplots(1, len(forms), figsize=(7 * len(forms), 5), squeeze=False)
    for axis, form in zip(ax[0], forms):
        rows = [r for r in res["mixed"] if r["form"] == form]
        x = range(len(rows))
        for i, key in enumerate(("whole", "split", "rows", "chunk")):
            axis.bar([j + (i - 1.5) * 0.2 for j in x], [r[key + "_ms"] for r in rows], 0.2,
                     label=key)
        axis.set_xticks(list(x), [f"{r['ctx']}\n{r['chunk']}+{r['rows']}x1\n"
                                  f"{r['whole_over_split']:.2f}x" for r in rows], fontsize=7)
        axis.set(yscale="log", ylabel="ms (eager)",
                 title=f"mixed step, {form}: context / chunk + rows / whole over split")
        axis.legend(fontsize=7)
    fig.suptitle(f"{res['device']} {res['dtype']} H={res['shape']['n_heads']} "
                 f"Hkv={res['shape']['n_kv']} D={res['shape']['head_dim']} "
                 f"r={res['shape']['rank']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --cascade-prefill: prefill chunks of a group over one shared prefix (32 agents each
# prefilling an observation over one context), one layer call of the engine's dispatch.
# Prefix-launch tiles timed beside it (kernel alone: ``kernels.cascade_prefill`` with
# ``prefix_tuning``), in query rows (tokens x padded GQA group), key block and warps: which
# tile the prefix launch wants (shared_prefix_prefill.PREFIX_ROWS / PREFIX_TUNING).
CASCADE_PREFIX_TILES: dict[str, tuple[int, int, int]] = {
    "r64_n64_w4": (64, 64, 4), "r128_n32_w8": (128, 32, 8), "r128_n64_w8": (128, 64, 8),
    "r256_n64_w8": (256, 64, 8),
}


def cascade_prefill_cases(s: Setup) -> list[tuple[int, int, int]]:
    """(shared prefix keys, members, new tokens per member) of --cascade-prefill."""
    return [(p, g, n) for p in s.cascade_prefixes for g in s.cascade_members
            for n in s.cascade_new]


def cascade_prefill_step(s: Setup, prefix: int, members: int, new: int,
                         tiles: bool = False) -> tuple[dict[str, Callable[[], torch.Tensor]],
                                                       dict]:
    """One attention layer call (``KernelAttention.forward``, page writes included) of
    ``members`` chunks of ``new`` tokens, each over the same ``prefix`` keys (the same
    pages, page-aligned, marked as one group) then its own pages: "ungrouped", the engine's
    dispatch as it was (``CostPrefillPolicy`` with cascade off: the route it picks, flash
    included); "ungrouped_paged", the same with the Triton paged route pinned; "grouped",
    ``FixedPrefillPolicy(cascade=True)``: the prefix once per group; with ``tiles``,
    "tile_<name>": the kernel alone with each of ``CASCADE_PREFIX_TILES`` for its prefix
    launch at the engine's split count, and the default tile unsplit. Returns the calls and
    the routes the engine's calls took (after one call), with that split count."""
    from forkserve import kernels
    from forkserve.backend.protocol import SharedPrefix
    shared = prefix // s.page
    own = -(-new // s.page)
    pages = s.perm[:shared + members * own]
    bt = torch.cat([pages[:shared].expand(members, shared),
                    pages[shared:].view(members, own)], dim=1).contiguous()
    keys = prefix + new
    lens = torch.full((members,), keys, dtype=torch.int32, device=s.device)
    cu = torch.arange(0, members * new + 1, new, dtype=torch.int32, device=s.device)
    tensors = step_tensors(s, bt, bt, members, new, keys)
    counts = kernels.PrefillCounts((new,) * members, (keys,) * members)
    ad = torch.full((members,), -1, dtype=torch.int32, device=s.device)
    marks = (SharedPrefix(0, shared),) * members
    policies = {"ungrouped": kernels.CostPrefillPolicy(cascade_prefix_ratio=None),
                "ungrouped_paged": kernels.FixedPrefillPolicy(),
                "grouped": kernels.FixedPrefillPolicy(cascade=True)}
    calls, routes = {}, {}
    for name, policy in policies.items():
        fn, attention = engine_call(s, tensors, bt, bt, lens, cu, ad, counts, False, policy,
                                    marks)
        fn()
        calls[name], routes[name] = fn, "+".join(sorted(attention.prefill_routes))
    group = [(tuple(range(members)), prefix)]
    splits = kernels.prefix_splits(group, counts.query_lens, s.n_heads, s.n_kv)
    routes["prefix_splits"] = splits
    if tiles:
        pad = 1 << (s.n_heads // s.n_kv - 1).bit_length()
        variants = {name: (tile, splits) for name, tile in CASCADE_PREFIX_TILES.items()}
        variants["r128_n64_w8_unsplit"] = (CASCADE_PREFIX_TILES["r128_n64_w8"], 1)
        for name, ((rows, block_n, warps), n) in variants.items():
            groups = kernels.prefill_groups(group, counts.query_lens, counts.seq_lens, bt, n)
            tuning = {"block_m": max(1, rows // pad), "block_n": block_n, "num_warps": warps}
            calls["tile_" + name] = lambda t=tuning, g=groups: kernels.cascade_prefill(
                tensors["q"], s.k, s.v, bt, lens, cu, g, use_triton=True, counts=counts,
                prefix_tuning=t)
    return calls, routes


def run_cascade_prefill(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """Per case (JSON saved after each): the three calls timed eagerly (a prefill step runs
    eagerly), grouped's output against ungrouped's."""
    for prefix, members, new in cascade_prefill_cases(s):
        tag = f"cascade prefill prefix={prefix} members={members} new={new}"
        calls, routes = cascade_prefill_step(s, prefix, members, new, tiles=True)
        row: dict = {"prefix": prefix, "members": members, "new": new,
                     "route_ungrouped": routes["ungrouped"], "route_grouped": routes["grouped"],
                     "prefix_splits": routes["prefix_splits"]}
        for name, fn in calls.items():
            row[name + "_ms"] = measure_eager(res, f"{tag} {name}", fn, s.smoke)
        row["ungrouped_over_grouped"] = row["ungrouped_ms"] / row["grouped_ms"]
        row["paged_over_grouped"] = row["ungrouped_paged_ms"] / row["grouped_ms"]
        row["grouped_rel_err_vs_ungrouped"] = check(
            res, tag + " check", lambda: rel_err(calls["grouped"](), calls["ungrouped"]()))
        tile_ms = {k[5:-3]: v for k, v in row.items() if k.startswith("tile_")}
        row["best_tile"] = min(tile_ms, key=tile_ms.get)
        row["best_tile_ms"] = tile_ms[row["best_tile"]]
        res["cascade_prefill"].append(row)
        save()
        print(f"{tag} | ungrouped({row['route_ungrouped']})={row['ungrouped_ms']:.3f} "
              f"paged={row['ungrouped_paged_ms']:.3f} grouped={row['grouped_ms']:.3f} ms | "
              f"ratio={row['ungrouped_over_grouped']:.2f} "
              f"err={row['grouped_rel_err_vs_ungrouped']:.1e} splits={row['prefix_splits']} "
              f"best tile {row['best_tile']}", flush=True)


def print_cascade_prefill(res: dict) -> None:
    print(f"cascade prefill, one attention layer call (eager ms; {res['dtype']}); ratio: "
          "ungrouped / grouped (> 1: grouping wins)")
    print(" prefix members  new | ungrouped (route)     paged  grouped | ratio paged/grp | err"
          "     | splits | best prefix tile (kernel alone)")
    for r in res["cascade_prefill"]:
        print(f"{r['prefix']:7d} {r['members']:7d} {r['new']:4d} | {r['ungrouped_ms']:8.3f} "
              f"({r['route_ungrouped']:6s}) {r['ungrouped_paged_ms']:8.3f} "
              f"{r['grouped_ms']:8.3f} | {r['ungrouped_over_grouped']:5.2f} "
              f"{r['paged_over_grouped']:5.2f} | {r['grouped_rel_err_vs_ungrouped']:.1e} | "
              f"{r['prefix_splits']:6d} | {r['best_tile']} {r['best_tile_ms']:.3f}")


def plot_cascade_prefill(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["cascade_prefill"]
    fig, axis = plt.subplots(figsize=(max(7, 0.6 * len(rows)), 5))
    x = range(len(rows))
    for i, key in enumerate(("ungrouped", "ungrouped_paged", "grouped")):
        axis.bar([j + (i - 1) * 0.27 for j in x], [r[key + "_ms"] for r in rows], 0.27,
                 label=key)
    axis.set_xticks(list(x), [f"{r['prefix']}\n{r['members']}x{r['new']}\n"
                              f"{r['ungrouped_over_grouped']:.2f}x" for r in rows], fontsize=7)
    axis.set(yscale="log", ylabel="ms (eager)",
             title="cascade prefill: prefix / members x new tokens / ungrouped over grouped")
    axis.legend(fontsize=7)
    fig.suptitle(f"{res['device']} {res['dtype']} H={res['shape']['n_heads']} "
                 f"Hkv={res['shape']['n_kv']} D={res['shape']['head_dim']} "
                 f"page={res['shape']['page_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --decode-short: unified decode of short sequences (decode_bench's prompt 512 and up) in
# tables as wide as their keys and as a wide decode graph's (8K / 32K), the static split plan
# of before against the dynamic one (decode_attention.paged_decode_triton ``plan``), and the
# dynamic plan at forced split counts: which count the H200 wants per batch and length.
SHORT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
# ... and the dynamic plan at other (key tile, warps, pipeline stages) than the default
# (64, 4, 2): at 512 keys x batch 64 each program walks nine tiles with one load ahead
# (2.8 TB/s on the H200, round 8), where more stages keep more loads in flight.
SHORT_TILES = ((64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4), (128, 8, 2), (128, 8, 3),
               (64, 8, 3))


def short_table(s: Setup, batch: int, keys: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled pages for ``batch`` x ``keys`` in a table ``width`` keys wide, padded with the
    pool's last page (outside the shuffled ones: a decode graph's scratch page), and lens."""
    bt, _, lens = s.tables(batch, keys)
    pages = max(bt.shape[1], -(-width // s.page))
    if pages > bt.shape[1]:
        pad = torch.full((batch, pages - bt.shape[1]), s.k.shape[0] - 1, dtype=bt.dtype,
                         device=bt.device)
        bt = torch.cat([bt, pad], dim=1).contiguous()
    return bt, lens


def short_cases(s: Setup) -> list[tuple[int, int, int]]:
    """(keys, table width in keys, batch): widths of 0 mean the keys' own."""
    cases = []
    for keys in s.short_keys:
        widths = sorted({w if w else keys for w in s.short_widths if not w or w >= keys})
        for width in widths:
            for batch in s.short_batches:
                cases.append((keys, width, batch))
    return cases


def live_splits(keys: int, splits: int, block_n: int) -> int:
    """Splits of the dynamic plan that hold keys for a ``keys``-long sequence (the kernel's
    ``DYN_SPLIT`` split: ``keys / splits`` rounded up to whole ``block_n`` tiles)."""
    per = -(-keys // splits)
    split_len = -(-per // block_n) * block_n
    return -(-keys // split_len)


def run_decode_short(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """One row per case (``save`` after each): the static plan's splits and time, the
    dynamic plan's, the dynamic plan forced to each count of ``SHORT_SWEEP`` that a
    sequence's keys can fill, achieved TB/s (K+V bytes read / time), and the outputs
    checked against each other (and the float32 reference where the table is not wide)."""
    from forkserve.kernels.split_kv import dynamic_splits, plan_splits, sm_count
    tuning = {"block_n": 16} if s.smoke else {}
    block_n = tuning.get("block_n", 64)
    per_key = 2 * s.n_kv * s.head_dim * s.k.element_size()
    res["decode_short_tuning"] = {"block_n": block_n, "num_warps": 4, "num_stages": 2}
    for keys, width, batch in short_cases(s):
        bt, lens = short_table(s, batch, keys, width)
        bound = bt.shape[1] * s.page
        q = s.q(batch)
        n_programs = batch * s.n_kv
        old_splits, old_len = plan_splits(n_programs, bound, s.device, block_n)
        new_splits = dynamic_splits(n_programs, bound, sm_count(s.device), block_n)

        def run(plan: str, splits: int | None = None) -> torch.Tensor:
            return paged_decode_triton(q, s.k, s.v, bt, lens, max_seq_len=bound, plan=plan,
                                       num_splits=splits, **tuning)

        tag = f"decode-short keys={keys} width={bound} batch={batch}"
        kv_bytes = batch * keys * per_key
        row: dict = {"keys": keys, "width": bound, "batch": batch, "kv_bytes": kv_bytes,
                     "old_splits": old_splits, "old_split_len": old_len,
                     "old_programs": old_splits * n_programs, "new_splits": new_splits,
                     "new_programs": new_splits * n_programs,
                     "new_live_splits": live_splits(keys, new_splits, block_n)}
        row["old_ms"] = measure(res, tag + " old", lambda: run("static"), s.smoke)
        row["new_ms"] = measure(res, tag + " new", lambda: run("dynamic"), s.smoke)
        row["old_TBps"] = kv_bytes / row["old_ms"] / 1e9
        row["new_TBps"] = kv_bytes / row["new_ms"] / 1e9
        row["new_over_old"] = row["new_ms"] / row["old_ms"]
        sweep = {}
        for n in (SHORT_SWEEP[:2] if s.smoke else SHORT_SWEEP):
            if n > -(-keys // block_n):
                break  # more splits than key tiles: only empty programs more
            sweep[str(n)] = (row["new_ms"] if n == new_splits else
                             measure(res, f"{tag} splits={n}", lambda n=n: run("dynamic", n),
                                     s.smoke))
        row["sweep_ms"] = sweep
        if sweep:
            best = min(sweep, key=lambda n: sweep[n] if sweep[n] == sweep[n] else math.inf)
            row["best_splits"], row["best_ms"] = int(best), sweep[best]
        tiles = {}
        for bn, warps, stages in (SHORT_TILES[:1] if s.smoke else SHORT_TILES):
            cfg = dict(block_n=16 if s.smoke else bn, num_warps=warps, num_stages=stages)
            tiles[f"bn{bn}_w{warps}_s{stages}"] = measure(
                res, f"{tag} tiles {cfg}", lambda cfg=cfg: paged_decode_triton(
                    q, s.k, s.v, bt, lens, max_seq_len=bound, plan="dynamic", **cfg), s.smoke)
        row["tiles_ms"] = tiles
        row["tiles_over_new"] = {k: v / row["new_ms"] for k, v in tiles.items()}
        row["new_rel_err_vs_old"] = check(res, tag + " check",
                                          lambda: rel_err(run("dynamic"), run("static")))
        if width == keys or s.smoke:
            # The reference upcasts the gathered K/V itself (not the whole pool).
            row["new_rel_err_vs_ref_fp32"] = check(res, tag + " check", lambda: rel_err(
                run("dynamic"), reference.paged_decode_ref(q.float(), s.k, s.v, bt, lens)))
        res["decode_short"].append(row)
        save()
        print(f"{tag} | old {old_splits}x{old_len} {row['old_ms']:.4f} ms "
              f"{row['old_TBps']:.2f} TB/s | new {new_splits} {row['new_ms']:.4f} ms "
              f"{row['new_TBps']:.2f} TB/s | new/old {row['new_over_old']:.2f} | best "
              f"{row.get('best_splits')} {row.get('best_ms', math.nan):.4f} ms | tiles/new "
              + " ".join(f"{k} {v:.2f}" for k, v in row["tiles_over_new"].items()), flush=True)


def print_decode_short(res: dict) -> None:
    print(f"\n== {res['device']} {res['dtype']} commit {res['commit'][:10]}: unified decode of "
          f"short sequences, static plan (old) vs dynamic (new); ms of one layer call "
          f"(copy {res.get('copy_GBps', math.nan):.0f} GB/s)")
    print(" keys  width batch | old splits x len       ms   TB/s | new splits       ms   TB/s "
          "| new/old | best splits       ms | err new-old  new-ref | best tiles / new")
    for r in res["decode_short"]:
        ratios = r.get("tiles_over_new") or {}
        tiles = min(ratios, key=ratios.get) if ratios else ""
        print(f"{r['keys']:5d} {r['width']:6d} {r['batch']:5d} | {r['old_splits']:4d} x "
              f"{r['old_split_len']:6d} {r['old_ms']:8.4f} {r['old_TBps']:6.2f} | "
              f"{r['new_splits']:10d} {r['new_ms']:8.4f} {r['new_TBps']:6.2f} | "
              f"{r['new_over_old']:7.2f} | {r.get('best_splits', 0):11d} "
              f"{r.get('best_ms', math.nan):8.4f} | {r.get('new_rel_err_vs_old', math.nan):.1e} "
              f"{r.get('new_rel_err_vs_ref_fp32', math.nan):.1e} | {tiles} "
              f"{ratios.get(tiles, math.nan):.2f}")


def plot_decode_short(res: dict, path: Path) -> None:
    """Per batch: ms (top) and TB/s (bottom) against keys, old (dashed) and new (solid) plan,
    one colour per table width class (keys, 8K, 32K)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["decode_short"]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 8), squeeze=False)

    def width_class(r: dict) -> str:
        return "width = keys" if r["width"] < 2 * r["keys"] else f"width {r['width'] // 1024}K"

    for col, batch in enumerate(batches):
        sub = [r for r in rows if r["batch"] == batch]
        classes = sorted({width_class(r) for r in sub})
        for i, cls in enumerate(classes):
            pts = sorted((r for r in sub if width_class(r) == cls), key=lambda r: r["keys"])
            keys = [r["keys"] for r in pts]
            for plan, style in (("old", "--"), ("new", "-")):
                for row_i, metric in enumerate(("ms", "TBps")):
                    axes[row_i, col].plot(keys, [r[f"{plan}_{metric}"] for r in pts],
                                          linestyle=style, marker="o", color=f"C{i}",
                                          label=f"{plan}, {cls}")
        axes[0, col].set(xscale="log", yscale="log", xlabel="keys per sequence",
                         ylabel="ms (one layer)", title=f"batch {batch}")
        axes[1, col].set(xscale="log", xlabel="keys per sequence", ylabel="K+V TB/s")
        axes[0, col].legend(fontsize=6)
    fig.suptitle(f"unified decode, short sequences: static (--) vs dynamic (-) split plan; "
                 f"{res['device']} {res['dtype']} commit {res['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_shared_prefix(s: Setup, cfg: dict[str, dict], res: dict) -> None:
    agents = s.agents
    for ctx in s.contexts:
        prefix_pages = ctx // s.page
        per = prefix_pages + -(-s.suffix // s.page)
        bt, _, _ = s.tables(agents, per * s.page)
        bt = bt.clone()
        bt[:, :prefix_pages] = bt[0, :prefix_pages]  # every agent forks the same prefix
        lens = torch.full((agents,), ctx + s.suffix, dtype=torch.int32, device=s.device)
        q = s.q(agents)
        total = ctx + s.suffix
        shared = lambda: shared_prefix_decode_triton(  # noqa: E731
            q, s.k, s.v, bt, lens, prefix_pages, max_seq_len=total, **cfg["unified"])
        indep = lambda: paged_decode_triton(q, s.k, s.v, bt, lens, max_seq_len=total,  # noqa: E731
                                            **cfg["unified"])
        tag = f"shared ctx={ctx}"
        row = {"prefix_ctx": ctx, "suffix": s.suffix, "agents": agents,
               "shared_ms": measure(res, tag + " shared", shared, s.smoke),
               "independent_ms": measure(res, tag + " independent", indep, s.smoke)}
        row["shared_over_independent"] = row["shared_ms"] / row["independent_ms"]
        row["rel_err_vs_independent"] = check(res, tag + " check",
                                              lambda: rel_err(shared(), indep()))
        # The split form: the same shared base pages, each agent its own residual pages and adapter.
        _, rbt, _ = s.tables(agents, per * s.page)
        ad = s.adapters(agents)
        one_tile = (torch.arange(agents, dtype=torch.int32, device=s.device).view(1, agents),
                    torch.full((1,), ctx, dtype=torch.int32, device=s.device),
                    torch.full((agents,), ctx, dtype=torch.int32, device=s.device))
        res_args = (q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, ad, s.inv_freq)
        line = (f"shared ctx={ctx:6d} agents={agents} shared={row['shared_ms']:.4f}ms "
                f"indep={row['independent_ms']:.4f}ms ratio={row['shared_over_independent']:.3f}")
        # Keys "split_*": two-pass (cascade and independent decodes, the default);
        # "split_msc_*": materialized scores, both. Errors against independent two-pass.
        split_indep = lambda: residual_decode_triton(*res_args, max_seq_len=total)  # noqa: E731
        for key, variant in (("split", "two_pass"), ("split_msc", "msc")):
            split = lambda v=variant: cascade_residual_decode_triton(  # noqa: E731
                *res_args, *one_tile, max_seq_len=total, variant=v)
            indep = lambda v=variant: residual_decode_triton(  # noqa: E731
                *res_args, max_seq_len=total, variant=v)
            row[f"{key}_shared_ms"] = measure(res, f"{tag} {key} shared", split, s.smoke)
            row[f"{key}_independent_ms"] = measure(res, f"{tag} {key} independent", indep, s.smoke)
            row[f"{key}_shared_over_independent"] = (row[f"{key}_shared_ms"]
                                                     / row[f"{key}_independent_ms"])
            row[f"{key}_rel_err_vs_independent"] = check(
                res, f"{tag} {key} check", lambda f=split: rel_err(f(), split_indep()))
            line += (f" {variant}: shared={row[f'{key}_shared_ms']:.4f}ms "
                     f"indep={row[f'{key}_independent_ms']:.4f}ms "
                     f"ratio={row[f'{key}_shared_over_independent']:.3f} "
                     f"err={row[f'{key}_rel_err_vs_independent']:.1e}")
        row["split_msc_over_two_pass"] = row["split_msc_shared_ms"] / row["split_shared_ms"]
        res["shared_prefix"].append(row)
        print(line + f" msc/two_pass cascade={row['split_msc_over_two_pass']:.3f}", flush=True)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    dec = res["decode"]
    for batch, style in zip(sorted({r["batch"] for r in dec}), ("o", "s", "^", "D")):
        rows = [r for r in dec if r["batch"] == batch]
        ctx = [r["ctx"] for r in rows]
        ax[0, 0].plot(ctx, [r["residual_over_unified"] for r in rows], marker=style,
                      label=f"batch {batch}")
        ax[0, 1].plot(ctx, [r["unified_GBps"] / res["copy_GBps"] for r in rows], marker=style,
                      label=f"unified b{batch}")
        ax[0, 1].plot(ctx, [r["residual_GBps"] / res["copy_GBps"] for r in rows], marker=style,
                      linestyle="--", label=f"residual b{batch}")
    ax[0, 0].axhline(1.10, color="red", linestyle=":", label="target 1.10")
    ax[0, 0].set(xscale="log", xlabel="context", ylabel="time ratio",
                 title="ResidualAttention decode / unified decode")
    ax[0, 1].axhline(0.70, color="red", linestyle=":", label="target 0.70")
    ax[0, 1].set(xscale="log", xlabel="context", ylabel="fraction of copy bandwidth",
                 title=f"decode bandwidth (copy = {res['copy_GBps']:.0f} GB/s)")
    ax[0, 0].legend(fontsize=7)
    ax[0, 1].legend(fontsize=6, ncol=2)
    plot_prefill_ms(res, ax[1, 0])
    sp = res["shared_prefix"]
    ax[1, 1].plot([r["prefix_ctx"] for r in sp], [r["shared_over_independent"] for r in sp],
                  marker="o")
    ax[1, 1].axhline(0.5, color="red", linestyle=":", label="target 0.5")
    ax[1, 1].set(xscale="log", xlabel="shared prefix length", ylabel="time ratio",
                 title="shared-prefix decode / independent "
                       f"({sp[0]['agents'] if sp else 0} agents)")
    ax[1, 1].legend(fontsize=7)
    fig.suptitle(f"{res['device']}  {res['dtype']}  H={res['shape']['n_heads']} "
                 f"Hkv={res['shape']['n_kv']} D={res['shape']['head_dim']} "
                 f"r={res['shape']['rank']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _qfold_table(**tuning) -> dict:
    """A two-pass variant whose pass 1 is the q-folded form from table rows at ``tuning``."""
    return dict(variant="two_pass", block_n=64,
                score_tuning=dict(form="qfold", angle_add=False, **tuning))


# ResidualAttention decode variants timed by --variants (name -> residual_decode_triton keywords).
VARIANTS: dict[str, dict] = {
    "two_pass_bn64": dict(variant="two_pass", block_n=64, score_tuning=dict(block_n=32)),
    "two_pass_bn32": dict(variant="two_pass", block_n=32, score_tuning=dict(block_n=32)),
    "two_pass_bn64_s16": dict(variant="two_pass", block_n=64, score_tuning=dict(block_n=16)),
    # Pass 1 with keys as M (wgmma, register A operand): the default since issue 15's run.
    "two_pass_bn64_keysm64": dict(variant="two_pass", block_n=64,
                                  score_tuning=dict(block_n=64, keys_m=True)),
    # Pass 1 with keys as M at 128-key tiles over 8 warps (221 registers): more keys per
    # program, half the programs re-reading B_k and q per tile.
    "two_pass_bn64_keysm128_w8": dict(variant="two_pass", block_n=64,
                                      score_tuning=dict(block_n=128, keys_m=True, num_warps=8)),
    # Pass 1 in the q-folded form (residual_score_qfold.py): cos/sin rows from the table
    # ("t") or by angle addition on the folded matrices ("a"); key tile, warps.
    "two_pass_qfold_t32": dict(variant="two_pass", block_n=64,
                               score_tuning=dict(form="qfold", angle_add=False, block_n=32)),
    "two_pass_qfold_t64": dict(variant="two_pass", block_n=64,
                               score_tuning=dict(form="qfold", angle_add=False, block_n=64)),
    "two_pass_qfold_t128_w8": dict(variant="two_pass", block_n=64,
                                   score_tuning=dict(form="qfold", angle_add=False, block_n=128,
                                                     num_warps=8)),
    # Round 15: pass 1 with each tile's residual rows loaded a tile ahead ("pf"), and the
    # q-folded pass reading cos/sin from a table in the queries' dtype ("16": the rows it
    # rounds to bf16 before its dots anyway, half the bytes).
    **{f"two_pass_qfold_t{bn}{'_w8' if w == 8 else ''}_pf{'16' if t16 else ''}": _qfold_table(
        block_n=bn, num_warps=w, prefetch=True, table16=t16)
       for bn, w in ((64, 4), (128, 4), (128, 8)) for t16 in (False, True)},
    # ... with KV heads per program sharing each tile's residual and cos/sin rows ("_h"),
    # and the 64-key pass with 3 pipeline stages ("_s3": two tiles of table rows in flight).
    **{f"two_pass_qfold_t{bn}{'_w8' if w == 8 else ''}_pf16_h{h}": _qfold_table(
        block_n=bn, num_warps=w, prefetch=True, table16=True, kv_heads=h)
       for bn, w, h in ((64, 4, 2), (64, 8, 2), (128, 8, 2), (64, 8, 4))},
    "two_pass_qfold_t64_pf16_s3": _qfold_table(block_n=64, prefetch=True, table16=True,
                                               num_stages=3),
    # Pass 2 launched programmatically while pass 1 runs (``pdl``; the default on sm_90
    # since round 15), and the default without it.
    "two_pass_pdl": dict(variant="two_pass", block_n=64, pdl=True),
    "two_pass_nopdl": dict(variant="two_pass", block_n=64, pdl=False),
    # Round 16: pass 2 following pass 1's published keys (``follow``, score_progress.py):
    # pass 1's programs in about 1 or 2 waves ("w"), publishing every 256-2048 keys ("s").
    **{f"two_pass_follow_w{w}_s{seg}": dict(variant="two_pass", block_n=64,
                                            follow=dict(waves=w, segment=seg))
       for w in (1, 2) for seg in (256, 512, 2048)},
    # ... launched plainly (pass 2 after pass 1's end): the polls' and uncached loads' cost
    # with nothing to overlap.
    "two_pass_follow_nopdl": dict(variant="two_pass", block_n=64, pdl=False,
                                  follow=dict(waves=2, segment=2048)),
    # The batch-1 pass 1 (128-key tiles, 8 warps, bf16 rows, two KV heads) with longer
    # chunks: fewer programs, each folding once for several pipelined tiles (its fixed chain
    # of loads is most of pass 1 at batch 1; the default cuts ~2 waves of programs).
    **{f"two_pass_b1_c{c}": _qfold_table(block_n=128, num_warps=8, prefetch=True,
                                         table16=True, kv_heads=2, chunk=c)
       for c in (256, 512, 1024)},
    "two_pass_bn64_keysm64_pf": dict(variant="two_pass", block_n=64,
                                     score_tuning=dict(block_n=64, keys_m=True, prefetch=True)),
    "two_pass_qfold_a64": dict(variant="two_pass", block_n=64,
                               score_tuning=dict(form="qfold", block_n=64)),
    "two_pass_qfold_a128_w8": dict(variant="two_pass", block_n=64,
                                   score_tuning=dict(form="qfold", block_n=128, num_warps=8)),
    # Materialized scores (residual_msc.py): pass 1 = the q-folded kernel also streaming
    # K_base and writing whole float32 logits ("p"/"a": its tile with cos/sin from the table /
    # by angle addition, "w" its warps; "f16": float16 logits), pass 2 = V, V_res and the
    # logits only ("bn": its tile, "w": warps). Pass 1 at 64 keys holds 86 KiB of shared
    # memory (two programs per SM), at 32 keys 45 KiB (four); see docs/KERNELS.md.
    "msc_bn64": dict(variant="msc", block_n=64),
    "msc_bn64_w8": dict(variant="msc", block_n=64, num_warps=8),
    "msc_bn32": dict(variant="msc", block_n=32),
    "msc_bn128_w8": dict(variant="msc", block_n=128, num_warps=8),
    "msc_bn64_p32": dict(variant="msc", block_n=64, score_tuning=dict(block_n=32)),
    "msc_bn64_p128_w8": dict(variant="msc", block_n=64,
                             score_tuning=dict(block_n=128, num_warps=8)),
    "msc_bn64_a64": dict(variant="msc", block_n=64, score_tuning=dict(block_n=64, angle_add=True)),
    "msc_bn64_a128_w8": dict(variant="msc", block_n=64,
                             score_tuning=dict(block_n=128, num_warps=8, angle_add=True)),
    "msc_bn64_f16": dict(variant="msc", block_n=64,
                         score_tuning=dict(block_n=64, dtype=torch.float16)),
    # msc with pass 1's halves as two kernels on two streams (residual_msc2s.py): the base
    # logits (K_base, 64-key tiles, <= 2 programs per SM) beside the q-folded residual score
    # (table rows, 64-key tiles) launched in batch slices of <= 1 program per SM (the
    # default: room for base programs beside it), 2 ("r2") or 4 ("r4": one launch up to
    # batch 64, as many residual programs as fit); pass 2 adds the float16 bias to the
    # float32 logits.
    "msc2s_bn64": dict(variant="msc2s", block_n=64),
    **{f"msc2s_bn64_r{w}": dict(variant="msc2s", block_n=64, score_tuning=dict(
        block_n=64, waves=2.0, residual=dict(block_n=64, angle_add=False, waves=float(w))))
       for w in (2, 4)},
    # The engine's default (two-pass, pass 1 picked per batch by score_tuning_for; since
    # round 13 on the dynamic plan with prefetch) beside
    # three-pass: the same pass 1, the partial kernel without acc_r writing float16 scores
    # back, the value pass over V_res (its tile: "bn", warps: "w").
    "two_pass_default": dict(variant="two_pass", block_n=64),
    # On the static split plan (the default until round 13) and unified decode's dynamic
    # plan (one split: no merge), both without prefetch.
    "two_pass_static": dict(variant="two_pass", block_n=64, plan="static", prefetch=False),
    "two_pass_dyn": dict(variant="two_pass", block_n=64, plan="dynamic", prefetch=False),
    # Pass 2 with deeper software pipelining: with every adapter off it runs at unified's
    # speed, so its extra time is the bias, residual table and V_res reads (round 13).
    **{f"two_pass{plan}_s{st}": dict(variant="two_pass", block_n=64, num_stages=st,
                                     plan="dynamic" if plan else "static", prefetch=False)
       for plan in ("", "_dyn") for st in (3, 4)},
    # ... or with the bias and residual table entries loaded a tile ahead (``prefetch``).
    "two_pass_pf": dict(variant="two_pass", block_n=64, prefetch=True, plan="static"),
    "two_pass_dyn_pf": dict(variant="two_pass", block_n=64, plan="dynamic", prefetch=True),
    # The default with pass 1 of row slice i + 1 on a side stream beside pass 2 of slice i.
    **{f"two_pass_ov{n}": dict(variant="two_pass", block_n=64, overlap_slices=n) for n in (2, 4)},
    "three_pass_bn64": dict(variant="three_pass", block_n=64),
    "three_pass_bn32": dict(variant="three_pass", block_n=32),
    "three_pass_bn64_w8": dict(variant="three_pass", block_n=64, num_warps=8),
    "chunked_bn16": dict(variant="chunked", block_n=16, chunk=256),
    "chunked_bn32": dict(variant="chunked", block_n=32, chunk=256),
    "fused_bn32": dict(variant="fused", block_n=32),
    # Round 16: one launch whose key loop scores each tile's residual by the q-folded
    # products (RES_FOLD) beside the K/V stream (64-key tiles, 4 or 8 warps; 32-key tiles:
    # half the shared memory), each tile's residual table entries a tile ahead (the
    # default) or not ("_nopf").
    "folded_bn64": dict(variant="folded", block_n=64),
    "folded_bn64_w8": dict(variant="folded", block_n=64, num_warps=8),
    "folded_bn64_nopf": dict(variant="folded", block_n=64, prefetch=False),
    "folded_bn32": dict(variant="folded", block_n=32),
    # Round 20-21: one warp-specialized Gluon launch (residual_decode_gluon.py): a TMA loader
    # warp beside the warp group of products, softmax and values.
    "ws": dict(variant="ws"),
    # What a call naming no variant runs (kernels.DEFAULT_DECODE_POLICY).
    "default": dict(),
}


def run_cascade_sweep(s: Setup, res: dict, path: Path) -> None:
    """Shared-prefix decode (32 agents) over the prefix launch's tuning (splits, key block,
    warps, stages); the suffix launch keeps the unified defaults. JSON after each context."""
    import itertools
    res["cascade_sweep"] = []
    grid = itertools.product((None, 16, 8), (32, 64), (4, 8), (2, 3))
    combos = [dict(num_splits=a, block_n=b, num_warps=w, num_stages=st) for a, b, w, st in grid]
    for ctx in s.contexts:
        prefix_pages = ctx // s.page
        per = prefix_pages + -(-s.suffix // s.page)
        bt = s.tables(s.agents, per * s.page)[0].clone()
        bt[:, :prefix_pages] = bt[0, :prefix_pages]
        lens = torch.full((s.agents,), ctx + s.suffix, dtype=torch.int32, device=s.device)
        q = s.q(s.agents)
        indep = measure(res, f"sweep ctx={ctx} independent", lambda: paged_decode_triton(
            q, s.k, s.v, bt, lens, max_seq_len=ctx + s.suffix), s.smoke)
        for tuning in combos:
            ms = measure(res, f"sweep ctx={ctx} {tuning}",
                         lambda t=tuning: shared_prefix_decode_triton(
                             q, s.k, s.v, bt, lens, prefix_pages, max_seq_len=ctx + s.suffix,
                             prefix_tuning=t),
                         s.smoke)
            res["cascade_sweep"].append({"prefix_ctx": ctx, "agents": s.agents, "suffix": s.suffix,
                                         "prefix_tuning": tuning, "shared_ms": ms,
                                         "independent_ms": indep, "ratio": ms / indep})
        best = min((r for r in res["cascade_sweep"] if r["prefix_ctx"] == ctx),
                   key=lambda r: r["shared_ms"])
        print(f"sweep ctx={ctx} independent={indep:.4f}ms best={best['shared_ms']:.4f}ms "
              f"({best['ratio']:.3f}) {best['prefix_tuning']}", flush=True)
        path.write_text(json.dumps(res, indent=1))


# The split-form cascade's variants timed by --cascade-split: name ->
# cascade_residual_decode_triton keywords, each naming its score buffer and value grid (the
# defaults moved in round 11). "two_pass": the round-10 form, float32 scores and the
# per-KV-head value grid (the errors' reference); "_fp16": the float16 score buffer;
# "_rowvalues": the value pass's row grid (one program per row and split over all heads);
# "two_pass_fp16_rowvalues" was the engine's default in rounds 11-13; all but "_pf" run
# without prefetch (the default since round 14).
# "tiled_a<agents>h<KV heads>_bn<keys>_w<warps>": variant="tiled_scores" at that tuning
# (residual_score_tiled.py; registers in docs/KERNELS.md), the first its default.
_ROUND10 = dict(score_dtype=torch.float32, value_grid="kv_head", prefetch=False)
_ROUND11 = dict(variant="two_pass", score_dtype=torch.float16, value_grid="row", prefetch=False)
CASCADE_SPLIT_VARIANTS: dict[str, dict] = {
    "two_pass": dict(variant="two_pass", **_ROUND10),
    "two_pass_fp16": dict(_ROUND10, variant="two_pass", score_dtype=torch.float16),
    "two_pass_rowvalues": dict(_ROUND10, variant="two_pass", value_grid="row"),
    "two_pass_fp16_rowvalues": _ROUND11,
    # The prefix launch at 16-key tiles: with float16 scores it spills at 32 (255 registers,
    # 48 B; --regs), not at 16 (221).
    "two_pass_fp16_rowvalues_pbn16": dict(_ROUND11, prefix_tuning=dict(block_n=16)),
    # Round 13: the prefix and suffix launches load each tile's scores a tile ahead (two-pass
    # decode's default since; its pass 2 went 1.4 -> 1.1x unified at batch 64); the engine's
    # default since round 14 (the call 0.8-1.7% faster at 8K / 32K x 32).
    "two_pass_fp16_rowvalues_pf": dict(_ROUND11, prefetch=True),
    "msc": dict(variant="msc", **_ROUND10),
    **{f"tiled_a{a}h{h}_bn{bn}_w{w}": dict(variant="tiled_scores", score_tuning=dict(
        agents=a, kv_heads=h, block_n=bn, num_warps=w), **_ROUND10)
       for a, h, bn, w in ((2, 1, 64, 8), (4, 1, 64, 8), (2, 2, 64, 8), (4, 1, 32, 8))},
    # Round 15: the tiled pass from the bf16 table (86 registers at 2 x 1 over 8 warps, was
    # 116), its suffixes on two-pass's batch 2-32 pass 1; float16 scores, row value grid.
    **{f"tiled16_a{a}h1_bn64_w8": dict(_ROUND11, variant="tiled_scores", score_tuning=dict(
        agents=a, kv_heads=1, block_n=64, num_warps=8, table16=True, suffix=dict(
            angle_add=False, block_n=64, prefetch=True, kv_heads=2)))
       for a in (2, 4)},
    # Pass 1 is the default form's largest launch since round 11: its tunings at the
    # default's buffers ("p1_" + residual_scores keywords; the default at batch 32 is
    # score_tuning_for's qfold at 64-key tiles over 4 warps).
    **{f"p1_{name}": dict(_ROUND11, score_tuning=tuning)
       for name, tuning in (
           ("round14", dict(form="qfold", angle_add=False, block_n=64, prefetch=True)),
           ("qfold_bn128_w8", dict(form="qfold", angle_add=False, block_n=128, num_warps=8)),
           ("qfold_bn64_w8", dict(form="qfold", angle_add=False, block_n=64, num_warps=8)),
           ("qfold_bn32_w4", dict(form="qfold", angle_add=False, block_n=32)),
           ("qfold_angleadd_bn64", dict(form="qfold", angle_add=True, block_n=64)),
           ("qfold_bn64_s3", dict(form="qfold", angle_add=False, block_n=64, num_stages=3)),
           ("keysm_bn64", dict(block_n=64, keys_m=True)),
       )},
}
# The split cascade's launches, in order (shared_prefix.CascadeLaunches).
SPLIT_PARTS = ("pass1", "prefix", "values", "suffix", "merge")


def split_part_bytes(s: Setup, keywords: dict, agents: int, prefix: int,
                     grids: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Bytes each launch of a split-cascade variant must move at least, from the tensors'
    shapes: every tensor it reads or writes once, the tile's shared base pages once per tile
    (as DRAM serves them when the agents' programs share them through L2). Not counted:
    q, B_k, B_v and the RoPE table (L2-resident, < 1%). ``grids``: the call's
    (``CascadeLaunches.grids``: the partials' split counts)."""
    rows, keys, suffix = agents * s.n_heads, prefix + s.split_suffix, s.split_suffix
    kv, res = s.n_kv * s.head_dim * s.k.element_size(), s.rank * s.k_res.element_size()
    tiles, pre_splits = grids["prefix"][0], grids["prefix"][2]
    splits = pre_splits + grids["suffix"][2]
    part = rows * (s.head_dim + 1) * 4  # one split slot: a float32 output row and its lse
    if keywords.get("variant") == "msc":
        score = rows * (keywords.get("score_tuning") or {}).get("dtype", torch.float32).itemsize
        return {
            "pass1": (tiles * prefix + agents * suffix) * kv + agents * keys * res + keys * score,
            "prefix": rows * pre_splits * 4 + tiles * prefix * kv + prefix * score
                      + pre_splits * part,
            "values": prefix * (score + agents * res) + rows * pre_splits * (4 + 8 * s.head_dim),
            "suffix": suffix * (agents * (kv + res) + score) + grids["suffix"][2] * part,
            "merge": splits * part + rows * s.head_dim * s.k.element_size(),
        }
    score = rows * keywords["score_dtype"].itemsize  # per key
    # float16 scores: a float32 block max per row, head and prefix key block
    block_max = (rows * 4 * -(-prefix // PREFIX_TUNING["block_n"])
                 if keywords["score_dtype"] != torch.float32 else 0)
    return {
        "pass1": keys * (agents * res + score),
        "prefix": rows * pre_splits * 4 + tiles * prefix * 2 * kv + 2 * prefix * score
                  + block_max + pre_splits * part,
        "values": prefix * (score + agents * res) + block_max
                  + rows * pre_splits * (4 + 8 * s.head_dim),
        "suffix": suffix * (agents * (2 * kv + res) + score) + grids["suffix"][2] * part,
        "merge": splits * part + rows * s.head_dim * s.k.element_size(),
    }


def run_cascade_split(s: Setup, res: dict, save: Callable[[], None]) -> None:
    """Per (shared prefix, agents): the unified cascade (the floor), then every split-form
    variant whole and each of its launches alone (pass 1 as ``<variant>_pass1_ms`` too),
    with the bytes each must move, its GB/s and the launch grids; one tile as the engine
    fills a decode graph's (the agents, then -1 up to ``cascade_tile_agents``), each agent
    its own adapter and residual pages and a ``split_suffix``-key suffix. Errors against
    the two-pass cascade."""
    from forkserve.kernels import cascade_tile_agents
    from forkserve.kernels.shared_prefix import cascade_residual_launches
    from forkserve.kernels.split_kv import sm_count
    width_tile = cascade_tile_agents(s.n_heads // s.n_kv)
    for agents in s.split_agents:
        for ctx in s.split_prefixes:
            prefix_pages, total = ctx // s.page, ctx + s.split_suffix
            bt, rbt, _ = s.tables(agents, total)
            bt = bt.clone()
            # Every page holding a prefix key is shared (a prefix may end mid-page).
            bt[:, :-(-ctx // s.page)] = bt[0, :-(-ctx // s.page)]
            lens = torch.full((agents,), total, dtype=torch.int32, device=s.device)
            q, ad = s.q(agents), s.adapters(agents)
            seqs = torch.arange(width_tile, dtype=torch.int32, device=s.device)
            tiles = (torch.where(seqs < agents, seqs, -1).view(1, width_tile),
                     torch.full((1,), ctx, dtype=torch.int32, device=s.device),
                     torch.full((agents,), ctx, dtype=torch.int32, device=s.device))
            tag = f"split prefix={ctx} agents={agents}"
            row = {"prefix_ctx": ctx, "agents": agents, "suffix": s.split_suffix,
                   "sms": sm_count(s.device),
                   "unified_ms": measure(res, tag + " unified", lambda: shared_prefix_decode_triton(
                       q, s.k, s.v, bt, lens, prefix_pages, max_seq_len=total), s.smoke)}
            args = (q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, ad, s.inv_freq,
                    *tiles)
            outs = {}
            for name in res["split_variants"]:
                keywords = CASCADE_SPLIT_VARIANTS[name]
                whole = lambda kw=keywords: cascade_residual_decode_triton(  # noqa: E731
                    *args, max_seq_len=total, **kw)
                row[name + "_ms"] = measure(res, f"{tag} {name}", whole, s.smoke)
                outs[name] = check(res, f"{tag} {name} run", whole)
                time_split_parts(s, res, row, f"{tag} {name}", name, keywords, ctx, agents,
                                 lambda kw=keywords: cascade_residual_launches(
                                     *args, max_seq_len=total, **kw))
            for name, out in outs.items():
                row[name + "_rel_err"] = check(res, f"{tag} {name} check",
                                               lambda o=out: rel_err(o, outs["two_pass"]))
            res["cascade_split"].append(row)
            save()
            print(f"{tag}: unified {row['unified_ms']:.4f} ms | " + " | ".join(
                f"{n} {row[n + '_ms']:.4f} (p1 {row[n + '_pass1_ms']:.4f})"
                for n in res["split_variants"]), flush=True)


def time_split_parts(s: Setup, res: dict, row: dict, what: str, name: str, keywords: dict,
                     prefix: int, agents: int, build: Callable[[], object]) -> None:
    """Each launch of one split-cascade variant alone, by graph replay over the buffers a
    whole run filled first: ``<name>_parts_ms``, ``_parts_bytes`` (``split_part_bytes``),
    ``_parts_GBps``, ``_grids``; ``<name>_pass1_ms`` is the pass-1 part. The prefix launch
    writes its scores back and the value pass adds into the partials, so their replays
    drift in value, not in the bytes they move. Each part starts with L2 flushed (in the
    whole call the merge, say, reads partials still in L2): the parts sum above the whole."""
    try:
        calls = build()
        calls.run()
    except Exception as exc:
        res.setdefault("errors", []).append(f"{what} launches: {exc!r}"[:600])
        calls = None
    parts = {part: measure(res, f"{what} {part}", launch, s.smoke)
             for part, launch in (calls.launches if calls else ())}
    row[name + "_pass1_ms"] = parts.get("pass1", math.nan)
    row[name + "_parts_ms"] = parts
    if calls is None:
        return
    nbytes = split_part_bytes(s, keywords, agents, prefix, calls.grids)
    row[name + "_parts_bytes"] = nbytes
    row[name + "_parts_GBps"] = {p: nbytes[p] / ms / 1e6 for p, ms in parts.items()}
    row[name + "_grids"] = {p: list(g) for p, g in calls.grids.items()}


def print_cascade_split(res: dict) -> None:
    print(f"\n== {res['device']} {res['dtype']} commit {res['commit'][:10]}: split-form cascade "
          f"decode, one layer, ms whole / pass 1 alone; err vs two_pass; then each launch "
          f"alone, L2 flushed: ms (GB/s of the bytes it must move), the prefix and value "
          f"launches' grids")
    for r in res["cascade_split"]:
        print(f"prefix {r['prefix_ctx']:6d} agents {r['agents']:3d} suffix {r['suffix']:4d} | "
              f"unified cascade {r['unified_ms']:.4f}")
        for n in split_variants(res):
            print(f"    {n:22s} {r[n + '_ms']:8.4f} / {r[n + '_pass1_ms']:8.4f}  "
                  f"err {r.get(n + '_rel_err', math.nan):.1e}")
            parts, gbps = r.get(n + "_parts_ms", {}), r.get(n + "_parts_GBps", {})
            grids = r.get(n + "_grids", {})
            print("        " + " ".join(f"{p} {ms:.4f} ({gbps.get(p, math.nan):.0f})"
                                        for p, ms in parts.items())
                  + f" = {sum(parts.values()):.4f} | programs " + " ".join(
                      f"{p} {'x'.join(map(str, grids[p]))}={math.prod(grids[p])}"
                      for p in ("prefix", "values") if p in grids)
                  + f" on {r.get('sms', '?')} SMs")


def plot_cascade_split(res: dict, path: Path) -> None:
    """Per agent count: ms against the prefix length, whole (solid) and pass 1 (dashed) per
    variant, the unified cascade in black; last panel, at the largest agent count: per
    prefix length a bar per variant stacked by launch (each timed alone), the unified
    cascade's whole call a black line across its group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["cascade_split"]
    counts = sorted({r["agents"] for r in rows})
    panels = len(counts) + 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 5), squeeze=False)
    for ax, agents in zip(axes[0], counts):
        pts = sorted((r for r in rows if r["agents"] == agents), key=lambda r: r["prefix_ctx"])
        x = [r["prefix_ctx"] for r in pts]
        ax.plot(x, [r["unified_ms"] for r in pts], color="black", marker="o", label="unified")
        for i, n in enumerate(split_variants(res)):
            ax.plot(x, [r[n + "_ms"] for r in pts], color=f"C{i}", marker="o", label=n)
            ax.plot(x, [r[n + "_pass1_ms"] for r in pts], color=f"C{i}", marker="x",
                    linestyle="--", label=n + " pass 1")
        ax.set(xscale="log", yscale="log", xlabel="shared prefix (keys)", ylabel="ms (one layer)",
               title=f"{agents} agents, {pts[0]['suffix'] if pts else 0}-key suffixes")
        ax.legend(fontsize=6)
    plot_split_parts(axes[0][-1], [r for r in rows if counts and r["agents"] == counts[-1]],
                     split_variants(res))
    fig.suptitle(f"split-form cascade: whole (-) and pass 1 (--); {res['device']} {res['dtype']} "
                 f"commit {res['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_split_parts(ax, rows: list[dict], names: list[str]) -> None:
    """Stacked bars of each variant's launches (one agent count), grouped by prefix length."""
    ticks, labels = [], []
    for g, r in enumerate(sorted(rows, key=lambda r: r["prefix_ctx"])):
        x0 = g * (len(names) + 1)
        ax.hlines(r["unified_ms"], x0 - 0.5, x0 + len(names) - 0.5, color="black",
                  label="unified cascade" if g == 0 else None)
        for j, n in enumerate(names):
            bottom = 0.0
            for k, part in enumerate(SPLIT_PARTS):
                ms = r.get(n + "_parts_ms", {}).get(part, math.nan)
                ax.bar(x0 + j, ms, bottom=bottom, color=f"C{k}",
                       label=part if g == 0 and j == 0 else None)
                bottom += ms
            ticks.append(x0 + j)
            ctx = r["prefix_ctx"]
            labels.append(f"{n} {f'{ctx // 1024}K' if ctx >= 1024 else ctx}")
    ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
    ax.set(ylabel="ms (each launch alone)",
           title=f"launch by launch, {rows[0]['agents'] if rows else 0} agents")
    ax.legend(fontsize=7)


def split_variants(res: dict) -> list[str]:
    """The variants a --cascade-split result ran (all of them before ``--split-variants``)."""
    return res.get("split_variants", list(CASCADE_SPLIT_VARIANTS))


def main_cascade_split(s: Setup, args: argparse.Namespace) -> dict:
    unknown = set(args.split_variants or ()) - set(CASCADE_SPLIT_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --split-variants {sorted(unknown)}; known: "
                         f"{', '.join(CASCADE_SPLIT_VARIANTS)}")
    names = (list(CASCADE_SPLIT_VARIANTS) if not args.split_variants else
             ["two_pass"] + [n for n in args.split_variants if n != "two_pass"])
    res = result_header(s, timing="CUDA graph replay, L2 flushed, median of CUDA events",
                        cascade_split=[], split_variants=names)
    return run_mode(res, args.out / "kernel_bench_cascade_split.json", "cascade split",
                    lambda save: run_cascade_split(s, res, save), plot_cascade_split,
                    print_cascade_split, plot_each=True)


def time_msc2s_halves(s: Setup, res: dict, row: dict, what: str, name: str, tuning: dict,
                      case: tuple) -> None:
    """``<name>_base_ms`` (base logits from K_base) and ``<name>_res_ms`` (the q-folded
    residual score) of an msc2s variant, each alone on one stream."""
    from forkserve.kernels.residual_msc2s import (
        MSC2S_TUNING,
        base_logits,
        residual_bias,
        split_logits,
    )
    from forkserve.kernels.split_kv import LOG2E
    q, bt, rbt, lens, ad, table, ctx = case
    scale = 1.0 / math.sqrt(s.head_dim)
    logits, bias = split_logits(q, s.k, bt, s.k_res, rbt, lens, s.b_k, ad, table, scale, ctx,
                                **tuning)
    base_kw = {k: v for k, v in tuning.items()
               if k in ("block_n", "num_warps", "num_stages", "waves")}
    row[name + "_base_ms"] = measure(res, what + " base", lambda: base_logits(
        q, s.k, bt, lens, logits, scale * LOG2E, **base_kw), s.smoke)
    res_tuning = tuning.get("residual", MSC2S_TUNING["residual"])
    row[name + "_res_ms"] = measure(res, what + " residual", lambda: residual_bias(
        q, s.k_res, rbt, lens, s.b_k, ad, table, s.n_kv, bias, res_tuning), s.smoke)


def time_pass2(s: Setup, res: dict, row: dict, what: str, name: str, kw: dict, case: tuple,
               tuning: dict) -> None:
    """Two-pass decode's pass 2 alone (the partial kernel adding the score pass's bias,
    ``acc_r`` over ``V_res``), on the split plan its call takes: ``<name>_pass2_ms``; again
    with every sequence's adapter off (``_pass2_noadapter_ms``: the same code, no bias,
    ``V_res`` or residual table read); and the unified partial kernel on that plan
    (``_unified_partials_ms``). Where the pass's extra time over unified goes: reads, or the
    code and registers."""
    from forkserve.kernels.decode_attention import decode_partials
    from forkserve.kernels.residual_decode_triton import residual_scores
    from forkserve.kernels.split_kv import NO_LIMIT, empty_partials, plan_splits
    q, bt, rbt, lens, ad, table, ctx = case
    block_n = kw.get("block_n", 64)
    splits, split_len = plan_splits(q.shape[0] * s.n_kv, ctx, q.device, block_n)
    part_out, part_lse = empty_partials(q, splits)
    bias = residual_scores(q, s.k_res, rbt, lens, s.b_k, ad, table, s.n_kv, ctx, **tuning)
    scale = 1.0 / math.sqrt(s.head_dim)
    common = dict(scale=scale, kv_start=0, kv_limit=NO_LIMIT, num_splits=splits,
                  split_len=split_len, split_offset=0, block_n=block_n,
                  num_warps=kw.get("num_warps", 4), num_stages=kw.get("num_stages", 2))
    off = torch.full_like(ad, -1)
    prefetch = kw.get("prefetch", False)
    for key, adapters in (("_pass2_ms", ad), ("_pass2_noadapter_ms", off)):
        residual = (s.k_res, s.v_res, rbt, s.b_k, s.b_v, adapters, table)
        row[name + key] = measure(res, what + key, lambda r=residual: decode_partials(
            q, s.k, s.v, bt, lens, part_out, part_lse, residual=r, res_bias=bias,
            prefetch=prefetch, **common), s.smoke)
    row[name + "_unified_partials_ms"] = measure(
        res, what + " unified partials", lambda: decode_partials(
            q, s.k, s.v, bt, lens, part_out, part_lse, **common), s.smoke)


def run_decode_variants(s: Setup, res: dict, names: list[str], path: Path) -> None:
    """Unified decode vs each ResidualAttention variant, no tuning, no SDPA/eager baselines.

    Per case also times each two-pass or msc variant's pass 1 alone (``<name>_scores_ms``:
    pass 2 is about the difference; for msc2s both streams, and each half alone as
    ``<name>_base_ms`` and ``<name>_res_ms``) and, at the smallest context with batch 8, the
    error of each variant against the fp32 eager path. Writes ``path`` after every case.
    """
    from forkserve.kernels.residual_decode_triton import (
        SCORE_TUNING_BY_BATCH,
        residual_scores,
        score_tuning_for,
    )
    from forkserve.kernels.residual_msc import MSC_TUNING, residual_logits
    from forkserve.kernels.residual_msc2s import MSC2S_TUNING, split_logits
    from forkserve.kernels.rope import cached_rope_table
    uni_cfg = dict(block_n=64, num_warps=4, num_stages=2)
    # default=str: a torch dtype in a variant's tuning is written by name.
    res["decode_variants_config"] = json.loads(json.dumps(
        {"unified": uni_cfg, **{n: VARIANTS[n] for n in names}}, default=str))
    res["score_tuning_default"] = [
        {"max_batch": bound, **{k: str(v) for k, v in t.items()}}
        for bound, t in SCORE_TUNING_BY_BATCH
    ]
    for ctx in s.contexts:
        for batch in s.batches:
            bt, rbt, lens = s.tables(batch, ctx)
            q, ad = s.q(batch), s.adapters(batch)
            tag = f"variants ctx={ctx} batch={batch}"
            row: dict = {"ctx": ctx, "batch": batch}
            # Through kernels.residual_decode, as the engine's calls go: a spec naming no
            # variant runs its DEFAULT_DECODE_POLICY's pick.
            calls = {name: (lambda kw=VARIANTS[name]: kernels.residual_decode(
                q, s.k, s.v, s.k_res, s.v_res, bt, rbt, lens, s.b_k, s.b_v, ad, s.inv_freq,
                use_triton=True, max_seq_len=ctx, **kw)) for name in names}
            # Whole calls interleaved with unified (round 15: timed one after another, the
            # first variant at 32K x 64 read 1.57x unified where it read 1.41x second).
            whole = measure_interleaved(res, tag, {"unified": lambda: paged_decode_triton(
                q, s.k, s.v, bt, lens, max_seq_len=ctx, **uni_cfg), **calls}, s.smoke,
                rounds=30 if ctx <= 8192 else 12)
            row["unified_ms"] = whole["unified"]
            table = cached_rope_table(s.inv_freq, ctx)
            for name in names:
                kw, fn = VARIANTS[name], calls[name]
                row[name + "_ms"] = whole[name]
                row[name + "_ratio"] = row[name + "_ms"] / row["unified_ms"]
                if kw.get("variant") in ("two_pass", "three_pass"):
                    tuning = kw.get("score_tuning") or score_tuning_for(batch)
                    row[name + "_scores_ms"] = measure(
                        res, f"{tag} {name} scores", lambda t=tuning: residual_scores(
                            q, s.k_res, rbt, lens, s.b_k, ad, table, s.n_kv, ctx, **t), s.smoke)
                    if kw.get("variant") == "two_pass" and kw.get("plan") == "static":
                        time_pass2(s, res, row, f"{tag} {name}", name, kw,
                                   (q, bt, rbt, lens, ad, table, ctx), tuning)
                elif kw.get("variant") == "msc":  # pass 1 (K_base + K_res -> logits) alone
                    tuning = kw.get("score_tuning") or MSC_TUNING
                    row[name + "_scores_ms"] = measure(
                        res, f"{tag} {name} logits", lambda t=tuning: residual_logits(
                            q, s.k, bt, s.k_res, rbt, lens, s.b_k, ad, table,
                            1.0 / math.sqrt(s.head_dim), ctx, **t), s.smoke)
                elif kw.get("variant") == "msc2s":  # pass 1 on its two streams, then each half
                    tuning = kw.get("score_tuning") or MSC2S_TUNING
                    row[name + "_scores_ms"] = measure(
                        res, f"{tag} {name} logits", lambda t=tuning: split_logits(
                            q, s.k, bt, s.k_res, rbt, lens, s.b_k, ad, table,
                            1.0 / math.sqrt(s.head_dim), ctx, **t), s.smoke)
                    # Each half alone, into the variant's own buffers (unless pass 1 failed:
                    # its error is recorded, the halves would fail alike).
                    if not math.isnan(row[name + "_scores_ms"]):
                        time_msc2s_halves(s, res, row, f"{tag} {name}", name, tuning,
                                          (q, bt, rbt, lens, ad, table, ctx))
                if ctx == s.contexts[0] and batch == 8 or s.smoke:
                    row[name + "_rel_err_vs_eager_fp32"] = check(
                        res, tag + " check", lambda fn=fn: rel_err(
                            fn(), sdpa_decode(s, q.float(), *(t.float() for t in eager_reconstruct(
                                s, bt, rbt, ctx, ad)))))
            res["decode_variants"].append(row)
            path.write_text(json.dumps(res, indent=1))
            print(f"variants ctx={ctx:6d} b={batch:3d} uni={row['unified_ms']:.4f}ms " + " ".join(
                f"{n}={row[n + '_ms']:.4f}({row[n + '_ratio']:.2f}x"
                + (f", p1 {row[n + '_scores_ms']:.4f}" if n + "_scores_ms" in row else "")
                + (f", base {row[n + '_base_ms']:.4f}, res {row[n + '_res_ms']:.4f}"
                   if n + "_base_ms" in row else "")
                + (f", p2 {row[n + '_pass2_ms']:.4f} / no adapter "
                   f"{row[n + '_pass2_noadapter_ms']:.4f} / unified "
                   f"{row[n + '_unified_partials_ms']:.4f}" if n + "_pass2_ms" in row else "")
                + ")"
                for n in names), flush=True)


def plot_variants(res: dict, path: Path) -> None:
    """Per batch: each variant's time over unified (top) and its score pass alone over
    unified (bottom, two-pass and msc variants)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["decode_variants"]
    names = [n for n in res["decode_variants_config"] if n != "unified"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(4.5 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        sub = [r for r in rows if r["batch"] == batch]
        ctx = [r["ctx"] for r in sub]
        top, bottom = axes[0, col], axes[1, col]
        for name in names:
            top.plot(ctx, [r[name + "_ratio"] for r in sub], marker="o", label=name)
            if name + "_scores_ms" in sub[0]:
                bottom.plot(ctx, [r[name + "_scores_ms"] / r["unified_ms"] for r in sub],
                            marker="o", label=name)
            for half in ("base", "res"):  # msc2s: each stream's kernel alone
                if all(name + f"_{half}_ms" in r for r in sub):
                    bottom.plot(ctx, [r[name + f"_{half}_ms"] / r["unified_ms"] for r in sub],
                                marker=".", linestyle="--", label=f"{name} {half} alone")
        goal = 1.3 if batch == 1 else 1.15  # issue 15's goals
        top.axhline(goal, color="red", linestyle=":", label=f"goal {goal}")
        top.set(xscale="log", yscale="log", xlabel="context", ylabel="residual / unified time",
                title=f"batch {batch}")
        bottom.set(xscale="log", xlabel="context", ylabel="score pass alone / unified",
                   title=f"pass 1, batch {batch}")
        top.legend(fontsize=6)
        bottom.legend(fontsize=6)
    fig.suptitle(f"ResidualAttention decode variants, {res['device']} {res['dtype']}, "
                 f"commit {res['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_variants_table(res: dict) -> None:
    """Residual / unified per variant and case; pass 1 alone / unified in brackets; for
    msc2s also each half of pass 1 alone / unified."""
    rows = res["decode_variants"]
    names = [n for n in res["decode_variants_config"] if n != "unified"]
    print(f"\n== {res['device']} {res['dtype']} commit {res['commit']}: residual / unified "
          "(pass 1 alone / unified)")
    print(f"{'variant':28s}" + "".join(
        f"{str(r['ctx'] // 1024) + 'K' if r['ctx'] >= 1024 else r['ctx']:>6} x{r['batch']:<3d}   "
        for r in rows))
    print(f"{'unified ms':28s}" + "".join(f"{r['unified_ms']:12.4f}  " for r in rows))
    for name in names:
        cells = []
        for r in rows:
            p1 = r.get(name + "_scores_ms")
            cells.append(f"{r[name + '_ratio']:5.2f}"
                         + (f" ({p1 / r['unified_ms']:4.2f})" if p1 else " " * 7))
        print(f"{name:28s}" + "  ".join(cells))
        for half in ("base", "res"):
            if any(name + f"_{half}_ms" in r for r in rows):
                print(f"{'  ' + half + ' alone':28s}" + "  ".join(
                    f"{r.get(name + f'_{half}_ms', math.nan) / r['unified_ms']:5.2f}" + " " * 7
                    for r in rows))


# (agents, KV heads, key tile, warps) of the tiled score pass that --regs compiles.
TILED_SCORE_CONFIGS = ((2, 1, 64, 8), (4, 1, 64, 8), (2, 2, 64, 8), (4, 1, 32, 8), (2, 1, 64, 4),
                       (4, 1, 64, 4), (8, 1, 32, 8))


def register_report(out: Path) -> None:
    """Registers, spills and shared memory of the decode and prefill kernels for sm_90a,
    with no GPU.

    Compiles each variant with the same specialisation the JIT applies on the device
    (pointers and strides divisible by 16) and runs the ptxas that Triton ships with
    ``-v``. Writes ``kernel_regs.json`` and prints a table.
    """
    import inspect
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from forkserve.kernels.decode_attention import _decode_partial_kernel, residual_columns
    from forkserve.kernels.prefill_attention import _prefill_kernel
    from forkserve.kernels.residual_decode_triton import (
        _residual_decode_chunked_kernel,
        _residual_score_kernel,
        _residual_value_kernel,
    )

    # The ptxas Triton itself runs (its PTX version follows it: on the H200 machine a CUDA
    # toolkit's, newer than the one in Triton's wheel).
    ptxas = get_ptxas(90).path
    fp32_ptrs = {"RopeTable", "PartOut", "PartLse", "Logits", "Lse", "Scores", "BlockMax"}
    fp16_ptrs = {"Bias", "LogitBias"}
    int_ptrs = {"BlockTables", "ResBlockTables", "SeqLens", "CuSeqlensQ", "AdapterIdx", "TileSeqs",
                "TileLens", "KvStarts", "KvRange", "QRows", "Flags"}
    bf16_ptrs = {"Q", "K", "V", "KR", "VR", "BK", "BV", "Out"}

    def compile_one(kernel, consts: dict, num_warps: int, num_stages: int,
                    logits: bool = False, fp16_scores: bool = False,
                    table16: bool = False) -> dict:
        """``logits``: the score buffer is msc's float32 logits, whose rows residual_logits
        pads to 16 entries (so the JIT sees its strides divisible by 16); with
        ``fp16_scores`` a float16 buffer of such rows (the split cascade's default).
        ``table16``: the RoPE table in the queries' dtype (``rope.rope_table_in``)."""
        names = kernel.arg_names
        # Constexprs left out take their defaults, as at a launch.
        consts = {p.name: p.default for p in kernel.params
                  if p.is_constexpr and p.default is not inspect.Parameter.empty} | consts
        sig, attrs = {}, {}
        for i, n in enumerate(names):
            if n in consts:
                sig[n] = "constexpr"
            elif n in bf16_ptrs or n in fp32_ptrs or n in int_ptrs or n in fp16_ptrs:
                half = (n in fp16_ptrs and not (logits and n == "Bias")
                        or fp16_scores and n in ("Bias", "Scores"))
                bf16 = n in bf16_ptrs or table16 and n == "RopeTable"
                sig[n] = ("*bf16" if bf16 else "*fp16" if half
                          else "*fp32" if n in fp32_ptrs or n == "Bias" else "*i32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif n == "qk_scale":
                sig[n] = "fp32"
            else:
                sig[n] = "i32"
                aligned = n != "stride_lh" and (logits or n not in ("stride_sh", "stride_sb"))
                if n.startswith("stride") and aligned:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                        constexprs={(names.index(k),): v for k, v in consts.items()})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o",
                                  str(Path(tmp) / "k.o")],
                                 capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        return {"registers": int(regs.group(1)) if regs else None,
                "spill_store_bytes": int(spill.group(1)) if spill else None,
                "shared_bytes": compiled.metadata.shared}

    rows = []
    dec = dict(GROUP=4, SEQS=1, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, RANK=16)
    # (residual, split_score, two-pass score bias): unified, fused rebuild, fused split
    # score, and pass 2 of the two-pass kernel; then pass 1 (the score kernel) alone.
    for has_res, split, bias in ((False, False, False), (True, False, False), (True, True, False),
                                 (True, False, True)):
        for block_n in (32, 64):
            consts = dict(dec, BLOCK_N=block_n, HAS_RES=has_res, SPLIT_SCORE=split, RES_BIAS=bias)
            if bias:  # decode_partials pads acc_r to 32 columns in pass 2 (16: 255 registers)
                consts["RANK"] = 32
            rows.append({"kernel": "decode_pass2" if bias else "decode", "residual": has_res,
                         "split_score": split, "block_n": block_n, "num_warps": 4,
                         **compile_one(_decode_partial_kernel, consts, 4, 2)})
    # Unified decode's dynamic plan: per-sequence splits writing live partials, or one split
    # writing the output itself (PartOut compiled as float32 here; bf16 on the device).
    for mode in ("LIVE_ONLY", "DIRECT"):
        consts = dict(dec, BLOCK_N=64, HAS_RES=False, SPLIT_SCORE=False, RES_BIAS=False,
                      DYN_SPLIT=True, **{mode: True})
        rows.append({"kernel": "decode_dyn_" + mode.lower(), "residual": False,
                     "split_score": False, "block_n": 64, "num_warps": 4,
                     **compile_one(_decode_partial_kernel, consts, 4, 2)})
    for block_n in (16, 32):
        consts = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n, RANK=32,
                      RANK_K=16, CHUNK=256)
        rows.append({"kernel": "chunked", "residual": True, "split_score": False,
                     "block_n": block_n, "num_warps": 4,
                     **compile_one(_residual_decode_chunked_kernel, consts, 4, 2)})
    for keys_m, block_n, warps in ((False, 16, 4), (False, 32, 4), (False, 64, 4), (False, 64, 8),
                                   (True, 32, 4), (True, 64, 4), (True, 128, 8)):
        consts = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n, RANK=16,
                      KEYS_M=keys_m)
        rows.append({"kernel": "score_pass1" + ("_keys_m" if keys_m else ""), "residual": True,
                     "split_score": False, "block_n": block_n, "num_warps": warps,
                     **compile_one(_residual_score_kernel, consts, warps, 2)})
    # Pass 1 in the q-folded form: cos/sin from the table or by angle addition.
    from forkserve.kernels.residual_score_qfold import _qfold_score_kernel
    for angle_add in (False, True):
        for block_n, warps in ((32, 4), (64, 4), (128, 4), (128, 8)):
            consts = dict(GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n, RANK=16,
                          ANGLE_ADD=angle_add)
            rows.append({"kernel": "score_qfold" + ("_angle" if angle_add else "_table"),
                         "residual": True, "split_score": False, "block_n": block_n,
                         "num_warps": warps, **compile_one(_qfold_score_kernel, consts, warps, 2)})
    # Materialized scores (msc): pass 1 is the q-folded kernel writing whole float32 logits
    # (it also streams K_base), pass 2 the partial kernel reading them instead of K.
    for angle_add, block_n, warps in ((False, 32, 4), (False, 64, 4), (False, 128, 8),
                                      (True, 64, 4), (True, 128, 8)):
        consts = dict(GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n, RANK=16,
                      ANGLE_ADD=angle_add, LOGITS=True)
        rows.append({"kernel": "msc_pass1" + ("_angle" if angle_add else "_table"),
                     "residual": True, "split_score": False, "block_n": block_n, "num_warps": warps,
                     **compile_one(_qfold_score_kernel, consts, warps, 2, logits=True)})
    for block_n, warps in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8)):
        consts = dict(dec, BLOCK_N=block_n, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=False,
                      RES_LOGITS=True, RANK=32)
        rows.append({"kernel": "msc_pass2", "residual": True, "split_score": False,
                     "block_n": block_n, "num_warps": warps,
                     **compile_one(_decode_partial_kernel, consts, warps, 2, logits=True)})
    # msc2s: pass 1's base-logits kernel (its residual half is score_qfold_table above), and
    # pass 2 reading the float32 logits plus the float16 bias.
    from forkserve.kernels.residual_msc2s import _base_logits_kernel
    for block_n, warps in ((64, 4), (128, 4), (128, 8)):
        consts = dict(GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n, BASE_N=16)
        rows.append({"kernel": "msc2s_base", "residual": False, "split_score": False,
                     "block_n": block_n, "num_warps": warps,
                     **compile_one(_base_logits_kernel, consts, warps, 2, logits=True)})
    for block_n, warps in ((64, 4), (64, 8)):
        consts = dict(dec, BLOCK_N=block_n, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=True,
                      RES_LOGITS=True, RANK=32)
        rows.append({"kernel": "msc2s_pass2", "residual": True, "split_score": False,
                     "block_n": block_n, "num_warps": warps,
                     **compile_one(_decode_partial_kernel, consts, warps, 2, logits=True)})
    # Cascade prefix launches (32 agents' GQA groups, 128 rows): unified, two-pass (score
    # buffer float32, as the cascade allocates it) and msc (logits instead of K; V_res is the
    # value pass's); then msc's per-row suffix launch (logits read unaligned from each row's
    # prefix length).
    # Two-pass pass 2 with the bias and residual table entries loaded a tile ahead.
    for block_n, warps in ((32, 4), (64, 4)):
        consts = dict(dec, BLOCK_N=block_n, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=True,
                      RANK=32, DYN_SPLIT=True, LIVE_ONLY=True, PREFETCH=True)
        rows.append({"kernel": "decode_pass2_prefetch", "residual": True, "split_score": False,
                     "block_n": block_n, "num_warps": warps,
                     **compile_one(_decode_partial_kernel, consts, warps, 2, fp16_scores=True)})
    # Round 15-16: the default pass 1 (q-folded from the bf16 table, two KV heads per program,
    # prefetch), publishing its progress for a following pass 2 or not; pass 2 following
    # it; the folded one-launch form (the q-folded score inside the key loop).
    for block_n, warps in ((64, 4), (128, 8)):
        for publish in (False, True):
            consts = dict(GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n,
                          RANK=16, ANGLE_ADD=False, PREFETCH=True, KV_HEADS=2,
                          LAUNCH_DEPENDENTS=True, PUBLISH=publish, SPIN=publish)
            rows.append({"kernel": "score_qfold_table16_h2" + ("_publish" if publish else ""),
                         "residual": True, "split_score": False, "block_n": block_n,
                         "num_warps": warps, **compile_one(_qfold_score_kernel, consts, warps,
                                                           2, fp16_scores=True, table16=True)})
    consts = dict(dec, BLOCK_N=64, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=True, RANK=32,
                  DYN_SPLIT=True, LIVE_ONLY=True, PREFETCH=True, FOLLOW=True, SPIN=True)
    rows.append({"kernel": "decode_pass2_follow", "residual": True, "split_score": False,
                 "block_n": 64, "num_warps": 4,
                 **compile_one(_decode_partial_kernel, consts, 4, 2, fp16_scores=True)})
    for prefetch, warps in ((True, 4), (True, 8), (False, 4), (False, 8)):
        # The columns its launch gives rank 16 (a hard-coded 32 here hid its spills at 16).
        consts = dict(dec, BLOCK_N=64, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=False,
                      RANK=residual_columns(16, wide=True), DYN_SPLIT=True, LIVE_ONLY=True,
                      RES_FOLD=True, FOLD_G=4, FOLD_RANK=residual_columns(16, wide=False),
                      PREFETCH=prefetch)
        rows.append({"kernel": "decode_folded" + ("" if prefetch else "_nopf"), "residual": True,
                     "split_score": False, "block_n": 64, "num_warps": warps,
                     **compile_one(_decode_partial_kernel, consts, warps, 2, table16=True)})
    # Three-pass: the partial kernel without acc_r, float16 scores written back relative to
    # their block max (the value pass's rows are cascade_values_row_fp16 below).
    for block_n, warps in ((32, 4), (64, 4), (64, 8)):
        consts = dict(dec, BLOCK_N=block_n, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=True,
                      RANK=32, DYN_SPLIT=True, LIVE_ONLY=True, VALUE_PASS=True, REL_SCORE=True)
        rows.append({"kernel": "three_pass_pass2", "residual": True, "split_score": False,
                     "block_n": block_n, "num_warps": warps,
                     **compile_one(_decode_partial_kernel, consts, warps, 2, fp16_scores=True)})
    tiled = dict(dec, SEQS=32, BLOCK_H=128, SPLIT_SCORE=False, TILED=True, DYN_SPLIT=True,
                 VALUE_PASS=True)
    # "two_pass_fp16": the default since round 11, float16 scores stored relative to their
    # block max (REL_SCORE).
    for form in ("unified", "two_pass", "two_pass_fp16", "msc"):
        for block_n in (32, 64):
            consts = dict(tiled, BLOCK_N=block_n, HAS_RES=form != "unified",
                          RES_BIAS=form.startswith("two_pass"), RES_LOGITS=form == "msc",
                          RANK=32, REL_SCORE=form == "two_pass_fp16")
            rows.append({"kernel": f"cascade_prefix_{form}", "residual": form != "unified",
                         "split_score": False, "block_n": block_n, "num_warps": 8,
                         **compile_one(_decode_partial_kernel, consts, 8, 2, logits=True,
                                       fp16_scores=form == "two_pass_fp16")})
    # The split-form cascade's tiled score pass (32-agent tiles; the score buffer float32 as
    # above): agents x KV heads per program (N = 64 x both), key tile, warps.
    from forkserve.kernels.residual_score_tiled import _tiled_score_kernel
    for agents, kv_heads, block_n, warps in TILED_SCORE_CONFIGS:
        consts = dict(SEQS=32, SEQS_P2=32, AGENTS=agents, KV_HEADS=kv_heads, GROUP=4,
                      BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=block_n, RANK=16)
        rows.append({"kernel": f"tiled_scores_a{agents}h{kv_heads}", "residual": True,
                     "split_score": False, "block_n": block_n, "num_warps": warps,
                     **compile_one(_tiled_score_kernel, consts, warps, 2, logits=True)})
    # The split cascade's value pass (Llama-3-8B's 8 KV heads): a program per KV head (grid
    # "kv_head") or per row over all heads (grid "row", BLOCK_H 32), float32 scores; last,
    # the default since round 11: the row grid over float16 relative scores.
    for kv_heads, warps, fp16 in ((1, 4, False), (8, 4, False), (8, 8, False), (8, 4, True)):
        consts = dict(GROUP=4, KV_HEADS=kv_heads, BLOCK_H=max(16, 4 * kv_heads), HEAD_DIM=128,
                      PAGE_SIZE=16, BLOCK_N=32, RANK=16, REL_SCORE=fp16)
        rows.append({"kernel": ("cascade_values_" + ("row" if kv_heads > 1 else "kvh")
                                + ("_fp16" if fp16 else "")),
                     "residual": True, "split_score": False, "block_n": 32, "num_warps": warps,
                     **compile_one(_residual_value_kernel, consts, warps, 2, logits=True,
                                   fp16_scores=fp16)})
    consts = dict(dec, BLOCK_N=64, HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=False, RES_LOGITS=True,
                  RANK=32, SEQ_START=True, DYN_SPLIT=True)
    rows.append({"kernel": "cascade_suffix_msc", "residual": True, "split_score": False,
                 "block_n": 64, "num_warps": 4,
                 **compile_one(_decode_partial_kernel, consts, 4, 2, logits=True)})
    pre = dict(GROUP=4, GROUP_PAD=4, HEAD_DIM=128, PAGE_SIZE=16, RANK=16, BLOCK_N=64)
    for has_res, block_m, warps in ((False, 16, 4), (True, 32, 8)):
        consts = dict(pre, BLOCK_M=block_m, HAS_RES=has_res, SPLIT_SCORE=False)
        rows.append({"kernel": "prefill", "residual": has_res, "split_score": False, "block_n": 64,
                     "block_m": block_m, "num_warps": warps,
                     **compile_one(_prefill_kernel, consts, warps, 2)})
    # Cascade prefill's prefix launch (shared_prefix_prefill.py: 128 query rows, 8 warps).
    consts = dict(pre, BLOCK_M=32, HAS_RES=False, SPLIT_SCORE=False, HAS_RANGE=True,
                  HAS_ROWS=True, STORE_LSE=True)
    rows.append({"kernel": "cascade_prefill", "residual": False, "split_score": False,
                 "block_n": 64, "block_m": 32, "num_warps": 8,
                 **compile_one(_prefill_kernel, consts, 8, 2)})
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_regs.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['kernel']:19s} residual={r['residual']!s:5s} split={r['split_score']!s:5s} "
              f"block_n={r['block_n']:3d} warps={r['num_warps']}: {r['registers']} registers, "
              f"{r['spill_store_bytes']} B spilled, {r['shared_bytes'] // 1024} KiB shared")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["decode", "prefill", "shared", *MIXED_FORMS],
                        help="steps to leave out (unified / residual: forms of --mixed)")
    parser.add_argument("--regs", action="store_true",
                        help="no GPU: registers/spills of the kernels for sm_90a (ptxas -v)")
    parser.add_argument("--variants", nargs="*", choices=sorted(VARIANTS),
                        help="only decode: unified vs these ResidualAttention variants (no tuning, "
                             "no SDPA/eager), plus shared-prefix unless skipped; writes "
                             "kernel_bench_<tag>.json/.png")
    parser.add_argument("--contexts", nargs="*", type=int, help="decode contexts (default: all)")
    parser.add_argument("--batches", nargs="*", type=int, help="decode batches (default: all)")
    parser.add_argument("--tag", help="file name tag for --variants (default decode_variants) "
                                      "and --mixed (default mixed)")
    parser.add_argument("--prefill", action="store_true",
                        help="only: the prefill routes side by side (no decode tuning); writes "
                             "kernel_bench_prefill.json/.png")
    parser.add_argument("--prefill-contexts", nargs="*", type=int,
                        help="batch-1 prefill contexts (default 1K 4K 8K 32K)")
    parser.add_argument("--mixed", action="store_true",
                        help="only: mixed steps, whole batch on the prefill route vs the chunk on "
                             "its route + the one-token rows on the decode kernel; writes "
                             "kernel_bench_<tag>.json/.png")
    parser.add_argument("--mixed-contexts", nargs="*", type=int,
                        help="keys per sequence of --mixed (default 8K 32K)")
    parser.add_argument("--mixed-rows", nargs="*", type=int,
                        help="one-token rows beside the chunk of --mixed (default 8 28)")
    parser.add_argument("--chunk", type=int, help="new tokens of --mixed's chunk (default 202)")
    parser.add_argument("--decode-short", action="store_true",
                        help="only: unified decode of short sequences in narrow and wide "
                             "tables, static vs dynamic split plan; writes "
                             "kernel_bench_decode_short.json/.png")
    parser.add_argument("--short-keys", nargs="*", type=int,
                        help="keys per sequence of --decode-short (default 512 1K 2K 4K)")
    parser.add_argument("--short-widths", nargs="*", type=int,
                        help="table widths in keys of --decode-short, 0 = the keys' own "
                             "(default 0 8K 32K)")
    parser.add_argument("--short-batches", nargs="*", type=int,
                        help="batches of --decode-short (default 1 8 64)")
    parser.add_argument("--cascade-prefill", action="store_true",
                        help="only: prefill chunks of a group over one shared prefix, the "
                             "engine's layer call ungrouped against grouped (cascade); writes "
                             "kernel_bench_cascade_prefill.json/.png")
    parser.add_argument("--cascade-prefixes", nargs="*", type=int,
                        help="shared prefix keys of --cascade-prefill (default 8K 32K)")
    parser.add_argument("--cascade-members", nargs="*", type=int,
                        help="chunks per group of --cascade-prefill (default 8 32)")
    parser.add_argument("--cascade-new", nargs="*", type=int,
                        help="new tokens per chunk of --cascade-prefill (default 32 128 512)")
    parser.add_argument("--cascade-sweep", action="store_true",
                        help="only: shared-prefix decode over its prefix launch's tuning; writes "
                             "kernel_bench_cascade_sweep.json")
    parser.add_argument("--cascade-split", action="store_true",
                        help="only: the split-form cascade's variants (two-pass, float16 "
                             "scores, msc, tiled scores) whole and each launch alone; writes "
                             "kernel_bench_cascade_split.json/.png")
    parser.add_argument("--split-prefixes", nargs="*", type=int,
                        help="shared prefixes of --cascade-split (default 8K 32K)")
    parser.add_argument("--split-agents", nargs="*", type=int,
                        help="agents per prefix of --cascade-split (default 8 32)")
    parser.add_argument("--split-variants", nargs="*",
                        help="only these CASCADE_SPLIT_VARIANTS of --cascade-split (two_pass, "
                             "the errors' reference, always runs)")
    parser.add_argument("--split-suffix", type=int,
                        help="private suffix keys per agent of --cascade-split (default 600)")
    args = parser.parse_args()
    if args.regs:
        register_report(args.out)
        return
    s = Setup(args.smoke)
    # Shapes given on the command line replace the Setup's defaults.
    for arg, field in (("contexts", "contexts"), ("batches", "batches"),
                       ("prefill_contexts", "prefill_contexts"),
                       ("mixed_contexts", "mixed_contexts"), ("mixed_rows", "mixed_rows"),
                       ("chunk", "mixed_chunk"), ("short_keys", "short_keys"),
                       ("short_widths", "short_widths"), ("short_batches", "short_batches"),
                       ("cascade_prefixes", "cascade_prefixes"),
                       ("cascade_members", "cascade_members"), ("cascade_new", "cascade_new"),
                       ("split_prefixes", "split_prefixes"), ("split_agents", "split_agents"),
                       ("split_suffix", "split_suffix")):
        if getattr(args, arg):
            setattr(s, field, getattr(args, arg))
    if args.mixed:
        main_mixed(s, args)
        return
    if args.cascade_prefill:
        main_cascade_prefill(s, args)
        return
    if args.decode_short:
        main_decode_short(s, args)
        return
    if args.cascade_split:
        main_cascade_split(s, args)
        return
    if args.variants is not None:
        main_variants(s, args)
        return
    if args.prefill:
        main_prefill(s, args)
        return
    if args.cascade_sweep:
        args.out.mkdir(parents=True, exist_ok=True)
        res = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
               "commit": source_commit(), "dtype": str(s.dtype)}
        run_cascade_sweep(s, res, args.out / "kernel_bench_cascade_sweep.json")
        return
    import triton
    res: dict = {
        "device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(s.dtype),
        "commit": source_commit(),
        "shape": {"n_heads": s.n_heads, "n_kv": s.n_kv, "head_dim": s.head_dim, "rank": s.rank,
                  "page_size": s.page},
        "decode": [], "prefill": [], "shared_prefix": [],
    }
    # Measured first and last: the first can run before the clocks have ramped up; the
    # ceiling is the better of the two.
    res["copy_GBps_first"] = copy_bandwidth(s) / 1e9
    res["copy_GBps"] = res["copy_GBps_first"]
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s", flush=True)
    cfg = tune_decode(s, res)
    res["decode_config"] = cfg
    print(f"decode config {cfg}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = (("decode", lambda: run_decode(s, cfg, res)),
             ("shared", lambda: run_shared_prefix(s, cfg, res)),
             ("prefill", lambda: run_prefill(
                 s, res,
                 lambda: (args.out / "kernel_bench.json").write_text(json.dumps(res, indent=1)))))
    for name, step in steps:
        if name in args.skip:
            continue
        try:
            step()
        except Exception as exc:  # keep what was measured; report the failure
            res.setdefault("errors", []).append(f"{name}: {exc!r}"[:1000])
            print(f"{name} FAILED: {exc!r}", flush=True)
        (args.out / "kernel_bench.json").write_text(json.dumps(res, indent=1))
    res["copy_GBps_last"] = copy_bandwidth(s) / 1e9
    res["copy_GBps"] = max(res["copy_GBps_first"], res["copy_GBps_last"])
    (args.out / "kernel_bench.json").write_text(json.dumps(res, indent=1))
    plot(res, args.out / "kernel_bench.png")
    print_table(res)


def result_header(s: Setup, **fields) -> dict:
    """The head of a result file (prefill, mixed, decode variants): machine, versions and
    shape, then ``fields`` (its timing note, its empty row lists)."""
    import triton
    return {
        "device": "cpu (interpreter)" if s.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "dtype": str(s.dtype),
        "commit": source_commit(),
        "shape": {"n_heads": s.n_heads, "n_kv": s.n_kv, "head_dim": s.head_dim, "rank": s.rank,
                  "page_size": s.page},
        **fields,
    }


def publish(res: dict, path: Path, plot_fn: Callable[[dict, Path], None],
            print_fn: Callable[[dict], None]) -> None:
    """The JSON at ``path``, its PNG beside it (a plot that fails is said, not fatal), the
    printed table and the errors."""
    path.write_text(json.dumps(res, indent=1))
    try:
        plot_fn(res, path.with_suffix(".png"))
    except Exception as exc:
        print(f"plot failed: {exc!r}", flush=True)
    print_fn(res)
    for e in res.get("errors", []):
        print("ERROR", e)


def main_prefill(s: Setup, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = result_header(
        s, timing="eager (as the engine runs prefill), L2 flushed, median of CUDA events",
        prefill=[])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "kernel_bench_prefill.json"
    try:
        run_prefill(s, res, lambda: path.write_text(json.dumps(res, indent=1)))
    except Exception as exc:  # keep what was measured; report the failure
        res.setdefault("errors", []).append(f"prefill: {exc!r}"[:1000])
        print(f"prefill FAILED: {exc!r}", flush=True)
    path.write_text(json.dumps(res, indent=1))
    fig, ax = plt.subplots(1, 2, figsize=(14, 5))
    plot_prefill_ms(res, ax[0])
    plot_prefill_ratios(res, ax[1])
    fig.suptitle(f"{res['device']} {res['dtype']} H={s.n_heads} Hkv={s.n_kv} D={s.head_dim} "
                 f"r={s.rank}")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print_prefill(res)
    for e in res.get("errors", []):
        print("ERROR", e)


def run_mode(res: dict, path: Path, what: str, run: Callable[[Callable[[], None]], None],
             plot_fn: Callable[[dict, Path], None], print_fn: Callable[[dict], None],
             plot_each: bool = False) -> dict:
    """One bench mode: ``run(save)`` measures into ``res`` and calls ``save()`` after every
    case (the JSON, and with ``plot_each`` the PNG too, so a call cut at its time limit keeps
    what it measured); a failure is recorded, not fatal; then ``publish``."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(res, indent=1))
        if plot_each:
            try:
                plot_fn(res, path.with_suffix(".png"))
            except Exception as exc:
                print(f"plot failed: {exc!r}", flush=True)

    try:
        run(save)
    except Exception as exc:  # keep what was measured; report the failure
        res.setdefault("errors", []).append(f"{what}: {exc!r}"[:1000])
        print(f"{what} FAILED: {exc!r}", flush=True)
    publish(res, path, plot_fn, print_fn)
    return res


def main_mixed(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="eager (a prefill step runs eagerly), L2 flushed, median of CUDA events",
        mixed=[])
    forms = [f for f in MIXED_FORMS if f not in args.skip]
    return run_mode(res, args.out / f"kernel_bench_{args.tag or 'mixed'}.json", "mixed",
                    lambda save: run_mixed(s, res, save, forms), plot_mixed, print_mixed)


def main_cascade_prefill(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="eager (as the engine runs prefill), L2 flushed, median of CUDA events",
        cascade_prefill=[])
    return run_mode(res, args.out / "kernel_bench_cascade_prefill.json", "cascade prefill",
                    lambda save: run_cascade_prefill(s, res, save), plot_cascade_prefill,
                    print_cascade_prefill)


def main_decode_short(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="CUDA graph replay (as the engine's decode), L2 flushed, median of CUDA events",
        decode_short=[])
    res["copy_GBps"] = copy_bandwidth(s) / 1e9
    return run_mode(res, args.out / "kernel_bench_decode_short.json", "decode short",
                    lambda save: run_decode_short(s, res, save), plot_decode_short,
                    print_decode_short, plot_each=True)


def main_variants(s: Setup, args: argparse.Namespace) -> None:
    names = args.variants or list(VARIANTS)
    res = result_header(s, decode_variants=[], shared_prefix=[])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernel_bench_{args.tag or 'decode_variants'}.json"
    res["copy_GBps"] = copy_bandwidth(s) / 1e9
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s", flush=True)
    try:
        run_decode_variants(s, res, names, path)
    except Exception as exc:
        res.setdefault("errors", []).append(f"decode variants: {exc!r}"[:1000])
        print(f"decode variants FAILED: {exc!r}", flush=True)
    path.write_text(json.dumps(res, indent=1))
    if "shared" not in args.skip:
        try:
            run_shared_prefix(s, {"unified": dict(block_n=64, num_warps=4, num_stages=2)}, res)
        except Exception as exc:
            res.setdefault("errors", []).append(f"shared: {exc!r}"[:1000])
    publish(res, path, plot_variants, print_variants_table)


def print_table(res: dict) -> None:
    print(f"\n== {res['device']} copy {res['copy_GBps']:.0f} GB/s; decode cfg "
          f"{res['decode_config']}")
    print("decode: ctx batch | unified ms  resid ms  ratio | uni %bw res %bw | sdpa ms eager ms")
    for r in res["decode"]:
        print(f"{r['ctx']:6d} {r['batch']:4d} | {r['unified_ms']:9.4f} {r['residual_ms']:9.4f} "
              f"{r['residual_over_unified']:5.2f} | "
              f"{100 * r['unified_GBps'] / res['copy_GBps']:6.1f} "
              f"{100 * r['residual_GBps'] / res['copy_GBps']:6.1f} | "
              f"{r.get('sdpa_gathered_ms', math.nan):8.4f} "
              f"{r.get('eager_reconstruct_ms', math.nan):8.4f}")
    print_prefill(res)
    print("shared prefix: prefix agents | shared ms indep ms ratio")
    for r in res["shared_prefix"]:
        print(f"{r['prefix_ctx']:6d} {r['agents']:3d} | {r['shared_ms']:8.4f} "
              f"{r['independent_ms']:8.4f} {r['shared_over_independent']:5.2f}")
    for e in res.get("errors", []):
        print("ERROR", e)


if __name__ == "__main__":
    main()
