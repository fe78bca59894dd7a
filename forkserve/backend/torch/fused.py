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
from typing import TYPE_CHECKING, Callable, NamedTuple

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


class Normed(NamedTuple):
    """``rms_norm(x, weight, eps)``, not computed yet: the input of the projection that reads
    it, which may fold the norm into its GEMM (``Fusions.norm_linear``); ``value`` where a
    reader needs the rows themselves. Valid while ``x`` is (one forward)."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float


class Fusions:
    """The glue functions, fused (one kernel each) or plain: the one place that decides.

    ``compile``: the norms through torch.compile. ``triton``: RoPE and SiLU * up through the
    Triton kernels (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); None: the same
    as ``compile`` where CUDA is available. ``skinny``: the projections (``linear``, and
    ``gate_up_silu`` with SiLU * up in its epilogue) through the skinny GEMM where its tuning
    names the shape (``kernels/skinny_gemm.py``; elsewhere ``F.linear``): True for the
    packaged tuning, a ``SkinnyLinear`` for another (tests), None / False for ``F.linear``.
    ``fold_norms`` (with ``skinny``): a forward that ``folds`` runs each RMSNorm inside the
    skinny GEMM that reads it and the residual adds in the epilogues of o and down, so its
    norm kernels go (``norm_linear``, ``norm_gate_up_silu``, ``linear_add``; where the
    tuning has no tile for the call (``SkinnyLinear.plan``'s ``fold``) it runs the norm or
    the add beside ``linear``).
    Each attribute is fixed at construction, so a call does no dispatch work beyond the
    skinny GEMM's shape lookup and is safe in CUDA graph capture."""

    def __init__(self, compile: bool, triton: bool | None = None,
                 skinny: "bool | SkinnyLinear | None" = None, fold_norms: bool = False) -> None:
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
        self._mm: SkinnyLinear | None = None
        if skinny:
            from forkserve.kernels.skinny_gemm import SkinnyLinear, SkinnyTuning
            mm = skinny if isinstance(skinny, SkinnyLinear) else SkinnyLinear(
                SkinnyTuning.packaged())
            self.linear = mm
            self.gate_up_silu = lambda h, w: mm.gate_up_silu(h, w, self.silu_mul)
            self._mm = mm if fold_norms else None

    def folds(self, rows: int, lora: bool) -> bool:
        """Whether a forward of ``rows`` rows folds its norms and residual adds: with
        ``fold_norms``, no LoRA (whose shrink reads the normed rows themselves) and rows the
        skinny GEMM takes."""
        from forkserve.kernels.skinny_gemm import MAX_ROWS
        return self._mm is not None and not lora and 0 < rows <= MAX_ROWS

    def value(self, h: Normed) -> torch.Tensor:
        return self.rms_norm(h.x, h.weight, h.eps)

    def norm_linear(self, h: Normed, w: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        """``linear(rms_norm(h), w, bias)``, the norm inside the GEMM where a one-split tile
        names the shape."""
        tile = self._mm.plan(h.x, w, fold="norm") if self._mm is not None else None
        if tile is None:
            return self.linear(self.value(h), w, bias)
        from forkserve.kernels.skinny_gemm import skinny_mm
        return skinny_mm(h.x, w, tile, bias, norm=(h.weight, h.eps))

    def norm_gate_up_silu(self, h: Normed, w: torch.Tensor) -> torch.Tensor:
        """``gate_up_silu(rms_norm(h), w)``, the norm inside the GEMM as ``norm_linear``."""
        tile = self._mm.plan(h.x, w, silu=True, fold="norm") if self._mm is not None else None
        if tile is None:
            return self.gate_up_silu(self.value(h), w)
        from forkserve.kernels.skinny_gemm import skinny_mm
        return skinny_mm(h.x, w, tile, silu=True, norm=(h.weight, h.eps))

    def linear_add(self, a: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``r + linear(a, w)`` (the residual stream's add), in the GEMM's epilogue where a
        tile names the shape."""
        tile = self._mm.plan(a, w, fold="add") if self._mm is not None else None
        if tile is None:
            return r + self.linear(a, w)
        from forkserve.kernels.skinny_gemm import skinny_mm
        return skinny_mm(a, w, tile, residual=r)


@functools.cache
def get_fusions(compile: bool, triton: bool | None = None, skinny: bool = False,
                fold_norms: bool = False) -> Fusions:
    """One set per process: every backend shares the compiled kernels (and their compile time)."""
    return Fusions(compile, triton, skinny, fold_norms)
