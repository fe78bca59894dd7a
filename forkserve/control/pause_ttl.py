"""PauseTTL: how long to keep a paused agent's base pages pinned, learned from its pauses.

An agent's tool call leaves its context idle for as long as the tool runs; the next turn
re-reads that context. A pin shorter than the pause wastes the recompute it was meant to
save, a longer one only costs memory that committed work can still reclaim (the pin yields
under pressure). So the TTL is a high quantile of the pauses actually observed, with slack.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Protocol


class PauseTTL(Protocol):
    def observe(self, pause_s: float) -> None:
        """One measured pause (seconds between a turn's end and the next turn's start)."""

    def ttl_s(self) -> float:
        """The pin's time to live for a pause starting now."""


class QuantilePauseTTL:
    """``slack`` x the ``quantile`` of the last ``window`` pauses (``prior_s`` before any),
    capped at ``max_s``. Global over sessions: agents of one workflow call the same tools."""

    def __init__(self, quantile: float = 0.9, prior_s: float = 30.0, *, window: int = 64,
                 slack: float = 1.25, max_s: float = 600.0) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window <= 0 or slack < 1.0 or prior_s < 0 or max_s < 0:
            raise ValueError(f"need window > 0, slack >= 1, prior_s >= 0, max_s >= 0; got "
                             f"{window}, {slack}, {prior_s}, {max_s}")
        self.quantile, self.prior_s, self.slack, self.max_s = quantile, prior_s, slack, max_s
        self._pauses: deque[float] = deque(maxlen=window)

    def observe(self, pause_s: float) -> None:
        if not pause_s >= 0.0:  # also rejects NaN
            raise ValueError(f"a pause lasts >= 0 seconds, got {pause_s}")
        self._pauses.append(pause_s)

    def ttl_s(self) -> float:
        if not self._pauses:
            return min(self.prior_s, self.max_s)
        ordered = sorted(self._pauses)
        q = ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]
        return min(self.slack * q, self.max_s)
