"""Kernel benchmark: ResidualAttention vs unified paged attention, SDPA and the eager path.

Run on a GPU (bf16, Llama-3-8B attention: 32 heads, 8 KV heads, head_dim 128, rank 16):

    python benchmarks/kernel_bench.py --out benchmarks/results

Measures, for one attention layer:

* copy bandwidth (device-to-device copy of 4 GiB, bytes read + written): the ceiling;
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

This file is the command line: its flags, ``--smoke``'s interpreter switch (set before
anything imports Triton) and the dispatch to a mode; the modes and what they share live in
``benchmarks/kernelbench/``, one module each (its ``__init__`` lists them).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernelbench.cascade_prefill import main_cascade_prefill  # noqa: E402
from benchmarks.kernelbench.cascade_split import main_cascade_split  # noqa: E402
from benchmarks.kernelbench.cascade_sweep import main_cascade_sweep  # noqa: E402
from benchmarks.kernelbench.decode import main_default  # noqa: E402
from benchmarks.kernelbench.decode_short import main_decode_short  # noqa: E402
from benchmarks.kernelbench.mixed import MIXED_FORMS, main_mixed  # noqa: E402
from benchmarks.kernelbench.prefill import main_prefill  # noqa: E402
from benchmarks.kernelbench.registers import register_report  # noqa: E402
from benchmarks.kernelbench.setup import Setup  # noqa: E402
from benchmarks.kernelbench.variants import VARIANTS, main_variants  # noqa: E402


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
    parser.add_argument("--group", type=int,
                        help="query heads a KV head (default 4: Llama-3-8B's; 8 is Llama-3-70B's)")
    parser.add_argument("--rank", type=int, help="the residual pools' rank (default 16)")
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
    s = Setup(args.smoke, args.group, args.rank)
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
        main_cascade_sweep(s, args)
        return
    main_default(s, args)


if __name__ == "__main__":
    main()
