"""Which ResidualAttention decode variant a call without one runs (``kernels.residual_decode``).

A small strategy object, decided once per call from what the call's shapes are, so a CUDA
graph (one batch size) captures one variant. Measured on the H200 (docs/KERNELS.md "Round
21", ``kernel_bench_decode_round21_default.json``), residual / unified at 4K / 8K / 32K keys:

* the warp-specialized Gluon launch (``"ws"``): 0.97 / 1.01 / 1.08x at batch 1, 1.07-1.14x
  at batch 8-64;
* two-pass: 1.32-1.34x at batch 1, 1.33-1.43x at batch 8-64.

So "ws" at every batch where its kernel takes the shapes and they are among ``ws_shapes``
(``residual_decode_gluon.ws_shape``'s ``(GQA group, rank)``; by default the ones measured,
``MEASURED_WS_SHAPES``: the kernel builds for more, which stay on two-pass until a run on the
GPU measures them), two-pass elsewhere. ``ws_max_batch`` bounds it for experiments (round
20's one-by-one products lost to two-pass past 16 rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The ``(GQA group, rank)`` pairs of the ws kernel measured on the H200 against two-pass
# (docs/KERNELS.md, rounds 20-26: Llama-3-8B's group and rank-16 pools; round 27: GQA 8 and
# rank 32 at GQA 4, 1.03-1.19x unified where two-pass took 1.39-2.17x; round 28: the other
# groups, padded to 4 or 8 query columns, 0.94-1.18x at rank 16 and 1.04-1.20x at rank 32
# where two-pass took 1.25-2.15x, kernel_bench_decode_round28_*.json; each at 4K and 32K x
# 1-64): every shape the kernel builds for (``residual_decode_gluon.builds_for``). A shape
# it comes to build for joins this set once a run measures it.
MEASURED_WS_SHAPES = frozenset({*((g, 16) for g in range(1, 9)),
                                *((g, 32) for g in range(1, 5))})


@dataclass(frozen=True)
class DecodeVariantPolicy:
    ws_max_batch: int | None = None
    ws_shapes: frozenset[tuple[int, int]] = MEASURED_WS_SHAPES

    def variant(self, q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor) -> str:
        from forkserve.kernels import residual_decode_gluon
        if ((self.ws_max_batch is None or q.shape[0] <= self.ws_max_batch)
                and residual_decode_gluon.ws_shape(q, k_base, k_res) in self.ws_shapes):
            return "ws"
        return "two_pass"


DEFAULT_DECODE_POLICY = DecodeVariantPolicy()
