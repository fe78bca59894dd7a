"""``--regs``: registers, spills and shared memory of the kernels for sm_90a, with no GPU."""
from __future__ import annotations

import json
from pathlib import Path

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
    # Cascade prefix launches (32 agents' GQA groups, 128 rows): unified, two-pass (score
    # buffer float32, as the cascade allocates it) and msc (logits instead of K; V_res is the
    # value pass's); then msc's per-row suffix launch (logits read unaligned from each row's
    # prefix length).
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
