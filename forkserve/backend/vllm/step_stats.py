"""VllmStats: what vLLM actually did, beside what the control plane asked for."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class VllmStats:
    steps: int = 0
    phases: int = 0
    requests: int = 0
    # Tokens of every submitted prompt, and how many of them vLLM's prefix cache supplied.
    # submitted - cached is what vLLM computed; the Engine's prefill_tokens is what it asked.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pins_taken: int = 0
    pins_released: int = 0
    # Decode-ahead: items served from the lookahead (no request), lookahead tokens discarded.
    ahead_served: int = 0
    ahead_dropped: int = 0

    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self) -> dict:
        return {**asdict(self), "computed_tokens": self.computed_tokens()}
