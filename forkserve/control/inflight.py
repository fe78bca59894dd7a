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

A claim is a ``ClaimKey``: the tree, namespace and salt ``KVCache.page_claims`` derives as
``KVCache.keys`` does (so a reader waits only for a leader whose pages it may read), as the
number ``ClaimStreams`` gives them, and a chained hash of the page's tokens and all tokens
before it (``control/page_hash.py``). A hash collision can only make a writer wait for
pages it then does not find and computes itself: what a writer reads always comes from
``KVCache.match``, never from a claim.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from forkserve.backend.protocol import PageKind
from forkserve.config import ForkServeConfig, PrefixDedup
from forkserve.control.metrics import EngineMetrics
from forkserve.control.page_hash import ChainSeed, PageChain
from forkserve.control.prefix_index import CacheSalt, Namespace
from forkserve.control.scheduler import Demand

# One side of one full page, as the prefix trees would publish it: the chained hash of
# the page's tokens and every token before them, times ``STREAMS``, plus the number
# ``ClaimStreams`` gives the side's tree, namespace and salt. One int: a writer claims each
# page it still has to write every tick (hundreds over an 8K prompt), and a key object per
# page (a tree, a namespace dataclass and a salt, hashed per page) cost ~8 ms per such writer
# under memory pressure, most of it the garbage collections those objects set off.
ClaimKey = int
STREAMS = 1 << 32  # more streams than a tick's writers can name


class ClaimStreams:
    """Numbers each (tree, namespace, salt) claims are made under, for one tick's writers
    (claims live one tick: a fresh numbering each ``admit`` keeps no namespace or salt of a
    writer that has gone): equal triples get equal numbers, so keys compare as the triples."""

    def __init__(self) -> None:
        self._ids: dict[tuple[PageKind, Namespace, CacheSalt], int] = {}

    def __call__(self, tree: PageKind, namespace: Namespace, salt: CacheSalt) -> int:
        return self._ids.setdefault((tree, namespace, salt), len(self._ids))

    def key(self, stream: int, page: int) -> ClaimKey:
        """The claim of ``stream``'s side of the page whose chained hash is ``page``."""
        return page * STREAMS + stream


@dataclass(frozen=True)
class Writer:
    """One committed prefill of a tick, as the deduplication sees it."""

    node_id: int
    rank: int            # the session id: older sessions lead
    start: int           # the first position it writes (its table's length)
    first_page: int      # the page ``writes[0]`` describes
    # Per full page from ``first_page``: the keys of the sides it still has to write there.
    writes: tuple[frozenset[ClaimKey], ...]
    # Per page: the keys whose publication would give it those sides; None: it never waits
    # (it wants every position computed: prompt log-probabilities, a commit's atomic tail).
    reads: tuple[frozenset[ClaimKey], ...] | None


# ``(node_id, path, seed) -> `` the path's ``PageChain`` from at most ``seed.pages`` on (``seed``:
# a prefix of the path whose chain end is known), cached per node by the policy.
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
        claimed: set[ClaimKey] = set()
        allowed: dict[int, int] = {}  # node -> tokens it may write before a claimed page
        for w in writers:
            stop = _first_claimed(w, claimed)
            for keys in w.writes[:stop]:
                claimed |= keys
            if stop < len(w.writes):
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


def _first_claimed(w: Writer, claimed: set[ClaimKey]) -> int:
    """Index (into ``w.writes``) of the first page another writer serves it; len if none."""
    if w.reads is None or not claimed:
        return len(w.writes)
    return next((i for i, keys in enumerate(w.reads) if not keys.isdisjoint(claimed)),
                len(w.writes))


def dedup_for(config: ForkServeConfig, metrics: EngineMetrics) -> PrefixDedupPolicy:
    if config.prefix_dedup is PrefixDedup.IN_FLIGHT:
        return InflightDedup(config.page_size, metrics)
    return NoDedup()
