"""``--prefill``: the prefill routes side by side, eager as the engine runs them, with the
engine's own layer call (``engine_call``, also cascade_prefill's); its plot and table."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernelbench.report import result_header, run_mode, save_titled
from benchmarks.kernelbench.setup import Setup, rel_err, sdpa_backend, sdpa_prefill
from benchmarks.kernelbench.timing import bench, check, measure_eager, timed_interleaved
from forkserve.kernels.prefill_attention import paged_prefill_triton, residual_prefill_triton

# Hopper tiles for our Triton paged prefill (block_m counts tokens: x4 query rows at GQA 4),
# timed as extra columns and offered to the tuner: does our own kernel get close to flash?
PREFILL_TILES: dict[str, dict] = {
    "m32_n64_w8_s3": dict(block_m=32, block_n=64, num_warps=8, num_stages=3),
    "m32_n128_w8_s3": dict(block_m=32, block_n=128, num_warps=8, num_stages=3),
    "m32_n64_w8_s4": dict(block_m=32, block_n=64, num_warps=8, num_stages=4),
    "m16_n128_w4_s3": dict(block_m=16, block_n=128, num_warps=4, num_stages=3),
}


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


def plot_prefill(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(14, 5))
    plot_prefill_ms(res, ax[0])
    plot_prefill_ratios(res, ax[1])
    save_titled(fig, res, path)


def main_prefill(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="eager (as the engine runs prefill), L2 flushed, median of CUDA events",
        prefill=[])
    return run_mode(res, args.out / "kernel_bench_prefill.json", "prefill",
                    lambda save: run_prefill(s, res, save), plot_prefill, print_prefill)
