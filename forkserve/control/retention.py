"""BaseRetention: base pages pinned through a tool pause, so the next turn hits them.

A closed session's published pages live on in the prefix index only, where LRU eviction
would take them under pressure while the agent waits for its tool. ``pin`` holds them for
the TTL a ``PauseTTL`` predicts; the next ``open`` that reuses the whole pinned prefix
``resume``s the pin (the pause it measured trains the policy). Residual pages are never
pinned: they are cheap to park on the host tier and to bring back (``HostTier``).

Ownership: a pin is a ``PageTable`` over the index's own pages for the session's published
path (not the session's table: where the index already held a page for a prefix, the
session's copy is private and about to be freed): one pool reference per page. It is released on
resume, on expiry (the stepper's TTL pass), by ``release_for`` under committed pressure
(soonest deadline first, after speculation was preempted), or by ``release_all``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from forkserve.backend.protocol import PageId
from forkserve.control.metrics import EngineMetrics
from forkserve.control.page_pool import PagePool
from forkserve.control.page_table import PageTable
from forkserve.control.pause_ttl import PauseTTL


@dataclass(frozen=True)
class BasePin:
    table: PageTable  # owned: one reference per pinned page
    since: float      # when the pause began
    until: float      # since + the TTL predicted then


class BaseRetention:
    def __init__(self, policy: PauseTTL, metrics: EngineMetrics) -> None:
        self.policy, self.metrics = policy, metrics
        self._pins: list[BasePin] = []

    def pin(self, pool: PagePool, pages: Sequence[PageId], now: float) -> None:
        """Pin ``pages`` (published, of ``pool``) for the TTL the policy predicts now."""
        if not pages:
            return
        held = PageTable(pool)
        held.attach(pages, len(pages) * pool.page_size)
        self._pins.append(BasePin(held, now, now + self.policy.ttl_s()))

    def resume(self, pages: Sequence[PageId], now: float) -> None:
        """A new session aliases ``pages``: pins whose whole prefix it reuses measured a pause."""
        for pin in [p for p in self._pins if p.table.pages == list(pages[:len(p.table.pages)])]:
            self.policy.observe(now - pin.since)
            self._release(pin)
            self.metrics.pins_resumed += 1

    def expire(self, now: float) -> None:
        for pin in [p for p in self._pins if p.until <= now]:
            self._release(pin)
            self.metrics.pins_expired += 1

    def release_for(self, pool: PagePool, need: int, evict: Callable[[int], int]) -> None:
        """Committed work is short of pages: give pins up, soonest deadline first, evicting
        what each one frees, until ``need`` pages are free."""
        for pin in sorted((p for p in self._pins if p.table.pool is pool), key=lambda p: p.until):
            if pool.num_free >= need:
                return
            self._release(pin)
            self.metrics.pins_broken += 1
            evict(need - pool.num_free)

    def release_all(self) -> None:
        for pin in list(self._pins):
            self._release(pin)

    def tables(self) -> list[PageTable]:
        return [p.table for p in self._pins]

    def _release(self, pin: BasePin) -> None:
        pin.table.release()
        self._pins.remove(pin)
