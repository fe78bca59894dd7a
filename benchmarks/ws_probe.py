"""Does Triton's Hopper warp specialization take a paged decode loop? (no GPU needed)

Rounds 16-17 (docs/KERNELS.md) left ResidualAttention decode needing one kernel whose warps
split the work: some stream K/V, others score, instead of one warp group doing both in
series (two-pass, folded) or two grids overlapping (follow). Triton's loop attribute
``tl.range(..., warp_specialize=True)`` does that split on sm_90 (a producer warp group
issuing the loads, consumer groups computing), but its pass asserts on loads it cannot hand to
a producer: the partial kernel's page gathers (``cp.async``) fail in
``NVGPUWarpSpecialization``. Page-granular TMA loads (one ``tl.make_tensor_descriptor`` box of
``PAGE`` keys per page id read from the block table) are what it takes.

This probe compiles a minimal paged decode loop of that shape (GQA rows x one KV head, online
softmax, one page a step) for sm_90 at several page sizes, row blocks and warp counts, with
and without the attribute, and reports per build whether it compiled, whether the TTGIR holds
a ``ttg.warp_specialize`` region, its TMA copies and shared memory. ``--check`` also runs the
loop in Triton's interpreter (``TRITON_INTERPRET=1``, where the attribute is a no-op) against
a float32 softmax over the gathered pages. Writes ``ws_probe.json``.

    python benchmarks/ws_probe.py --out benchmarks/results [--check]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
import triton
import triton.language as tl

# (keys per page, query rows per program, warps): the engine's 16-key pages at an 8-row GQA
# block (mma v2) and at 64 rows (one wgmma M: a cascade tile's agents), and 64-key pages.
BUILDS = ((16, 16, 4), (16, 16, 8), (16, 64, 8), (64, 16, 4), (64, 16, 8), (64, 64, 8))


@triton.jit
def _paged_decode_probe(Q, K, V, BlockTables, Out, n_pages, pool_rows, scale,
                        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr,
                        KV_HEADS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """``ROWS`` query rows of program 0's sequence over KV head ``program_id(1)``: K/V pools
    ``[pool_rows, KV_HEADS * HEAD_DIM]`` (one row per key slot), its first ``n_pages``
    page ids in ``BlockTables``. Float32 ``Out [KV_HEADS, ROWS, HEAD_DIM]``."""
    kvh = tl.program_id(1)
    k_desc = tl.make_tensor_descriptor(K, shape=[pool_rows, KV_HEADS * HEAD_DIM],
                                       strides=[KV_HEADS * HEAD_DIM, 1],
                                       block_shape=[PAGE, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, shape=[pool_rows, KV_HEADS * HEAD_DIM],
                                       strides=[KV_HEADS * HEAD_DIM, 1],
                                       block_shape=[PAGE, HEAD_DIM])
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * HEAD_DIM + d[None, :])
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for i in tl.range(0, n_pages, warp_specialize=WARP_SPECIALIZE):
        page = tl.load(BlockTables + i)
        k = k_desc.load([page * PAGE, kvh * HEAD_DIM])
        v = v_desc.load([page * PAGE, kvh * HEAD_DIM])
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(Out + (kvh * ROWS + rows[:, None]) * HEAD_DIM + d[None, :], acc / l_i[:, None])


def compile_build(page: int, rows: int, warps: int, specialize: bool) -> dict:
    """One sm_90 build of the probe (bf16 pools, 128-wide heads, 8 KV heads)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = _paged_decode_probe
    if not isinstance(kernel, JITFunction):  # interpreted (TRITON_INTERPRET=1): its source
        kernel = JITFunction(kernel.fn)
    consts = dict(HEAD_DIM=128, PAGE=page, ROWS=rows, KV_HEADS=8, WARP_SPECIALIZE=specialize)
    sig = {n: "constexpr" if n in consts else "*bf16" if n in ("Q", "K", "V")
           else "*i32" if n == "BlockTables" else "*fp32" if n == "Out"
           else "fp32" if n == "scale" else "i32" for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()})
    row = {"page": page, "rows": rows, "num_warps": warps, "warp_specialize": specialize}
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=3))
    except Exception as exc:  # the pass's assertion aborts in C++ for some builds: see main
        return row | {"compiled": False, "error": str(exc).strip().splitlines()[-1][:300]}
    ir = compiled.asm["ttgir"]
    return row | {"compiled": True, "specialized": "ttg.warp_specialize" in ir,
                  "tma_copies": ir.count("async_tma_copy_global_to_local"),
                  "shared_bytes": compiled.metadata.shared}


