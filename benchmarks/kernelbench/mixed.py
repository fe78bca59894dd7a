"""``--mixed``: a prefill chunk beside one-token rows in one layer call, the whole batch on
the prefill route against the chunk on its route plus the rows through the decode kernel."""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

import torch

from benchmarks.kernelbench.report import result_header, run_mode, save_titled
from benchmarks.kernelbench.setup import Setup, rel_err
from benchmarks.kernelbench.timing import check, measure_eager
from forkserve import kernels


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
    save_titled(fig, res, path)


def main_mixed(s: Setup, args: argparse.Namespace) -> dict:
    res = result_header(
        s, timing="eager (a prefill step runs eagerly), L2 flushed, median of CUDA events",
        mixed=[])
    forms = [f for f in MIXED_FORMS if f not in args.skip]
    return run_mode(res, args.out / f"kernel_bench_{args.tag or 'mixed'}.json", "mixed",
                    lambda save: run_mixed(s, res, save, forms), plot_mixed, print_mixed)
