"""A read-only summary of the KV cache for the interfaces (metrics, routing, benches, tenant
quotas): the pools, the published pages, and the pages one session holds.

L4 reads the cache through these frozen values, never through the control plane's pools and
prefix trees: each call copies the figures out, so a summary taken on the engine thread may
be handed to any other thread and outlives the state it describes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from forkserve.adapter_key import AdapterKey
from forkserve.backend.protocol import PageId, PageKind
from forkserve.control.kv_cache import KVCache
from forkserve.control.page_pool import PagePool
from forkserve.control.prefix_index import AdapterNamespace, CacheSalt, PrefixIndex
from forkserve.engine.session import Session


@dataclass(frozen=True)
class PoolStats:
    """One device pool and what its prefix tree publishes from it."""

    kind: PageKind
    pages: int       # capacity
    used: int        # held by a table, the prefix tree or a pause pin
    live: int        # held by something other than the prefix tree alone (the cache is an
                     # asset eviction frees under pressure, not load)
    free: int
    published: int   # pages its prefix tree holds (a page under two keys counts once)


@dataclass(frozen=True)
class CacheStats:
    page_size: int
    base: PoolStats                 # the unified pool, or the base pool when disaggregated
    residual: PoolStats | None      # the rank-r residual pool (disaggregated layouts only)
    pins: int                       # closed sessions whose base pages are pinned (tool pause)
    pinned_pages: int               # the pages those pins hold
    offloaded_pages: int            # residual entries held in host slots instead of pages
    host_slots_free: int            # 0 without a host tier

    def pools(self) -> tuple[PoolStats, ...]:
        return (self.base,) if self.residual is None else (self.base, self.residual)


class PagesInUse(NamedTuple):
    """Pages held in each pool at one instant (``Engine.pages_in_use``)."""

    base: int        # the unified pool, or the base pool when disaggregated
    residual: int    # the residual pool (0 without one)


@dataclass(frozen=True)
class PublishedPage:
    """One device page of a prefix tree, keyed as the engine keys it."""

    residual: bool                  # in the residual tree (else the base tree)
    adapter: AdapterKey | None      # the adapter whose namespace holds it (None: base model's)
    prefix: tuple[int, ...]         # every token from the root through this page
    salt: CacheSalt


@dataclass(frozen=True)
class SessionPages:
    """The pages one session holds: its committed tip's table (what the session reads next)
    and every base page any of its live nodes holds (an aliased page once)."""

    length: int                                # tokens the tip's table holds
    base: tuple[PageId, ...]                   # the tip's base (or unified) pages, in order
    residual: tuple[PageId, ...] | None        # the tip's residual pages (None: no residual)
    base_held: frozenset[PageId]               # base pages of every live node, the tip's too


def session_pages(session: Session) -> SessionPages:
    tip = session.tree.tip.table
    held = frozenset(page for node in session.tree.nodes.values()
                     if node.live and node.table is not None for page in node.table.base.pages)
    return SessionPages(tip.length, tuple(tip.base.pages),
                        tuple(tip.residual.pages) if tip.residual is not None else None, held)


def _pool_stats(pool: PagePool, index: PrefixIndex) -> PoolStats:
    return PoolStats(pool.kind, pool.num_pages, pool.num_used, pool.num_used - index.num_cache_only,
                     pool.num_free, index.num_pages)


def pages_in_use(kv: KVCache) -> PagesInUse:
    residual = kv.residual_pool.num_used if kv.residual_pool is not None else 0
    return PagesInUse(kv.pool.num_used, residual)


def cache_stats(kv: KVCache) -> CacheStats:
    residual = kv.residual_index
    host = kv.host_tier
    pinned = kv.retention.tables()
    return CacheStats(
        kv.pool.page_size, _pool_stats(kv.pool, kv.index),
        _pool_stats(kv.residual_pool, residual) if residual is not None else None,
        len(pinned), sum(len(t.pages) for t in pinned),
        residual.num_offloaded if residual is not None else 0,
        host.num_free if host is not None else 0)


def published_pages(kv: KVCache) -> tuple[PublishedPage, ...]:
    """Every device page of the base tree, then of the residual tree; within a tree a page
    comes after its parent."""
    indexes = [(False, kv.index)]
    if kv.residual_index is not None:
        indexes.append((True, kv.residual_index))
    return tuple(
        PublishedPage(residual,
                      e.namespace.adapter if isinstance(e.namespace, AdapterNamespace) else None,
                      e.prefix, e.salt)
        for residual, index in indexes for e in index.entries())
