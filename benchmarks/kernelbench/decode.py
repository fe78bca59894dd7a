"""The default mode: decode (unified, ResidualAttention, SDPA, eager) and shared-prefix
decode, tuned first, then the prefill routes; one plot and one table of all three."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.kernelbench.prefill import plot_prefill_ms, print_prefill, run_prefill
from benchmarks.kernelbench.report import result_header, save_titled
from benchmarks.kernelbench.setup import (
    Setup,
    copy_bandwidth,
    eager_reconstruct,
    gathered_kv,
    rel_err,
    sdpa_decode,
)
from benchmarks.kernelbench.timing import bench, check, measure
from forkserve.kernels.decode_attention import paged_decode_triton
from forkserve.kernels.residual_decode_triton import residual_decode_triton
from forkserve.kernels.shared_prefix import (
    cascade_residual_decode_triton,
    shared_prefix_decode_triton,
)


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
    save_titled(fig, res, path)


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


def main_default(s: Setup, args: argparse.Namespace) -> None:
    """``kernel_bench.json`` / ``.png`` and the table: the copy rate, first and last, around
    the decode, shared-prefix and prefill steps that ``--skip`` leaves in."""
    res = result_header(s, decode=[], prefill=[], shared_prefix=[])
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
