"""Elementwise fusions of the decoder's glue: residual add + RMSNorm, q/k RoPE, SiLU * up.

At batch 1 an 8B decode step is ~4 ms of weight reads plus ~700 small kernels; each
RMSNorm alone costs ~6 us there. On CUDA each group below is one kernel: the norms through
torch.compile (Inductor), RoPE and SiLU * up through the hand-written Triton kernels of
``forkserve.kernels.glue`` (Inductor's took 0.92 and 0.57 ms a layer of an 8K prefill, several
times their bandwidth bound). Elsewhere (CPU tests) the same functions run eagerly, so every
path computes the same function.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from forkserve.backend.torch.rope import apply_rope

if TYPE_CHECKING:
    from forkserve.kernels.skinny_gemm import SkinnyLinear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): the residual stream and the next sublayer's input."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int,
            head_dim: int) -> torch.Tensor:
    """RoPE over the q and k heads of a fused qkv row: [T, q_heads + kv_heads, head_dim]."""
    qk = qkv[:, :(q_heads + kv_heads) * head_dim].view(qkv.shape[0], q_heads + kv_heads, head_dim)
    return apply_rope(qk, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(h: torch.Tensor, gate_up: torch.Tensor, silu: Callable) -> torch.Tensor:
    """The MLP's activation ``silu(gate) * up`` of ``h @ gate_up.T`` (``[2I, K]``, gate first)."""
    return silu(F.linear(h, gate_up))


class Fusions:
    """The glue functions, fused (one kernel each) or plain: the one place that decides.

    ``compile``: the norms through torch.compile. ``triton``: RoPE and SiLU * up through the
    Triton kernels (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); None: the same
    as ``compile`` where CUDA is available. ``skinny``: the projections (``linear``, and
    ``gate_up_silu`` with SiLU * up in its epilogue) through the skinny GEMM where its tuning
    names the shape (``kernels/skinny_gemm.py``; elsewhere ``F.linear``): True for the
    packaged tuning, a ``SkinnyLinear`` for another (tests), None / False for ``F.linear``.
    Each attribute is fixed at construction, so a call does no dispatch work beyond the
    skinny GEMM's shape lookup and is safe in CUDA graph capture."""

    def __init__(self, compile: bool, triton: bool | None = None,
                 skinny: "bool | SkinnyLinear | None" = None) -> None:
        wrap: Callable = ((lambda f: torch.compile(f, dynamic=True, fullgraph=True)) if compile
                          else (lambda f: f))
        if triton is None:
            triton = compile and torch.cuda.is_available()
        self.compiled = compile
        self.triton = triton
        self.rms_norm = wrap(rms_norm)
        self.add_rms_norm = wrap(add_rms_norm)
        if triton:
            from forkserve.kernels.glue import rope_qk_triton, silu_mul_triton
            self.rope_qk: Callable = rope_qk_triton
            self.silu_mul: Callable = silu_mul_triton
        else:
            self.rope_qk = wrap(rope_qk)
            self.silu_mul = wrap(silu_mul)
        self.linear: Callable = F.linear
        self.gate_up_silu: Callable = lambda h, w: gate_up_silu(h, w, self.silu_mul)
        if skinny:
            from forkserve.kernels.skinny_gemm import SkinnyLinear, SkinnyTuning
            mm = skinny if isinstance(skinny, SkinnyLinear) else SkinnyLinear(
                SkinnyTuning.packaged())
            self.linear = mm
            self.gate_up_silu = lambda h, w: mm.gate_up_silu(h, w, self.silu_mul)


@functools.cache
def get_fusions(compile: bool, triton: bool | None = None, skinny: bool = False) -> Fusions:
    """One set per process: every backend shares the compiled kernels (and their compile time)."""
    return Fusions(compile, triton, skinny)
