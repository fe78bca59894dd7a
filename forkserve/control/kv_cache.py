"""KVCache: the control plane's memory — page pools, the DualRadixTree, and the layout rules
that decide which pages a node may share with whom.

Ownership: the pools own page ids; every ``NodeKV`` made here owns one reference per page it
lists (released by its node); the DualRadixTree owns one reference per published page
(released by eviction). Nothing here touches a tensor: writes happen in the backend, which
``copy_pages`` reaches through the callback the engine passes in.

Layout rules (seed 001):

* unified — merged K/V depends on the adapter: pages are keyed under the adapter's
  namespace and a fork to another adapter shares nothing;
* disaggregated — base pages are everyone's, residual pages the adapter's: a fork to
  another adapter aliases the base side and starts an empty residual side;
* full_reuse — merged K/V shared across adapters (the lossy baseline): everything aliases.

Activated LoRA (``control/activation.py``): K/V before an aLoRA's activation point is the
base model's, so in every layout those pages are keyed as BASE pages (``base_pages``) and a
fork from base-model K/V to an aLoRA aliases it; pages from the activation point on are
keyed under the adapter's namespace, which carries the activation point.
"""
from __future__ import annotations

from typing import Callable, Sequence

from forkserve.backend.protocol import PageKind
from forkserve.config import ForkServeConfig, KVLayout
from forkserve.control.activation import Invocation, earliest
from forkserve.control.dual_radix_tree import BaseKey, DualMatch, DualRadixTree, ResidualKey
from forkserve.control.node_kv import NodeKV
from forkserve.control.page_pool import PagePool
from forkserve.control.page_table import PageTable
from forkserve.control.prefix_index import PrefixIndex
from forkserve.errors import OutOfPagesError

AdapterVersion = Callable[[object], int]
AdapterInvocation = Callable[[object], Sequence[int] | None]


