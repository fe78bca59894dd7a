"""DualRadixTree: the base tree and the residual tree of ForkKV, with decoupled LRU.

* The base tree indexes BASE (or UNIFIED) pages by ``BaseKey(tokens)`` — under the
  adapter's namespace in the unified layout, where merged K/V depends on the adapter.
* The residual tree indexes RESIDUAL pages by ``ResidualKey(adapter_id, adapter_version,
  tokens)``: a key of adapter A never matches adapter B, nor A after it was reloaded. Its
  namespace spells the backend's ``AdapterId`` as the index's ``AdapterKey``.

An activated LoRA's keys carry its activation point (``adapter_start``) in the adapter
namespace, and ``base_pages``: its leading pages wholly before that point, keyed under BASE
on both sides (base-model K/V; on the residual side, an all-zero residual).

Every key carries the ``CacheSalt`` of the trust boundary it was computed in (both trees,
and so the residual host tier too): pages are matched only under the salt they were
published under.

Both are ``PrefixIndex``es over their own pool, so each has its own LRU and evicting one
never touches the other. Only the residual tree may have a ``HostTier``: its pages are
rank-r, cheap to park on the host and to bring back. ``match`` reports how far each side reaches;
the engine recomputes only the missing side (a partial hit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from forkserve.adapter_key import AdapterId, adapter_key
from forkserve.backend.protocol import PageId
from forkserve.control.host_tier import HostTier
from forkserve.control.page_hash import ChainSeed
from forkserve.control.page_pool import PagePool
from forkserve.control.prefix_index import (
    BASE,
    UNSALTED,
    AdapterNamespace,
    CacheSalt,
    InsertCursor,
    Namespace,
    PrefixIndex,
)


class BaseKey(NamedTuple):
    """A base-side key (a NamedTuple: built on every publish and match)."""

    tokens: Sequence[int]  # a tuple; publish's keys: a PathPrefix view, used at once
    namespace: Namespace = BASE
    base_pages: int = 0  # leading pages keyed under BASE whatever ``namespace`` is
    salt: CacheSalt = UNSALTED


class ResidualKey(NamedTuple):
    """A residual-side key (a NamedTuple: built on every publish and match)."""

    adapter_id: AdapterId
    adapter_version: int
    tokens: Sequence[int]  # a tuple; publish's keys: a PathPrefix view, used at once
    adapter_start: int | None = 0  # see AdapterNamespace
    base_pages: int = 0
    salt: CacheSalt = UNSALTED

    @property
    def namespace(self) -> AdapterNamespace:
        return AdapterNamespace(adapter_key(self.adapter_id), self.adapter_version,
                                self.adapter_start)


class DualCursor(NamedTuple):
    """Both sides' insert cursors (one built per publish)."""

    base: InsertCursor
    residual: InsertCursor | None

    @property
    def seed(self) -> ChainSeed:
        """The chain end of the published prefix the cursor ends (both sides hash the same
        tokens; the base side is always there)."""
        return self.base.seed


@dataclass(frozen=True)
class DualMatch:
    base_pages: list[PageId]
    residual_pages: list[PageId] | None  # None: no residual side asked for
    # Where the match ended on each side: the first publish of a table that takes these
    # pages resumes there (``Stepper.attach``); None where nothing was matched in the trees.
    cursor: DualCursor | None = None

    @property
    def covered_pages(self) -> int:
        """Pages where both sides are published (KV fully valid)."""
        if self.residual_pages is None:
            return len(self.base_pages)
        return min(len(self.base_pages), len(self.residual_pages))


class DualRadixTree:
    def __init__(self, base_pool: PagePool, residual_pool: PagePool | None,
                 residual_host: HostTier | None = None) -> None:
        self.base = PrefixIndex(base_pool)
        self.residual = (PrefixIndex(residual_pool, residual_host) if residual_pool is not None
                         else None)

    def match(self, base: BaseKey, residual: ResidualKey | None = None) -> DualMatch:
        hit = self.base.match_at(base.namespace, base.tokens, base.base_pages, base.salt)
        if residual is None or self.residual is None:
            return DualMatch(hit.pages, None, DualCursor(hit.cursor, None))
        res = self.residual.match_at(residual.namespace, residual.tokens, residual.base_pages,
                                     residual.salt)
        return DualMatch(hit.pages, res.pages, DualCursor(hit.cursor, res.cursor))

    def insert(self, base: BaseKey, base_pages: Sequence[PageId],
               residual: ResidualKey | None = None, residual_pages: Sequence[PageId] = (),
               resume: "DualCursor | None" = None) -> "DualCursor":
        """Publish both sides; the returned cursor makes the next insert of a longer prefix
        of the same path walk only its new pages."""
        base_cursor = self.base.insert(base.namespace, base.tokens, base_pages,
                                       resume.base if resume is not None else None, base.base_pages,
                                       base.salt)
        res_cursor = None
        if residual is not None and self.residual is not None and residual_pages:
            res_cursor = self.residual.insert(residual.namespace, residual.tokens, residual_pages,
                                              resume.residual if resume is not None else None,
                                              residual.base_pages, residual.salt)
        return DualCursor(base_cursor, res_cursor)

    def evict_all(self) -> int:
        """Drop everything, host copies included; returns the device pages freed."""
        freed = self.base.evict()
        if self.residual is not None:
            self.residual.drop_host()
            freed += self.residual.evict(offload=False)
        return freed
