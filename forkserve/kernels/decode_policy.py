"""Which ResidualAttention decode variant a call without one runs (``kernels.residual_decode``).

A small strategy object, decided once per call from what the call's shapes are, so a CUDA
graph (one batch size) captures one variant. Measured on the H200 (docs/KERNELS.md "Round
20", ``kernel_bench_decode_round20_wsc.json``), residual / unified:

* the warp-specialized Gluon launch (``"ws"``): 1.03 / 1.06 / 1.18x at batch 1 (4K / 8K /
  32K keys), 1.17 / 1.26 / 1.37x at batch 8;
* two-pass: 1.31-1.35x at batch 1, 1.37-1.43x at batch 8, and at batch 32-64 the two tie
  (1.34-1.41x against 1.31-1.41x: with every SM busy, ws's one consumer warp group is the
  bound, where two-pass's score pass runs at tensor-core rates).

So "ws" up to ``ws_max_batch`` rows where its kernel takes the shapes, two-pass past it. The
batches between 8 and 32 are not measured; 16 is the midpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeVariantPolicy:
    ws_max_batch: int = 16

    def variant(self, q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor) -> str:
        from forkserve.kernels import residual_decode_gluon
        if q.shape[0] <= self.ws_max_batch and residual_decode_gluon.supports(q, k_base, k_res):
            return "ws"
        return "two_pass"


DEFAULT_DECODE_POLICY = DecodeVariantPolicy()
