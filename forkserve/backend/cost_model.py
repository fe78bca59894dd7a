"""The MockBackend's cost model: what a step would cost on a GPU, in modeled ms.

Fitted to every figure of seed 000's fan-out table (see docs/COST_MODEL.md):
``ms = prefill_call_ms * calls + prefill_token_ms * prefilled tokens
      + transfer_token_ms * transferred tokens`` (apc: 40 calls, 11520 tokens -> 139.0).
Decode is modeled as a memory-bound step: a fixed weight read plus a per-sequence KV read.

The split form (base + rank-r residual) is priced apart only where ``residual_token_ms`` is
set (the defaults price it as merged K/V): its prefill costs ``split_prefill_factor`` times a
merged token's, and a decode step reads each split row's residual per token plus each
distinct base page once (cascade attention reads a base prefix shared across the batch once).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prefill_call_ms: float = 0.021
    prefill_token_ms: float = 0.012
    transfer_token_ms: float = 0.002
    decode_step_ms: float = 0.5        # reading the weights once per batched step
    decode_kv_token_ms: float = 1e-5   # reading one cached token's K/V
    split_prefill_factor: float = 1.0
    residual_token_ms: float | None = None  # a split row's read per context token

    def prefill_ms(self, calls: int, tokens: int, split_tokens: int = 0) -> float:
        """``split_tokens``: of ``tokens``, those prefilled in the split form."""
        extra = (self.split_prefill_factor - 1.0) * split_tokens if self.residual_token_ms \
            is not None else 0.0
        return self.prefill_call_ms * calls + self.prefill_token_ms * (tokens + extra)

    def decode_ms(self, context_tokens: int, split_tokens: int = 0,
                  split_base_tokens: int = 0) -> float:
        """``context_tokens``: merged rows' context; ``split_tokens``: split rows' context;
        ``split_base_tokens``: the distinct base tokens the split rows read."""
        if self.residual_token_ms is None:
            return self.decode_step_ms + self.decode_kv_token_ms * (context_tokens + split_tokens)
        return (self.decode_step_ms + self.decode_kv_token_ms * (context_tokens
                                                                 + split_base_tokens)
                + self.residual_token_ms * split_tokens)

    def transfer_ms(self, tokens: int) -> float:
        return self.transfer_token_ms * tokens
