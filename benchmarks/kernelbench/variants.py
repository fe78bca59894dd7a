"""``--variants``: unified decode against ResidualAttention decode variants (``VARIANTS``),
each variant's passes alone, then shared-prefix decode."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.kernelbench.decode import run_shared_prefix
from benchmarks.kernelbench.report import publish, result_header, save_titled
from benchmarks.kernelbench.setup import (
    Setup,
    copy_bandwidth,
    eager_reconstruct,
    rel_err,
    sdpa_decode,
)
from benchmarks.kernelbench.timing import check, measure, measure_interleaved
from forkserve import kernels
from forkserve.kernels.decode_attention import paged_decode_triton


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
    # warp beside the warp group of products, softmax and values (since round 27 in one form:
    # round 26's deferred-sum softmax).
    "ws": dict(variant="ws"),
    # The policy's pick where ws is not measured: what a shape's ws is weighed against.
    "two_pass": dict(variant="two_pass"),
    # What a call naming no variant runs (kernels.DEFAULT_DECODE_POLICY).
    "default": dict(),
}


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
    save_titled(fig, res, path, "ResidualAttention decode variants, ")


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
