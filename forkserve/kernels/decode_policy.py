"""Which ResidualAttention decode variant a call without one runs (``kernels.residual_decode``).

A small strategy object, decided once per call from what the call's shapes are, so a CUDA
graph (one batch size) captures one variant. Measured on the H200 (docs/KERNELS.md "Round
21", ``kernel_bench_decode_round21_default.json``), residual / unified at 4K / 8K / 32K keys:

* the warp-specialized Gluon launch (``"ws"``): 0.97 / 1.01 / 1.08x at batch 1, 1.07-1.14x
  at batch 8-64;
* two-pass: 1.32-1.34x at batch 1, 1.33-1.43x at batch 8-64.

So "ws" at every batch where its kernel takes the shapes (``residual_decode_gluon.supports``),
two-pass elsewhere. ``ws_max_batch`` bounds it for experiments (round 20's one-by-one
products lost to two-pass past 16 rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeVariantPolicy:
    ws_max_batch: int | None = None

    def variant(self, q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor) -> str:
        from forkserve.kernels import residual_decode_gluon
        if ((self.ws_max_batch is None or q.shape[0] <= self.ws_max_batch)
                and residual_decode_gluon.supports(q, k_base, k_res)):
            return "ws"
        return "two_pass"


DEFAULT_DECODE_POLICY = DecodeVariantPolicy()
