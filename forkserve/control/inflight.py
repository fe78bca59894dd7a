"""In-flight prefix deduplication: a committed prefill does not compute the full pages an
older session's committed prefill, still in flight, is writing under a key it may read. It
waits (its demand is held back, or cut short before those pages, this tick: neither failed
nor counted as work short of pages) until they are published, then matches them as an
ordinary prefix hit and prefills only the rest. vLLM and SGLang behave the same way.

Who leads: every committed prefill of a tick is a ``Writer``. Writers are taken oldest
session first; each claims the pages it still has to write up to the first page whose key
an older writer claimed, and stops there. The oldest never waits, so a tick always has work
and no two writers wait on each other.

Lifetime: claims live for one tick — ``admit`` rebuilds them from that tick's writers. A
leader that publishes, fails, is aborted, closed or preempted is simply not a writer of the
next tick: its waiters match what it published and, where it published nothing, the oldest
of them leads. There is nothing to release, so nothing can leak. Kept across ticks: which
nodes were held (``waiting``: the Stepper re-matches them before their next demand) and a
cache of page hashes per writer node, pruned to each tick's writers. A writer's hashes start
at the published prefix its table matched (its publish cursor's ``ChainSeed``): only a
writer's own pages are hashed, not the shared context before them, once per session.

A claim is a page's chained hash (``control/page_hash.py``) under a stream: the tree,
namespace and salt ``KVCache.page_claims`` derives as ``KVCache.keys`` does (so a reader
waits only for a leader whose pages it may read), as the number ``ClaimStreams`` gives them.
A hash collision can only make a writer wait for pages it then does not find and computes
itself: what a writer reads always comes from ``KVCache.match``, never from a claim.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

from forkserve.backend.protocol import PageKind
from forkserve.config import ForkServeConfig, PrefixDedup
from forkserve.control.metrics import EngineMetrics
from forkserve.control.page_hash import ChainSeed, PageChain
from forkserve.control.prefix_index import CacheSalt, Namespace
from forkserve.control.scheduler import Demand

# What a tick's writers claimed: per stream (the number ``ClaimStreams`` gives a side's tree,
# namespace and salt), the chained hashes of the full pages claimed under it. Plain ints in
# C sets, tested and added a run of pages at a time: a key object per page (a tree, a
# namespace dataclass and a salt, hashed per page) cost ~8 ms per writer under memory
# pressure, and an int key made per page per writer per tick still cost most of a prefill
# tick with a hundred agents of distinct adapters (streams no other writer claims under).
Claims = dict[int, set[int]]


class ClaimStreams:
    """Numbers each (tree, namespace, salt) claims are made under, for one tick's writers
    (claims live one tick: a fresh numbering each ``admit`` keeps no namespace or salt of a
    writer that has gone): equal triples get equal numbers, so keys compare as the triples."""

    def __init__(self) -> None:
        self._ids: dict[tuple[PageKind, Namespace, CacheSalt], int] = {}

    def __call__(self, tree: PageKind, namespace: Namespace, salt: CacheSalt) -> int:
        return self._ids.setdefault((tree, namespace, salt), len(self._ids))


class ClaimRun(NamedTuple):
    """Consecutive pages of a writer that need the same sides under the same streams: their
    hashes, the streams of the sides it still has to write there, and the streams whose
    publication would give it those sides (``writes`` and any it may also read)."""

    hashes: Sequence[int]
    writes: tuple[int, ...]
    reads: tuple[int, ...]


@dataclass(frozen=True)
class Writer:
    """One committed prefill of a tick, as the deduplication sees it."""

    node_id: int
    rank: int            # the session id: older sessions lead
    start: int           # the first position it writes (its table's length)
    first_page: int      # the first page of ``runs``
    # Its full pages from ``first_page`` on, in runs (``KVCache.page_claims``).
    runs: tuple[ClaimRun, ...]
    # False: it never waits (it wants every position computed: prompt log-probabilities, a
    # commit's atomic tail).
    follows: bool = True

    @property
    def pages(self) -> int:
        return sum(len(run.hashes) for run in self.runs)

    def first_claimed(self, claimed: Claims) -> int:
        """The first of its pages (from ``first_page``) another writer serves it; ``pages``
        if none."""
        if not self.follows or not claimed:
            return self.pages
        i = 0
        for run in self.runs:
            taken = [claimed[s] for s in run.reads if s in claimed]
            if any(not t.isdisjoint(run.hashes) for t in taken):
                return i + next(j for j, page in enumerate(run.hashes)
                                if any(page in t for t in taken))
            i += len(run.hashes)
        return i

    def claim(self, pages: int, claimed: Claims) -> None:
        """Claim the sides it writes on its first ``pages`` pages."""
        for run in self.runs:
            if pages <= 0:
                return
            hashes = run.hashes[:pages]
            for s in run.writes:
                claimed.setdefault(s, set()).update(hashes)
            pages -= len(hashes)


# ``(node_id, path, seed)`` -> the path's ``PageChain`` from at most ``seed.pages`` on
# (``seed``: a prefix of the path whose chain end is known), cached per node by the policy.
ChainOf = Callable[[int, Sequence[int], ChainSeed], PageChain]
# A prefill demand as its ``Writer``, its pages hashed by ``ChainOf`` and its claims numbered
# by the tick's ``ClaimStreams``.
Describe = Callable[[Demand, ChainOf, ClaimStreams], Writer]


class PrefixDedupPolicy(Protocol):
    """What the Stepper asks each tick (``dedup_for`` chooses the strategy)."""

    waiting: frozenset[int]  # nodes held or cut short last tick: re-match before their demand

    def admit(self, demands: Sequence[Demand], describe: Describe) -> list[Demand]:
        """The committed demands to schedule: a follower's held back or cut short.
        ``describe`` turns a prefill demand into its ``Writer``."""


class NoDedup:
    """Every prefill computes its own copy until a page is published (the seed's arithmetic)."""

    waiting: frozenset[int] = frozenset()

    def admit(self, demands: Sequence[Demand], describe: Describe) -> list[Demand]:
        return list(demands)


class InflightDedup:
    def __init__(self, page_size: int, metrics: EngineMetrics) -> None:
        self.page_size, self.metrics = page_size, metrics
        self.waiting: frozenset[int] = frozenset()
        self._chains: dict[int, PageChain] = {}

    def chain(self, node_id: int, path: Sequence[int], seed: ChainSeed) -> PageChain:
        # A node's path only grows (committed tokens are never rewritten), so a cached chain
        # stays a valid prefix of the new one; it is extended unless it starts past ``seed``
        # (its table was cut below its first page) or the seed reaches further than it does.
        known = self._chains.get(node_id)
        if known is None or not known.first <= seed.pages <= known.end:
            known = PageChain.at(seed)
        chain = self._chains[node_id] = known.extend(path, self.page_size)
        return chain

    def admit(self, demands: Sequence[Demand], describe: Describe) -> list[Demand]:
        streams = ClaimStreams()
        writers = sorted((describe(d, self.chain, streams) for d in demands if not d.decode),
                         key=lambda w: w.rank)
        live = {w.node_id for w in writers}
        self._chains = {n: c for n, c in self._chains.items() if n in live}  # the rest are gone
        claimed: Claims = {}
        allowed: dict[int, int] = {}  # node -> tokens it may write before a claimed page
        for w in writers:
            stop = w.first_claimed(claimed)
            w.claim(stop, claimed)
            if stop < w.pages:
                allowed[w.node_id] = (w.first_page + stop) * self.page_size - w.start
        self.waiting = frozenset(allowed)
        out = []
        for d in demands:
            n = allowed.get(d.node_id)
            if n is None:
                out.append(d)
            elif n > 0:
                out.append(dataclasses.replace(d, tokens=min(d.tokens, n)))
            else:
                self.metrics.dedup_held += 1
        return out


def dedup_for(config: ForkServeConfig, metrics: EngineMetrics) -> PrefixDedupPolicy:
    if config.prefix_dedup is PrefixDedup.IN_FLIGHT:
        return InflightDedup(config.page_size, metrics)
    return NoDedup()
