"""The MockBackend's cost model: what a step would cost on a GPU, in modeled ms.

Fitted to every figure of seed 000's fan-out table (see docs/COST_MODEL.md):
``ms = prefill_call_ms * calls + prefill_token_ms * prefilled tokens
      + transfer_token_ms * transferred tokens`` (apc: 40 calls, 11520 tokens -> 139.0).
Decode is modeled as a memory-bound step: a fixed weight read plus a per-sequence KV read.
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

    def prefill_ms(self, calls: int, tokens: int) -> float:
        return self.prefill_call_ms * calls + self.prefill_token_ms * tokens

    def decode_ms(self, context_tokens: int) -> float:
        return self.decode_step_ms + self.decode_kv_token_ms * context_tokens

    def transfer_ms(self, tokens: int) -> float:
        return self.transfer_token_ms * tokens
