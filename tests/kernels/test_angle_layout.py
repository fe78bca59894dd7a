"""``angle_add``'s layout (residual_prefill_wide.py ``_rows3_layout``): the up-projection's
wgmma accumulator seen as ``[4 warps, 16 rows, C]``, so that its reshape to ``[64, C]`` is
that accumulator layout itself and the cos|sin it makes need no layout conversion.

Compiled for sm_90a without a GPU, in a process of its own (``fresh_process``: the kernel
tests' ``TRITON_INTERPRET=1`` would hand the compiler interpreted helpers). A conversion
between layouts that differ moves data, by warp shuffles (within a warp) or through shared
memory; between equal ones it is dropped. So a build that moves nothing shows the two
layouts are one, at every chunk width the rebuild takes."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

from test_sm90_compile import fresh_process  # noqa: E402


def build_probe(out: str, chunk: int, rows3: bool) -> None:
    """``out``/probe.ptx: ``In`` loaded in ``_rows3_layout`` at ``chunk`` columns (or, not
    ``rows3``, a blocked control with its warps on the same rows), reshaped to ``[64,
    chunk]``, converted to the accumulator layout and stored there. Loaded, not made from
    indices: the compiler folds a conversion of an index into the index itself."""
    import torch
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from forkserve.kernels.residual_decode_gluon import wgmma_layout
    from forkserve.kernels.residual_prefill_wide import _rows3_layout
    from forkserve.kernels.sm90_build import compile_gluon_sm90

    @gluon.jit
    def _probe(In, Out, C: gl.constexpr, ROWS3: gl.constexpr, num_warps: gl.constexpr):
        if ROWS3:
            l3: gl.constexpr = _rows3_layout(C)
        else:
            l3: gl.constexpr = gl.BlockedLayout([1, 1, C // 8], [1, 4, 8], [4, 1, 1],
                                                [2, 1, 0])
        w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        idx = (w[:, None, None] * 16 + r[None, :, None]) * C + c[None, None, :]
        u_l: gl.constexpr = wgmma_layout(C, 4)
        x = gl.convert_layout(gl.reshape(gl.load(In + idx), [64, C]), u_l)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, u_l))
        cols = gl.arange(0, C, layout=gl.SliceLayout(0, u_l))
        gl.store(Out + rows[:, None] * C + cols[None, :], x)

    ptrs = torch.empty(8, dtype=torch.bfloat16)
    ptx, _ = compile_gluon_sm90(_probe, {"In": ptrs, "Out": ptrs},
                                dict(C=chunk, ROWS3=rows3, num_warps=4), 128)
    (Path(out) / "probe.ptx").write_text(ptx)


def _build(chunk: int, rows3: bool, out: Path) -> str:
    run = fresh_process("from test_angle_layout import build_probe; "
                        f"build_probe({str(out)!r}, {chunk}, {rows3})")
    assert run.returncode == 0, run.stderr[-3000:]
    return (out / "probe.ptx").read_text()


@pytest.mark.parametrize("chunk", [8, 16, 32, 64])
def test_the_angle_layout_reshapes_to_the_accumulator(chunk: int, tmp_path) -> None:
    ptx = _build(chunk, True, tmp_path)
    assert "ld.global" in ptx and "st.global" in ptx
    assert not any(op in ptx for op in ("shfl", "st.shared", "ld.shared", "bar.sync"))


def test_a_layout_that_differs_moves_data(tmp_path) -> None:
    """The check's own control: the same build from a blocked layout (its warps on the
    same rows) converts by warp shuffles, so a wrong ``_rows3_layout`` would show."""
    assert "shfl" in _build(16, False, tmp_path)