def check_interpreted(seed: int = 0) -> float:
    """The loop in the interpreter over three shuffled pages against a float32 softmax:
    max abs error (run with TRITON_INTERPRET=1)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim, page, rows, kv_heads, pool_pages = 32, 16, 16, 2, 8
    k = torch.randn(pool_pages * page, kv_heads * head_dim, generator=gen).half()
    v = torch.randn(pool_pages * page, kv_heads * head_dim, generator=gen).half()
    q = torch.randn(rows, head_dim, generator=gen).half()
    pages = [5, 2, 7]
    table = torch.tensor(pages, dtype=torch.int32)
    out = torch.empty(kv_heads, rows, head_dim)
    scale = head_dim ** -0.5
    _paged_decode_probe[(1, kv_heads)](q, k, v, table, out, len(pages), pool_pages * page,
                                       scale, HEAD_DIM=head_dim, PAGE=page, ROWS=rows,
                                       KV_HEADS=kv_heads, WARP_SPECIALIZE=True)
    err = 0.0
    for h in range(kv_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        keys = torch.cat([k[p * page:(p + 1) * page, cols] for p in pages]).float()
        vals = torch.cat([v[p * page:(p + 1) * page, cols] for p in pages]).float()
        ref = torch.softmax(q.float() @ keys.T * scale, -1) @ vals
        err = max(err, float((out[h] - ref).abs().max()))
    return err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--check", action="store_true",
                        help="also run the loop in the interpreter against float32")
    parser.add_argument("--build", type=int, nargs=4, metavar=("PAGE", "ROWS", "WARPS", "WS"),
                        help=argparse.SUPPRESS)  # one build, in the child process (below)
    args = parser.parse_args(argv)
    if args.build:
        page, rows, warps, ws = args.build
        print(json.dumps(compile_build(page, rows, warps, bool(ws))))
        return 0
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = []
    for page, rows, warps in BUILDS:
        for ws in (False, True):
            # A failing warp-specialization pass aborts the process (a C++ assertion): each
            # build runs in its own.
            run = subprocess.run([sys.executable, __file__, "--build", str(page), str(rows),
                                  str(warps), str(int(ws))], env=env, capture_output=True,
                                 text=True, timeout=600)
            if run.returncode == 0:
                row = json.loads(run.stdout.strip().splitlines()[-1])
            else:
                last = [ln for ln in run.stderr.splitlines() if "Assertion" in ln or "error" in ln]
                row = {"page": page, "rows": rows, "num_warps": warps, "warp_specialize": ws,
                       "compiled": False, "error": (last or ["exit %d" % run.returncode])[0][-300:]}
            results.append(row)
            print(f"page {page:3d} rows {rows:3d} warps {warps} ws {ws!s:5}: "
                  + ("compiled, specialized=%s, %d TMA copies, %d B shared"
                     % (row["specialized"], row["tma_copies"], row["shared_bytes"])
                     if row["compiled"] else "FAILED " + row["error"][:120]), flush=True)
    report = {"triton": triton.__version__, "torch": torch.__version__,
              "python": platform.python_version(), "target": "cuda sm_90 (offline)",
              "builds": results}
    if args.check:
        report["interpreted_max_abs_err"] = subprocess.run(
            [sys.executable, "-c", "import ws_probe; print(ws_probe.check_interpreted())"],
            env=env | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parent)},
            capture_output=True, text=True, timeout=600, check=True).stdout.strip()
        print(f"interpreted against float32: max abs error {report['interpreted_max_abs_err']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ws_probe.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
