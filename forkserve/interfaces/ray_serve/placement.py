"""Where a new tree goes: the placement strategy ``TreeAffinityRouter`` scores ``open`` with.

A replica's score, in KV pages:

    prefix_page_weight · matched prefix pages      (prefill it would not redo)
  + residual_weight · log2(1 + adapter's residual pages)
  − queue_weight · queued requests                 (Serve's per-replica cache)
  − load_weight · load pages

and ``load pages`` = KV pages sessions hold (not the cache) + ``rate_horizon_s`` seconds of
the replica's recent token rate (prefill + decode) + pages this router sent it that its
summary cannot show yet.
The load term is what spreads trees: a prefix that matches everywhere only a little (a chat
template's system prompt) no longer pulls every client to the replica that saw it first,
while a long shared context still outweighs the load it adds (its pages count once).

The published view lags by one stats period, and a burst of opens (lockstep agents) comes
well within it; ``RecentRoutes`` is the router's own record of what it just sent where:
the page hashes (they will be published once prefilled), the pages the prefill adds, and
the adapter's residual pages (a closed tree's pages stay, as published cache, but stop
counting as load). Entries live ``ttl_s`` (two default periods), so for a while
a replica's own summary and this record may count the same pages: the error is a slightly
higher load for the replica that just got work, which is the safe side.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from forkserve.interfaces.ray_serve.protocol import RouteHint
from forkserve.interfaces.ray_serve.stats import ReplicaSummary, matched_pages


@dataclass(frozen=True)
class _Route:
    at: float
    tree_id: int
    hashes: frozenset[int]
    new_pages: int                 # 0 once the tree closed: its pages are cache, not load
    adapter: str | None
    residual_pages: int            # the adapter's pages the prompt leaves resident


class RecentRoutes:
    """The opens one router sent to one replica in the last ``ttl_s`` seconds (router's
    event loop only)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._clock = ttl_s, clock
        self._routes: deque[_Route] = deque()

    def add(self, hint: RouteHint, new_pages: int) -> None:
        hashes = frozenset(hint.base_hashes) | frozenset(hint.adapter_hashes)
        pages = max(len(hint.base_hashes), len(hint.adapter_hashes))
        self._routes.append(_Route(self._clock(), hint.tree_id, hashes, new_pages, hint.adapter,
                                   pages))

    def has(self, tree_id: int) -> bool:
        return any(r.tree_id == tree_id for r in self._live())

    def remove(self, tree_id: int) -> None:
        self._routes = deque(r for r in self._live() if r.tree_id != tree_id)

    def closed(self, tree_id: int) -> None:
        """The tree's pages stay published but no longer load the replica."""
        self._routes = deque(replace(r, new_pages=0) if r.tree_id == tree_id else r
                             for r in self._live())

    def _live(self) -> deque[_Route]:
        horizon = self._clock() - self._ttl
        while self._routes and self._routes[0].at < horizon:
            self._routes.popleft()
        return self._routes

    def hashes(self) -> frozenset[int]:
        return frozenset().union(*(r.hashes for r in self._live()))

    def new_pages(self) -> int:
        return sum(r.new_pages for r in self._live())

    def adapter_pages(self, adapter: str) -> int:
        return sum(r.residual_pages for r in self._live() if r.adapter == adapter)


@dataclass(frozen=True)
class ReplicaState:
    """What placement knows of one replica when a tree is placed."""

    summary: ReplicaSummary     # published by the replica, up to one stats period old
    recent: RecentRoutes        # sent by this router, not yet in the summary
    queue: int                  # Serve's cached queue length


@dataclass(frozen=True)
class AffinityPlacement:
    """Weights: per matched prefix page; per doubling of the adapter's resident residual
    pages (log: a few warm pages already say the adapter lives here, and must not outweigh
    real base-page hits); per queued request (about one request's delay); per page of load.
    ``load_weight`` < 1 keeps a context's own pages from pushing its next agent away (it
    matches all of them and they load the replica once); 0 is prefix affinity alone."""

    prefix_page_weight: float = 1.0
    residual_weight: float = 1.0
    queue_weight: float = 2.0
    load_weight: float = 0.5
    rate_horizon_s: float = 1.0

    def matched(self, state: ReplicaState, hint: RouteHint) -> int:
        published = state.summary.prefix_pages | state.recent.hashes()
        return max(matched_pages(hint.base_hashes, published),
                   matched_pages(hint.adapter_hashes, published))

    def residual_pages(self, state: ReplicaState, hint: RouteHint) -> int:
        if hint.adapter is None:
            return 0
        published = state.summary.residual_pages.get(hint.adapter, 0)
        return published + state.recent.adapter_pages(hint.adapter)

    def load_pages(self, state: ReplicaState) -> float:
        s = state.summary
        rate_pages = self.rate_horizon_s * s.token_rate / max(1, s.page_size)
        return s.live_pages + rate_pages + state.recent.new_pages()

    def score(self, state: ReplicaState, hint: RouteHint) -> float:
        return (self.prefix_page_weight * self.matched(state, hint)
                + self.residual_weight * math.log2(1 + self.residual_pages(state, hint))
                - self.queue_weight * state.queue
                - self.load_weight * self.load_pages(state))
