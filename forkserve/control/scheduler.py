"""Two-class tick scheduler (seed 000, section 3).

Each tick fills committed work first — decode steps (up to C = floor(H / M_spine) of
them, M_spine the memory a live session actually holds: pages shared across sessions count
once, so agents over one shared context are not capped as if each held a copy), then commit tails
and root prefills — and gives speculative chunks only what is left of the token budget and of
memory. A speculative chunk is C_spec tokens (or the residual's rest), granted whole or not at all,
so speculation stops at chunk boundaries; under saturation the speculative share is zero.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from forkserve.config import ForkServeConfig


class WorkClass(str, enum.Enum):
    COMMITTED = "committed"
    SPECULATIVE = "speculative"


@dataclass(frozen=True)
class Demand:
    node_id: int
    tokens: int          # tokens still to write for this node
    decode: bool         # a decode step (the pending token was sampled) vs prefill
    work_class: WorkClass
    priority: float = 1.0


@dataclass(frozen=True)
class Grant:
    node_id: int
    tokens: int
    decode: bool
    work_class: WorkClass


class TickScheduler:
    def __init__(self, config: ForkServeConfig) -> None:
        self.config = config

    def decode_slots(self, sessions: int, held_tokens: int) -> int:
        """C = floor(H / M_spine), with M_spine = held_tokens / sessions: the pool's used
        tokens over the live sessions (shared pages are counted once by the pool)."""
        if sessions == 0:
            return 0
        m_spine = max(1, held_tokens // sessions)
        return max(1, self.config.hbm_tokens // m_spine)

    def plan(self, committed: Sequence[Demand], speculative: Sequence[Demand],
             decode_slots: int, spec_memory_tokens: int, granted: int = 0) -> list[Grant]:
        """``granted``: one-token decode steps already granted outside the demands (the
        engine's steady-decode set); they took their share of budget and memory first."""
        budget = self.config.max_batch_tokens - granted
        spec_memory_tokens -= granted
        grants: list[Grant] = []
        decodes = [d for d in committed if d.decode][:decode_slots]
        for d in decodes:
            if budget < d.tokens:
                break
            grants.append(Grant(d.node_id, d.tokens, True, WorkClass.COMMITTED))
            budget -= d.tokens
        for d in committed:
            if d.decode or budget <= 0:
                continue
            n = min(d.tokens, budget)  # committed prefill may be chunked anywhere
            grants.append(Grant(d.node_id, n, False, WorkClass.COMMITTED))
            budget -= n
        # Speculation gets the memory committed work leaves, not the memory it is about to take.
        spec_memory_tokens -= sum(g.tokens for g in grants)
        # Known suffixes first, then by the harness prior; stable for equal priorities.
        for d in sorted(speculative, key=lambda d: -d.priority):
            chunk = 1 if d.decode else min(d.tokens, self.config.spec_chunk)
            if chunk > budget or chunk > spec_memory_tokens:
                continue
            grants.append(Grant(d.node_id, chunk, d.decode, WorkClass.SPECULATIVE))
            budget -= chunk
            spec_memory_tokens -= chunk
        return grants
