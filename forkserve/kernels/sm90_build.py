"""Gluon kernels built for the H200 (sm_90a) on a machine without a GPU.

Gluon has no interpreter, so the ws kernels are checked on the CPU by what their sm_90a
build holds: the PTX (TMA copies, wgmma, the loader's register cut), the shared memory a
program takes, the bytes ptxas spills, and the SASS a tile's loop runs
(``benchmarks/ws_sass.py`` counts it: the consumer is issue-bound, so its time
follows that count, docs/KERNELS.md "Round 24"). The tools are Triton's own ptxas and
cuobjdump, so the build is the one the H200 machine makes up to its newer ptxas.

Build in a process without ``TRITON_INTERPRET``: under it every ``@jit`` helper Triton
imports (``gl.sum``'s combine function) is an interpreted one, which the compiler refuses.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch


class BuildError(RuntimeError):
    """ptxas or cuobjdump refused the PTX (the message is their stderr's tail)."""


# The shapes the ws kernels are built at: Llama-3-8B's attention (8 KV heads of 128, a GQA
# group of 4) and rank-16 residuals.
WS_SHAPE = dict(N_KV=8, G=4, R=16, HEAD_DIM=128)


def _ws_kernel_values(rank: int) -> dict:
    """The argument values the ws kernels (decode and prefill) share at ``WS_SHAPE`` with
    residuals of ``rank``: the loader's five TMA descriptors over bf16 pools, bf16 query / B
    / output pointers, int32 tables, float32 partials."""
    from forkserve.kernels import residual_decode_gluon as ws

    k = torch.empty(64, 16, WS_SHAPE["N_KV"], WS_SHAPE["HEAD_DIM"], dtype=torch.bfloat16)
    k_res = torch.empty(64, 16, rank, dtype=torch.bfloat16)
    table = torch.empty(4096, WS_SHAPE["HEAD_DIM"], dtype=torch.bfloat16)
    ptr, ints, floats = (torch.empty(8, dtype=t) for t in (torch.bfloat16, torch.int32,
                                                            torch.float32))
    values = dict(zip(("kd", "vd", "krd", "vrd", "csd"),
                      ws.descriptors(k, k, k_res, k_res, table), strict=True))
    return values | dict(Q=ptr, BK=ptr, BV=ptr, Adapter=ints, BlockTables=ints, ResTables=ints,
                         SeqLens=ints, Out=ptr, PartOut=floats, PartLse=floats,
                         scale_log2e=0.1)


def compile_gluon_sm90(kernel, values: dict, consts: dict, maxnreg: int,
                       aligned: tuple[str, ...] = ()) -> tuple[str, int]:
    """A Gluon kernel's PTX for sm_90a and its shared memory in bytes: ``values`` give the
    runtime arguments' types (tensors, descriptors, floats; any other argument is an i32),
    ``consts`` its constexprs (``num_warps`` among them); ``aligned``: arguments built as
    multiples of 16 (a pointer's bytes, an integer), as the launcher specializes them at run
    time where they are, so loads through them vectorize as on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else mangle_type(values[n]) if n in values else "i32"
           for n in names}
    src = GluonASTSource(fn=kernel, signature=sig,
                         constexprs={(names.index(n),): v for n, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    built = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=consts["num_warps"], maxnreg=maxnreg))
    return built.asm["ptx"], built.metadata.shared


def compile_ws_sm90(kernel, consts: dict, maxnreg: int, values: dict | None = None,
                    aligned: tuple[str, ...] = ()) -> tuple[str, int]:
    """A ws kernel's PTX for sm_90a and its shared memory at ``WS_SHAPE``: ``consts`` its
    other constexprs (``num_warps`` among them; ``G`` or ``R`` there replace the shape's),
    ``values`` its own runtime arguments beside the ones the ws kernels share, ``aligned``
    as ``compile_gluon_sm90``'s."""
    shape = WS_SHAPE | consts
    return compile_gluon_sm90(kernel, _ws_kernel_values(shape["R"]) | (values or {}), shape,
                              maxnreg, aligned)


def _tool(name: str) -> Path:
    """The CUDA tool ``name`` beside the ptxas Triton compiles with (its PTX version follows
    it: on the H200 machine a toolkit's, newer than the one in Triton's wheel), else Triton's
    wheel's own copy, else one on the PATH. ``BuildError`` where there is none: the H200
    machine's ptxas (torch's) has no cuobjdump beside it (round 27's suite)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = Path(get_ptxas(90).path)
    if name == "ptxas":
        return ptxas
    wheel = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = next((p for p in (ptxas.with_name(name), wheel) if p.is_file()), None)
    if found is None and (on_path := shutil.which(name)):
        found = Path(on_path)
    if found is None:
        raise BuildError(f"no {name} beside {ptxas}, in Triton's wheel or on the PATH")
    return found


def has_tool(name: str) -> bool:
    """Whether ``_tool`` finds ``name`` here (what a SASS count needs: ``cuobjdump``)."""
    try:
        _tool(name)
    except (ImportError, RuntimeError):  # BuildError among the latter
        return False
    return True


def ptxas_version() -> str:
    """The ptxas these builds use: the last line of its ``--version`` (its build)."""
    run = subprocess.run([str(_tool("ptxas")), "--version"], capture_output=True, text=True,
                         timeout=60)
    return run.stdout.strip().splitlines()[-1] if run.returncode == 0 else "unknown"


def _assemble(ptx: str, folder: Path) -> tuple[Path, str]:
    src, cubin = folder / "k.ptx", folder / "k.cubin"
    src.write_text(ptx)
    run = subprocess.run([str(_tool("ptxas")), "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                         capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise BuildError(run.stderr[-2000:])
    return cubin, run.stderr


def assemble_sm90a(ptx: str) -> int:
    """Assemble ``ptx`` for sm_90a (no GPU needed): inline asm is opaque to the compiler, so
    its syntax shows only here (score_progress.py's polls and publishes). Returns the bytes
    ptxas spills to local memory."""
    with tempfile.TemporaryDirectory() as tmp:
        _, log = _assemble(ptx, Path(tmp))
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))


def sass_sm90a(ptx: str) -> str:
    """The SASS ptxas makes of ``ptx`` for sm_90a, as cuobjdump prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin, _ = _assemble(ptx, Path(tmp))
        run = subprocess.run([str(_tool("cuobjdump")), "-sass", str(cubin)],
                             capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise BuildError(run.stderr[-2000:])
    return run.stdout
