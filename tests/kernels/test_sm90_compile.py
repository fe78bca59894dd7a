"""The Triton kernels the interpreter runs on CPU, compiled for the H200 (sm_90) without a GPU.

The interpreter executes a kernel as numpy and skips the compiler's checks: a name typed
differently in the two branches of a runtime ``if`` ran under it and failed to compile on
the device (the FRESH route's rebuild, round 8). Compiling to PTX here catches that class of
error in CI. Pointers are bf16 (the serving dtype), integers i32."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from forkserve.kernels.glue import _rope_qk_kernel, _silu_mul_kernel, _write_kv_kernel  # noqa: E402
from forkserve.kernels.residual_rebuild import _rebuild_kernel  # noqa: E402
from forkserve.kernels.sm90_build import assemble_sm90a  # noqa: E402

POINTERS = {"X", "Q", "Cos", "Sin", "Out", "K", "V", "KR", "VR", "BK", "BV", "OutK", "OutV",
            "KPool", "VPool"}
# The score passes' float32 cos/sin table and score buffer (the cascade's), int32 tables.
FP32_POINTERS = {"RopeTable", "Bias"}
I32_POINTERS = {"ResBlockTables", "SeqLens", "AdapterIdx", "TileSeqs", "TileLens", "KvStarts",
                "BlockTables", "Flags"}


class _LanguageAsImported:
    """triton.language as this module found it (test collection runs no kernel). Under
    ``TRITON_INTERPRET=1`` an interpreted kernel's call of a jit helper (``tl.zeros`` is one)
    patches triton.language for the interpreter and never restores it (Triton 3.6's
    ``InterpretedFunction.__call__``); a compile that then misses Triton's cache fails on
    its first builtin, so whether these tests passed hung on the suite's order and the
    cache. ``restore`` puts back what was patched since."""

    def __init__(self) -> None:
        import triton.language as tl
        self._saved = {obj: dict(vars(obj)) for obj in (
            tl, tl.core, tl.math, tl.core.tensor, tl.core.dtype, tl.core.tensor_descriptor_base)}

    def restore(self) -> None:
        for obj, saved in self._saved.items():
            now = vars(obj)
            for name in [n for n in now if n not in saved]:
                delattr(obj, name)
            for name, value in saved.items():
                if now.get(name) is not value:
                    setattr(obj, name, value)


_LANGUAGE = _LanguageAsImported()


def compile_sm90(kernel, consts: dict, num_warps: int = 4,
                 pointers: dict[str, str] | None = None,
                 unaligned: frozenset[str] | None = None, num_stages: int | None = None) -> str:
    """PTX of ``kernel`` for sm_90 (``num_stages``: Triton's default unless given; the decode
    launches' is 2). ``unaligned``: specialise as the JIT does on the device,
    every pointer and ``stride_*`` argument divisible by 16 but these (register counts and
    spills depend on it: unspecialised addressing holds more registers)."""
    _LANGUAGE.restore()
    # Under TRITON_INTERPRET=1 (the kernel tests' setting) ``@triton.jit`` made an
    # interpreted function: compile its Python source as the device would.
    if not isinstance(kernel, JITFunction):
        kernel = JITFunction(kernel.fn)
    names = kernel.arg_names
    # Constexprs left out take their defaults, as at a launch.
    consts = {p.name: p.default for p in kernel.params
              if p.is_constexpr and p.default is not inspect.Parameter.empty} | consts
    sig = {n: "constexpr" if n in consts else "*bf16" if n in POINTERS
           else "*fp32" if n in FP32_POINTERS else "*i32" if n in I32_POINTERS
           else "*i64" if n == "Slots" else "i32" for n in names}
    # Types over the defaults (float16 score buffers), for the arguments this kernel has.
    sig.update({n: t for n, t in (pointers or {}).items() if n in sig})
    attrs = {} if unaligned is None else {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
        if n not in unaligned and (sig[n].startswith("*") or n.startswith("stride_"))}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps)
                          | ({} if num_stages is None else {"num_stages": num_stages})).asm["ptx"]


def check_ws_build(test_file: str, params: list[int | bool | str], out: Path,
                   max_spill: int = 0) -> None:
    """Builds a ws kernel by ``test_file``'s ``__main__`` (its arguments: ``out``, then
    ``params``, a bool as 0 or 1; it writes ``ws.ptx`` and ``shared`` there) in a process
    of its own, and checks what the sm_90a build must hold: TMA copies, wgmma, the loader's
    register cut, one program's shared memory (227 KiB), no spills (``max_spill`` bytes
    where a kernel's registers are cut that fine: a value or two held across its loops). A
    process of its own:
    under the kernel tests' TRITON_INTERPRET=1 every ``@jit`` helper Triton imports
    (``gl.sum``'s combine function) is an interpreted one, which the compiler refuses."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    argv = [str(int(p) if isinstance(p, bool) else p) for p in params]
    run = subprocess.run([sys.executable, test_file, str(out), *argv],
                         env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = (out / "ws.ptx").read_text()
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "setmaxnreg.dec" in ptx  # the loader partition gives its registers back
    assert int((out / "shared").read_text()) <= 227 * 1024
    assert assemble_sm90a(ptx) <= max_spill


@pytest.mark.parametrize("consts", [
    dict(HEAD_DIM=128, RANK=16, BLOCK_T=64, HEADS_PER_PROG=1, FIRST_SIDE=0, DOT_F32=False),
    dict(HEAD_DIM=128, RANK=16, BLOCK_T=64, HEADS_PER_PROG=1, FIRST_SIDE=0, DOT_F32=True),
    dict(HEAD_DIM=64, RANK=16, BLOCK_T=64, HEADS_PER_PROG=8, FIRST_SIDE=1, DOT_F32=True),
])
def test_rebuild_compiles(consts):
    assert ".entry" in compile_sm90(_rebuild_kernel, consts)


def test_glue_compiles():
    assert ".entry" in compile_sm90(_rope_qk_kernel, dict(HEAD_DIM=128, HALF_P2=64, BLOCK_T=16,
                                                          HEADS_PER_PROG=8))
    assert ".entry" in compile_sm90(_silu_mul_kernel, dict(BLOCK=2048), num_warps=8)
    assert ".entry" in compile_sm90(_write_kv_kernel, dict(HEAD_DIM=128, HEADS_P2=8, DIM_P2=128))


# Kernels that call ``@triton.jit`` device functions (their own, or tl.sum / tl.max) compile
# in a fresh interpreter-free process: under TRITON_INTERPRET=1 those functions are
# interpreted ones, which the compiler cannot inline.
_SCORE_PASSES = """
from test_sm90_compile import compile_sm90
from forkserve.kernels.sm90_build import assemble_sm90a
from forkserve.kernels.residual_score_qfold import _qfold_score_kernel
from forkserve.kernels.residual_score_tiled import _tiled_score_kernel
tiled = dict(SEQS=32, SEQS_P2=32, GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64,
             RANK=16)
for agents, kv_heads in ((2, 1), (4, 1), (2, 2)):
    ptx = compile_sm90(_tiled_score_kernel, dict(tiled, AGENTS=agents, KV_HEADS=kv_heads), 8)
    assert ".entry" in ptx
assert ".entry" in compile_sm90(_qfold_score_kernel, dict(
    GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, RANK=16, ANGLE_ADD=False,
    LOGITS=False, BASE_N=16, SEQ_START=True))
# Two-pass decode's pass 1 as the engine runs it (bf16 table rows, two KV heads, residual
# rows a tile ahead), signalling a programmatic launch of pass 2 (pdl) or not.
for launch_dependents in (False, True):
    ptx = compile_sm90(_qfold_score_kernel, dict(
        GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, RANK=16, ANGLE_ADD=False,
        PREFETCH=True, KV_HEADS=2, LAUNCH_DEPENDENTS=launch_dependents), 8,
        {"RopeTable": "*bf16", "Bias": "*fp16"})
    assert ("griddepcontrol.launch_dependents" in ptx) == launch_dependents
# ... publishing its progress for a pass 2 that follows it (score_progress.py): the zeroed
# flags fenced before the signal, each segment's publish a fence and a store.
ptx = compile_sm90(_qfold_score_kernel, dict(
    GROUP=4, BLOCK_G=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=128, RANK=16, ANGLE_ADD=False,
    PREFETCH=True, KV_HEADS=2, LAUNCH_DEPENDENTS=True, PUBLISH=True, SPIN=True), 8,
    {"RopeTable": "*bf16", "Bias": "*fp16"})
assert "fence.acq_rel.gpu" in ptx and "st.relaxed.gpu.global" in ptx
assemble_sm90a(ptx)
"""


def fresh_process(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a Python without TRITON_INTERPRET, this folder importable (the kernel
    tests' builds that are not a ws kernel's whole: ``check_ws_build``)."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parents[1]),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


def test_tiled_scores_compile():
    """The split-form cascade's tiled score pass (2 agents x 1 KV head, the default; 4 x 1;
    2 x 2) and the q-folded pass over the suffixes (``SEQ_START``)."""
    run = fresh_process(_SCORE_PASSES)
    assert run.returncode == 0, run.stderr[-3000:]


# The split cascade's prefix launch (a 32-agent tile, two-pass scores; with and without
# prefetch) and suffix launch, two-pass's pass 2 with prefetch, three-pass decode's partial
# launch and the value pass (both grids), with float32 scores and with float16 ones relative
# to a float32 block max (``REL_SCORE``).
_CASCADE_LAUNCHES = """
from test_sm90_compile import compile_sm90
from forkserve.kernels.sm90_build import assemble_sm90a
from forkserve.kernels.decode_attention import _decode_partial_kernel, residual_columns
from forkserve.kernels.residual_decode_triton import _residual_value_kernel
f32 = {n: "*fp32" for n in ("PartOut", "PartLse", "BlockMax", "LogitBias")}
# One sequence's GQA group over two-pass scores, every mode off: each launch names its own.
base = dict(GROUP=4, SEQS=1, BLOCK_H=16, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, RANK=32,
            HAS_RES=True, SPLIT_SCORE=False, RES_BIAS=True, TILED=False, SEQ_START=False,
            DYN_SPLIT=True, RES_LOGITS=False, LIVE_ONLY=False, DIRECT=False, REL_SCORE=False,
            VALUE_PASS=False, PREFETCH=False)
for rel in (False, True):
    types = f32 | {n: "*fp16" if rel else "*fp32" for n in ("Bias", "Scores")}

    def partial(warps, **modes):
        assert ".entry" in compile_sm90(_decode_partial_kernel, base | modes, warps, types)

    for prefetch in (False, True):  # the prefix launch loading each tile's scores ahead
        partial(8, SEQS=32, BLOCK_H=128, BLOCK_N=32, TILED=True, REL_SCORE=rel,
                VALUE_PASS=True, PREFETCH=prefetch)
    partial(4, SEQ_START=True, PREFETCH=True)  # the cascade's suffix launch
    partial(4, LIVE_ONLY=True, PREFETCH=True)  # two-pass decode's pass 2
    ptx = compile_sm90(_decode_partial_kernel, base | dict(LIVE_ONLY=True, PREFETCH=True,
                                                           GDC_WAIT=True), 4, types)
    assert "griddepcontrol.wait" in ptx  # ... launched programmatically (pdl)
    # ... following pass 1's published keys (score_progress.py: the poll is inline asm)
    ptx = compile_sm90(_decode_partial_kernel, base | dict(LIVE_ONLY=True, PREFETCH=True,
                                                           FOLLOW=True, SPIN=True), 4, types)
    assert "ld.global.acquire.gpu" in ptx
    assemble_sm90a(ptx)
    # The folded form (the q-folded residual score inside the loop, bf16 table rows) and
    # two-pass's pass 2 at the residual columns the launcher gives rank 16: no spills (at 16
    # columns the folded form spilled 856 bytes and ran 3.5-5.3x unified; round 17).
    wide = residual_columns(16, wide=True)
    folded = dict(RES_BIAS=False, RES_FOLD=True)
    for modes, table in ((folded, {"RopeTable": "*bf16"}), ({}, {})):
        # (a score row's strides: a multiple of 16 only where its length is)
        ptx = compile_sm90(_decode_partial_kernel, base | modes | dict(
            LIVE_ONLY=True, PREFETCH=True, RANK=wide), 4, types | table,
            unaligned=frozenset({"stride_sb", "stride_sh", "stride_lh"}), num_stages=2)
        assert assemble_sm90a(ptx) == 0, modes
    partial(4, LIVE_ONLY=True, REL_SCORE=rel, VALUE_PASS=True)  # three-pass, no acc_r
    for kv_heads, block_h in ((1, 16), (8, 32)):  # grid "kv_head", "row" (Llama-3-8B)
        assert ".entry" in compile_sm90(_residual_value_kernel, dict(
            GROUP=4, KV_HEADS=kv_heads, BLOCK_H=block_h, HEAD_DIM=128, PAGE_SIZE=16,
            BLOCK_N=32, RANK=16, REL_SCORE=rel), 4, types)
"""


def test_cascade_prefix_and_value_launches_compile():
    """The partial kernel's two-pass, three-pass and split-cascade launches and the value
    pass (both grids), float32 scores and float16 ones (``score_dtype``), compiled in a fresh
    process (they call device functions)."""
    run = fresh_process(_CASCADE_LAUNCHES)
    assert run.returncode == 0, run.stderr[-3000:]


# The skinny GEMM calls a ``@triton.jit`` helper (its epilogue): compiled in a fresh process
# (``fresh_process``), every build in one, its facts printed as JSON. The fixed builds: the
# decode classes' tiles, split in K or not; then every tile the packaged tuning names
# (forkserve/kernels/skinny_tuning.json), as its launch builds it.
SKINNY_BUILDS = [  # (block_m, block_n, block_k, silu, warps, split_k, norm, residual); 4 stages
    (16, 16, 256, False, 4, 1, False, False), (64, 32, 128, False, 4, 1, False, False),
    (16, 16, 128, True, 4, 1, False, False), (64, 64, 128, True, 4, 1, False, False),
    (64, 128, 128, False, 8, 1, False, False), (64, 128, 128, False, 8, 4, False, False),
    (64, 64, 128, True, 4, 2, False, False), (64, 256, 128, False, 8, 8, False, False),
    # fold_norms: the norm in qkv's / gate_up's / the lm_head's tiles, the add in o's and down's
    (16, 64, 256, False, 4, 1, True, False), (64, 64, 128, True, 4, 1, True, False),
    (16, 32, 256, False, 4, 1, False, True), (64, 64, 128, False, 4, 2, False, True)]
_SKINNY = """
import json
from test_sm90_compile import SKINNY_BUILDS, compile_sm90
from forkserve.kernels.sm90_build import assemble_sm90a
from forkserve.kernels.skinny_gemm import SkinnyTuning, _skinny_kernel

def build(block_m, block_n, block_k, silu, warps, split_k, norm, residual, stages):
    ptx = compile_sm90(_skinny_kernel, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                            HAS_BIAS=False, SILU=silu, SPLIT_K=split_k,
                                            NORM=norm, RESIDUAL=residual),
                       warps, {"W": "*bf16", "Y": "*bf16", "Bias": "*bf16", "Partial": "*fp32",
                               "Arrived": "*i32", "Gamma": "*bf16", "Res": "*bf16",
                               "eps": "fp32"}, unaligned=frozenset(), num_stages=stages)
    return {"acq_rel": "atom.global.gpu.acq_rel.add" in ptx, "cp_async": "cp.async" in ptx,
            "spills": assemble_sm90a(ptx)}

packaged = {}
for device, tiles in SkinnyTuning.packaged().to_json().items():
    for key, tile in tiles.items():
        if tile is not None:
            block_n, block_k, warps, stages, *split = tile
            packaged[f"{device} {key} {tile}"] = build(
                int(key.split("/")[1][1:]), block_n, block_k, key.endswith("/silu"), warps,
                split[0] if split else 1, False, False, stages)
print(json.dumps({"fixed": [build(*b, stages=4) for b in SKINNY_BUILDS],
                  "packaged": packaged}))
"""


@pytest.fixture(scope="module")
def skinny_builds() -> dict:
    run = fresh_process(_SKINNY)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(SKINNY_BUILDS)),
                         ids=["-".join(map(str, b)) for b in SKINNY_BUILDS])
def test_skinny_gemm_compiles_pipelined(skinny_builds, index):
    """The skinny GEMM at the decode classes' tiles: the weight tiles loaded ahead
    (``cp.async``, 4 stages) and nothing spilled; split in K, the splits counted with an
    acquire-release atomic (and 256-row tiles summed 64 rows at a time: whole, 700 bytes
    spilled); with the folded norm (x's tiles scaled by gamma in the loop) and the residual
    add too."""
    build = skinny_builds["fixed"][index]
    assert build["acq_rel"] == (SKINNY_BUILDS[index][5] > 1)
    assert build["cp_async"] and build["spills"] == 0


def test_packaged_skinny_tiles_compile(skinny_builds):
    """Every tile the packaged tuning names builds for sm_90a as its launch would (block_m
    from the shape class, the tile's warps, stages and split), pipelined and without spills:
    a tuning edited by hand, or a kernel change, that breaks one fails here, not in a decode
    graph's capture on the GPU."""
    assert skinny_builds["packaged"], "the packaged tuning names no tile"
    for name, build in skinny_builds["packaged"].items():
        assert build["cp_async"] and build["spills"] == 0, name
