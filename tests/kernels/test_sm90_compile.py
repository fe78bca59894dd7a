"""The Triton kernels the interpreter runs on CPU, compiled for the H200 (sm_90) without a GPU.

The interpreter executes a kernel as numpy and skips the compiler's checks: a name typed
differently in the two branches of a runtime ``if`` ran under it and failed to compile on
the device (the FRESH route's rebuild, round 8). Compiling to PTX here catches that class of
error in CI. Pointers are bf16 (the serving dtype), integers i32."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from forkserve.kernels.glue import _rope_qk_kernel, _silu_mul_kernel, _write_kv_kernel  # noqa: E402
from forkserve.kernels.residual_rebuild import _rebuild_kernel  # noqa: E402

POINTERS = {"X", "Cos", "Sin", "Out", "K", "V", "KR", "VR", "BK", "BV", "OutK", "OutV",
            "KPool", "VPool"}


def compile_sm90(kernel, consts: dict, num_warps: int = 4) -> str:
    # Under TRITON_INTERPRET=1 (the kernel tests' setting) ``@triton.jit`` made an
    # interpreted function: compile its Python source as the device would.
    if not isinstance(kernel, JITFunction):
        kernel = JITFunction(kernel.fn)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else "*bf16" if n in POINTERS
           else "*i64" if n == "Slots" else "i32" for n in names}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps)).asm["ptx"]


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