class KVCache:
    def __init__(self, config: ForkServeConfig, kinds: Sequence[PageKind],
                 adapter_version: AdapterVersion | None = None,
                 adapter_invocation: AdapterInvocation | None = None) -> None:
        self.config = config
        self.layout = config.kv_layout
        self.pool = PagePool(kinds[0], config.num_pages, config.page_size)
        self.residual_pool: PagePool | None = None
        if PageKind.RESIDUAL in kinds:
            self.residual_pool = PagePool(PageKind.RESIDUAL, config.num_residual_pages, config.page_size)
        self.tree = DualRadixTree(self.pool, self.residual_pool)
        self._adapter_version = adapter_version or (lambda adapter: 0)
        self._adapter_invocation = adapter_invocation or (lambda adapter: None)
        # Per adapter id, looked up once: ids are never reused for another adapter.
        self._invocations: dict[object, Invocation | None] = {}

    @property
    def index(self) -> PrefixIndex:
        return self.tree.base

    @property
    def residual_index(self) -> PrefixIndex | None:
        return self.tree.residual

    def pools(self) -> list[PagePool]:
        return [self.pool] + ([self.residual_pool] if self.residual_pool is not None else [])

    def index_of(self, pool: PagePool) -> PrefixIndex:
        return self.index if pool is self.pool else self.residual_index

    # ------------------------------------------------------- activated LoRA
    def invocation(self, adapter) -> Invocation | None:
        """The adapter's aLoRA invocation; None for the base model and plain adapters."""
        if adapter is None:
            return None
        if adapter not in self._invocations:
            tokens = self._adapter_invocation(adapter)
            self._invocations[adapter] = Invocation(tuple(tokens)) if tokens is not None else None
        return self._invocations[adapter]

    def adapter_start(self, kv: NodeKV, adapter) -> int | None:
        """Where ``adapter`` applies on this table's K/V (None: nowhere, base-model K/V)."""
        if adapter is None:
            return None
        return kv.adapter_start if self.invocation(adapter) is not None else 0

    @staticmethod
    def activate(kv: NodeKV, start: int | None) -> bool:
        """Move an aLoRA table to the activation point ``start``: K/V written under another
        point is stale from the earlier of the two on. Returns whether anything was cut."""
        if kv.adapter_start == start:
            return False
        cut = earliest(kv.adapter_start, start)
        kv.adapter_start = start
        if cut >= kv.length:
            return False
        kv.truncate(cut)
        return True

    # ------------------------------------------------------------ tables
    def new_kv(self, adapter) -> NodeKV:
        residual = None
        if self.residual_pool is not None and adapter is not None:
            residual = PageTable(self.residual_pool)
        return NodeKV(PageTable(self.pool), residual, self._fresh_start(adapter))

    def fork_kv(self, parent: NodeKV, parent_adapter, adapter) -> NodeKV:
        """Same adapter: alias everything. Another adapter: what the layout lets it share; an
        aLoRA also shares base-model K/V (its table truncates at its activation point)."""
        alora = self.invocation(adapter) is not None
        # An aLoRA child keeps the parent's point (``activate`` then cuts where they differ);
        # any other child of another adapter gets the layout's sharing as its own.
        start = parent.adapter_start if alora or adapter == parent_adapter else self._fresh_start(adapter)
        if (adapter == parent_adapter or self.layout is KVLayout.FULL_REUSE
                or (alora and parent.adapter_start is None and self.layout is KVLayout.UNIFIED)):
            return parent.fork(start)
        if self.layout is KVLayout.DISAGGREGATED:
            return parent.fork_base(self.residual_pool if adapter is not None else None, start)
        return self.new_kv(adapter)

    def _fresh_start(self, adapter) -> int | None:
        """An empty table's point: a plain adapter applies from 0, an aLoRA from nowhere yet."""
        return 0 if adapter is not None and self.invocation(adapter) is None else None

    # ------------------------------------------------------------- index
    def keys(self, adapter, path: Sequence[int],
             adapter_start: int | None = 0) -> tuple[BaseKey, ResidualKey | None]:
        """Keys of ``path``'s pages for K/V of ``adapter`` applied from ``adapter_start``."""
        tokens = tuple(path)
        if adapter is None:
            return BaseKey(tokens), None
        p = self.pool.page_size
        # Pages wholly before the activation point hold base-model K/V (a zero residual).
        base_pages = len(tokens) // p if adapter_start is None else adapter_start // p
        residual = ResidualKey(adapter, self._adapter_version(adapter), tokens, adapter_start, base_pages)
        if self.layout is KVLayout.UNIFIED:
            # Merged K/V depends on the adapter: the base side lives under its namespace.
            return BaseKey(tokens, residual.namespace, base_pages), residual
        return BaseKey(tokens), residual

    def match(self, kv: NodeKV, adapter, path: Sequence[int]) -> DualMatch:
        """Published pages for ``path``: how far the base side and the residual side reach."""
        base_key, residual_key = self.keys(adapter, path, self.adapter_start(kv, adapter))
        return self.tree.match(base_key, residual_key if kv.residual is not None else None)

    def publish(self, kv: NodeKV, adapter, path_of: Callable[[], Sequence[int]],
                published: tuple[int, int], cursor) -> tuple[tuple[int, int], object]:
        """Publish the full pages of each side of a committed table (the sides may reach
        different lengths). ``published``/``cursor`` come from the previous call for the same
        table; returns their new values. ``path_of`` is only called when a page is new (most
        decode steps add none). Only committed tables may be passed."""
        p = self.pool.page_size
        base_full = kv.base.length // p
        res_full = kv.residual.length // p if kv.residual is not None else 0
        if (base_full, res_full) == published:
            return published, cursor
        path = path_of()
        start = self.adapter_start(kv, adapter)
        base_key, residual_key = self.keys(adapter, path[:base_full * p], start)
        residual_pages: Sequence[int] = ()
        if kv.residual is not None:
            residual_key = self.keys(adapter, path[:res_full * p], start)[1]
            residual_pages = kv.residual.pages[:res_full]
        cursor = self.tree.insert(base_key, kv.base.pages[:base_full], residual_key, residual_pages,
                                  cursor)
        return (base_full, res_full), cursor

    # ------------------------------------------------------------ memory
    def make_room(self, pool: PagePool, need: int, preempt: Callable[[PagePool, int], None] | None) -> None:
        """Free pages for a write: evict the pool's own index (never the other one), then let
        ``preempt`` (committed work only) release speculation; raise if still short."""
        index = self.index_of(pool)
        if need > pool.num_free:
            index.evict(need - pool.num_free)
        if need > pool.num_free and preempt is not None:
            preempt(pool, need)
        if need > pool.num_free:
            raise OutOfPagesError(f"need {need} {pool.kind.value} pages; {pool.num_free} free after "
                                  f"evicting the index and preempting speculation")

    def evict_all(self) -> int:
        return self.tree.evict_all()

    def check_integrity(self, tables: Sequence[PageTable]) -> None:
        """Refcounts equal the holders (these tables plus the index) exactly, in every pool."""
        expected = {pool: dict(self.index_of(pool).held_refs()) for pool in self.pools()}
        for table in tables:
            refs = expected.setdefault(table.pool, {})
            for page in table.pages:
                refs[page] = refs.get(page, 0) + 1
        for pool, refs in expected.items():
            pool.check_integrity(refs)
