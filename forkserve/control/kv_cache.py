"""KVCache: the control plane's memory — page pools, the DualRadixTree, and the layout rules
that decide which pages a node may share with whom.

Ownership: the pools own page ids; every ``NodeKV`` made here owns one reference per page it
lists (released by its node); the DualRadixTree owns one reference per published page
(released by eviction); ``retention`` owns one per base page pinned through a tool pause.
The residual tree owns the host slots of its offloaded pages (``HostTier``). Nothing here
touches a tensor: writes happen in the backend, which ``copy_pages`` reaches through the
callback the engine passes in, and host copies through the backend's ``HostOffload``.

Per-pool retention (D1): under pressure a pool evicts its own index only. The residual index
parks evicted pages on the host tier (when the backend has one) and a later match brings
them back; base pages of a paused agent are pinned and give way only to committed work,
after speculation (``make_room``).

Layout rules (seed 001):

* unified — merged K/V depends on the adapter: pages are keyed under the adapter's
  namespace and a fork to another adapter shares nothing;
* disaggregated — base pages are shared across adapters, residual pages the adapter's: a
  fork to another adapter aliases the base side and starts an empty residual side;
* full_reuse — merged K/V shared across adapters (the lossy baseline): everything aliases;

Exactness is a policy (``may_read``): base-side pages carry their provenance in the key
(BASE: written by the base model; ``ForwardNamespace``: from an adapter's hidden states).
The base model reads only its own pages, in every layout; an adapter reads the base model's
and, with ``ShareBase.CROSS_ADAPTER`` (the default), every adapter's; with ``EXACT`` only
its own; with ``NEUTRAL`` the base model's and its own (a neutral writer: never another
adapter's).
* adaptive — per session, merged (the unified rules) or split (the disaggregated rules), as
  the ``LayoutPolicy`` chooses at open. A node's form shows in its NodeKV: an adapter's
  node without a residual table is merged.

Activated LoRA (``control/activation.py``): K/V before an aLoRA's activation point is the
base model's, so in every layout and form those pages are keyed as BASE pages
(``base_pages``) and a fork from base-model K/V to an aLoRA aliases it; pages from the
activation point on are keyed as the node's form says (merged: under the adapter's
namespace, which carries the activation point; split: base side global, residual side
under that namespace). ``keys`` is the one place that decides.

Trust boundaries: a session's tables carry the ``CacheSalt`` it was opened with (its
tenant and request salt; every fork keeps it), and ``keys`` puts it into both keys, so a
page is matched only by sessions of the same boundary — on the base tree, the residual tree
and the residual host tier alike.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import HostOffload, PageKind
from forkserve.config import ForkServeConfig, KVForm, KVLayout, ShareBase
from forkserve.control.activation import Invocation, earliest
from forkserve.control.dual_radix_tree import BaseKey, DualMatch, DualRadixTree, ResidualKey
from forkserve.control.host_tier import HostTier
from forkserve.control.inflight import ClaimRun, ClaimStreams
from forkserve.control.layout_policy import (
    NOTHING_QUEUED,
    LayoutPolicy,
    LayoutSignals,
    Queued,
    policy_for,
)
from forkserve.control.metrics import EngineMetrics
from forkserve.control.node_kv import NodeKV
from forkserve.control.page_hash import PageChain
from forkserve.control.page_pool import PagePool
from forkserve.control.page_table import PageTable
from forkserve.control.path_prefix import PathPrefix
from forkserve.control.pause_ttl import PauseTTL, QuantilePauseTTL
from forkserve.control.prefix_index import (
    BASE,
    CROSS_ADAPTER,
    UNSALTED,
    CacheSalt,
    ForwardNamespace,
    PrefixIndex,
)
from forkserve.control.retention import BaseRetention
from forkserve.control.shared_kv import SharedKV
from forkserve.errors import OutOfPagesError

AdapterVersion = Callable[[AdapterId], int]
AdapterInvocation = Callable[[AdapterId], Sequence[int] | None]


class KVCache:
    def __init__(self, config: ForkServeConfig, kinds: Sequence[PageKind],
                 adapter_version: AdapterVersion | None = None,
                 adapter_invocation: AdapterInvocation | None = None, *,
                 metrics: EngineMetrics | None = None, host: HostOffload | None = None,
                 pause_ttl: PauseTTL | None = None,
                 policy: LayoutPolicy | None = None) -> None:
        """``adapter_invocation``: an adapter's aLoRA invocation tokens (None: a plain
        adapter). ``host``: the backend, where it implements ``HostOffload``; with
        ``config.host_residual_pages`` > 0 evicted residual pages go there instead of away."""
        self.config = config
        self.layout = config.kv_layout
        # Read on every publish (``form_of``): the enum's property is a Python call.
        self._residual_layout = self.layout.has_residual_pool
        metrics = metrics if metrics is not None else EngineMetrics()
        self.pool = PagePool(kinds[0], config.num_pages, config.page_size)
        self.residual_pool: PagePool | None = None
        self.host_tier: HostTier | None = None
        if PageKind.RESIDUAL in kinds:
            self.residual_pool = PagePool(PageKind.RESIDUAL, config.num_residual_pages,
                                          config.page_size)
            if host is not None and config.host_residual_pages:
                self.host_tier = HostTier(PageKind.RESIDUAL, config.host_residual_pages,
                                          config.page_size, host, metrics)
        self.tree = DualRadixTree(self.pool, self.residual_pool, self.host_tier)
        self.retention = BaseRetention(
            pause_ttl or QuantilePauseTTL(config.pause_ttl_quantile, config.pause_ttl_prior_s),
            metrics)
        self._adapter_version = adapter_version or (lambda adapter: 0)
        self._adapter_invocation = adapter_invocation or (lambda adapter: None)
        # Per adapter id, looked up once: ids are never reused for another adapter.
        self._invocations: dict[AdapterId, Invocation | None] = {}
        self.policy = policy or policy_for(self.layout, config.adaptive_high_water,
                                           config.adaptive_hysteresis,
                                           config.adaptive_split_waves)

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
    def invocation(self, adapter: AdapterId | None) -> Invocation | None:
        """The adapter's aLoRA invocation; None for the base model and plain adapters."""
        if adapter is None:
            return None
        if adapter not in self._invocations:
            tokens = self._adapter_invocation(adapter)
            self._invocations[adapter] = Invocation(tuple(tokens)) if tokens is not None else None
        return self._invocations[adapter]

    def adapter_start(self, kv: NodeKV, adapter: AdapterId | None) -> int | None:
        """Where ``adapter`` applies on this table's K/V (None: nowhere, base-model K/V)."""
        if adapter is None:
            return None
        return kv.adapter_start if self.invocation(adapter) is not None else 0

    def path_start(self, adapter: AdapterId | None, tokens: Sequence[int]) -> int | None:
        """``adapter``'s activation point on a whole path (before any table is written):
        0 for a plain adapter, the last invocation's start for an aLoRA."""
        invocation = self.invocation(adapter)
        if invocation is None:
            return None if adapter is None else 0
        return invocation.last_start(tokens, 0)

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
    def choose_form(self, adapter: AdapterId | None, tokens: Sequence[int], pending_pages: int,
                    salt: CacheSalt = UNSALTED, queued: Queued = NOTHING_QUEUED) -> KVForm:
        """The form of a new session's pages. ``pending_pages``: pages the live sessions'
        queued prompts will still take from the base pool; ``queued``: the sessions an
        admission controller holds back behind this one."""
        if len(self.layout.forms) == 1:
            return self.layout.forms[0]  # nothing to choose; the signals walk the index
        p = self.pool.page_size
        full = tokens[:len(tokens) // p * p]
        start = self.path_start(adapter, tokens)
        base_key, residual_key = self.keys(adapter, full, KVForm.MERGED, start, salt)
        # Probes, not matches: restoring the host tier's pages or refreshing the LRU here
        # would act for a session that may not open (an admission controller sizes requests
        # by this) or not take the form probed.
        residual_hit = 0
        if residual_key is not None and self.residual_pool is not None:
            residual_hit = len(self.residual_index.probe(
                residual_key.namespace, residual_key.tokens, residual_key.base_pages, salt)) * p
        # What merged would hold: pages tables and pins hold (cached pages are evictable, not
        # load), the queued prompts, and this prompt less the published merged pages others
        # already hold (those it finds cached become load: they stay in its count).
        shared = self._held_run(base_key)
        own = -(-len(tokens) // p)
        projected = self.pool.num_used - self.index.num_cache_only + pending_pages + own - shared
        split_held = base_model_held = 0
        if adapter is not None:
            split_key = self.keys(adapter, full, KVForm.SPLIT, start, salt)[0]
            split_held = self._held_run(split_key)
            if self._takes_base_model_pages(split_key.namespace):  # as ``match`` reads
                base_model_held = self._held_run(BaseKey(split_key.tokens, BASE, 0, salt))
                split_held = max(split_held, base_model_held)
        queued_merged, queued_split = self._queued_pages(queued, adapter, split_held,
                                                         base_model_held)
        return self.policy.choose(LayoutSignals(adapter is not None, residual_hit, projected,
                                                self.pool.num_pages, split_held, queued_merged,
                                                queued_split, own, queued.holds_for_room))

    def _held_run(self, key: BaseKey) -> int:
        """Leading pages of ``key`` published in the base index that a table or pin holds."""
        return self.index.held_run(key.namespace, key.tokens, key.base_pages, key.salt)

    def _queued_pages(self, queued: Queued, adapter: AdapterId | None, split_held: int,
                      base_model_held: int) -> tuple[int, int]:
        """Base pages ``queued`` takes all merged, and all split: split sessions of other
        adapters share the common prefix only under ``CROSS_ADAPTER`` (written once, less what
        live split sessions already hold); under ``NEUTRAL`` only the base model's pages held
        now, under ``EXACT`` nothing (``may_read``). Merged sessions share it only where it
        is the base model's (an aLoRA's context)."""
        if not queued.sessions:
            return 0, 0
        p = self.pool.page_size
        each = -(-queued.tokens // p)
        common = min(queued.shared_tokens // p, each)
        merged_shared = common if self.invocation(adapter) is not None else 0
        if self.config.share_base is ShareBase.CROSS_ADAPTER:
            split_shared, once = common, max(0, common - split_held)
        else:
            split_shared, once = min(base_model_held, common), 0
        return (queued.sessions * (each - merged_shared),
                queued.sessions * (each - split_shared) + once)

    def new_kv(self, adapter: AdapterId | None, form: KVForm,
               salt: CacheSalt = UNSALTED) -> NodeKV:
        residual = None
        if form is KVForm.SPLIT and self.residual_pool is not None and adapter is not None:
            residual = PageTable(self.residual_pool)
        return NodeKV(PageTable(self.pool), residual, self._fresh_start(adapter), salt)

    def fork_kv(self, parent: NodeKV, parent_adapter: AdapterId | None,
                adapter: AdapterId | None) -> NodeKV:
        """Same adapter: alias everything. Another adapter: what the layout (for the adaptive
        layout, the parent's form) lets it share — a split parent its base pages, a merged
        parent nothing (the child starts merged too: no residual exists to split into). An
        aLoRA also shares a merged parent's base-model K/V (its table truncates at its
        activation point, ``activate``)."""
        alora = self.invocation(adapter) is not None
        # An aLoRA child keeps the parent's point (``activate`` then cuts where they differ);
        # any other child of another adapter gets the layout's sharing as its own.
        start = parent.adapter_start if alora or adapter == parent_adapter \
            else self._fresh_start(adapter)
        if adapter == parent_adapter:
            return parent.fork(start)
        if alora and parent.adapter_start is None and parent.residual is None:
            # Merged K/V computed as the base model everywhere is the base model's K/V:
            # the aLoRA child aliases all of it and stays merged.
            return parent.fork(start)
        if not self.may_read(parent_adapter, adapter):
            return self.new_kv(adapter, self.form_of(parent, parent_adapter), parent.salt)
        if self.layout is KVLayout.FULL_REUSE:
            return parent.fork(start)
        if self.form_of(parent, parent_adapter) is KVForm.SPLIT:
            return parent.fork_base(self.residual_pool if adapter is not None else None, start)
        return self.new_kv(adapter, KVForm.MERGED, parent.salt)

    def may_read(self, writer, reader) -> bool:
        """Whether ``reader`` may read the shared K/V (base side, or full_reuse's merged
        pages) that ``writer``'s forward pass wrote: the base model reads only its own;
        an adapter reads the base model's and, under ``ShareBase.CROSS_ADAPTER``, any
        adapter's (under ``NEUTRAL`` none but its own). (Both may always read pages wholly
        before an aLoRA's activation point.)"""
        if writer == reader or writer is None and reader is not None:
            return True
        return reader is not None and self.config.share_base is ShareBase.CROSS_ADAPTER

    def _takes_base_model_pages(self, namespace) -> bool:
        """Whether a match under ``namespace`` also takes the base model's own pages: the base
        side of a split node (or full_reuse's shared K/V) of an adapter, keyed by the forward
        that wrote it, where the policy lets adapters read base-model K/V (``may_read``)."""
        return isinstance(namespace, ForwardNamespace) and self.config.share_base.reads_base_model

    def form_of(self, kv: NodeKV, adapter: AdapterId | None) -> KVForm:
        """A node's form: split if it has a residual table, or is the base model's in a
        layout with a residual pool (its K/V is the base every split node shares)."""
        if kv.residual is not None or (adapter is None and self._residual_layout):
            return KVForm.SPLIT
        return KVForm.MERGED

    def _fresh_start(self, adapter: AdapterId | None) -> int | None:
        """An empty table's point: a plain adapter applies from 0, an aLoRA from nowhere yet."""
        return 0 if adapter is not None and self.invocation(adapter) is None else None

    # ------------------------------------------------------------- index
    def keys(self, adapter: AdapterId | None, path: Sequence[int], form: KVForm,
             adapter_start: int | None = 0, salt: CacheSalt = UNSALTED
             ) -> tuple[BaseKey, ResidualKey | None]:
        """Keys of ``path``'s pages for K/V of ``adapter`` in ``form``, applied from
        ``adapter_start`` (see ``AdapterNamespace``), within the trust boundary ``salt`` (both
        keys carry it, whatever the namespace: a BASE page is shared only inside it too).
        Form and activation point decide a page's namespace:

        * pages wholly before the activation point hold base-model K/V (and a zero
          residual), so they are keyed BASE (``base_pages``) in every layout and form;
        * from it on, a MERGED page's K/V depends on the adapter, so the base side is keyed
          under the adapter's namespace (which carries ``adapter_start``); a SPLIT node's
          base side is keyed by its provenance (``may_read``), its residual side per adapter.
        """
        tokens = path if isinstance(path, PathPrefix) else tuple(path)  # publish's view, as is
        if adapter is None:
            return BaseKey(tokens, BASE, 0, salt), None
        p = self.pool.page_size
        base_pages = len(tokens) // p if adapter_start is None else adapter_start // p
        residual = ResidualKey(adapter, self._adapter_version(adapter), tokens, adapter_start,
                               base_pages, salt)
        if form is KVForm.MERGED and self.layout is not KVLayout.FULL_REUSE:
            # Merged K/V depends on the adapter: the base side lives under its namespace.
            return BaseKey(tokens, residual.namespace, base_pages, salt), residual
        # A split base side (or full_reuse's shared merged K/V) from the activation point on
        # was computed from this adapter's hidden states: keyed by that provenance, so the
        # base model never reads it and other adapters only where ``share_base`` allows.
        writer = CROSS_ADAPTER if self.config.share_base is ShareBase.CROSS_ADAPTER \
            else ForwardNamespace(residual.namespace)
        return BaseKey(tokens, writer, base_pages, salt), residual

    def _keys_of(self, kv: NodeKV, adapter: AdapterId | None,
                 path: Sequence[int]) -> tuple[BaseKey, ResidualKey | None]:
        """The keys a table's pages are matched and published under: its form, its
        activation point and its salt, all read off the table."""
        return self.keys(adapter, path, self.form_of(kv, adapter), self.adapter_start(kv, adapter),
                         kv.salt)

    def match(self, kv: NodeKV, adapter: AdapterId | None, path: Sequence[int]) -> DualMatch:
        """Published pages for ``path``: how far the base side and the residual side reach."""
        base_key, residual_key = self._keys_of(kv, adapter, path)
        hit = self.tree.match(base_key, residual_key if kv.residual is not None else None)
        if self._takes_base_model_pages(base_key.namespace):
            # The base model's own pages serve every adapter that reads across adapters, and
            # every adapter under a neutral writer.
            exact = self.index.match(BASE, base_key.tokens, 0, base_key.salt)
            if len(exact) > len(hit.base_pages):
                hit = DualMatch(exact, hit.residual_pages, hit.cursor)  # a resume point still
        return hit

    def page_claims(self, kv: NodeKV, adapter: AdapterId | None, path: Sequence[int],
                    chain: PageChain, streams: ClaimStreams) -> tuple[int, tuple[ClaimRun, ...]]:
        """In-flight deduplication's view of a committed table (``control/inflight.py``): for
        each full page of ``path`` from the table's first unwritten one, the streams of the
        sides it still has to write there, and the streams whose publication would give it
        those sides under ``match``'s rule (an adapter's base side may also take the base
        model's pages), in runs of pages that share both. ``chain``: ``path``'s page hashes
        from at most the table's first unwritten page on (``control/page_hash.py``);
        ``streams``: the tick's numbering of the keys' tree, namespace and salt. Returns the
        first page and the runs."""
        p = self.pool.page_size
        full = chain.end
        base_key, residual_key = self._keys_of(kv, adapter, path[:full * p])
        sides = [(kv.base, self.pool.kind, base_key.namespace, base_key.base_pages)]
        if kv.residual is not None and residual_key is not None:
            sides.append((kv.residual, PageKind.RESIDUAL, residual_key.namespace,
                          residual_key.base_pages))
        # Per side, numbered once: the pages it holds, its stream before its activation page
        # (BASE) and from it, and whether a read there may also take the base model's page.
        plans = [(table.length // p, streams(tree, BASE, kv.salt),
                  streams(tree, namespace, kv.salt), base_pages,
                  self._takes_base_model_pages(namespace))
                 for table, tree, namespace, base_pages in sides]
        first = kv.length // p
        runs: list[ClaimRun] = []
        # Between these pages which sides a page still needs, and under which stream, stays
        # the same: each is one run.
        bounds = sorted({first, full, *(min(max(b, first), full)
                                        for held, _, _, base_pages, _ in plans
                                        for b in (held, base_pages))})
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            wrote = tuple(before if lo < base_pages else after
                          for held, before, after, base_pages, _ in plans if lo >= held)
            extra = tuple(before for held, before, _, base_pages, takes_base in plans
                          if lo >= held and lo >= base_pages and takes_base)
            runs.append(ClaimRun(chain.run(lo, hi), wrote, wrote + extra))
        return first, tuple(runs)

    def publish(self, kv: NodeKV, adapter: AdapterId | None, path_of: Callable[[], Sequence[int]],
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
        # No copy of the path or the tables: with a valid cursor the index reads only the new
        # pages and their tokens (O(page), not O(context), per filled page).
        tokens = PathPrefix(path_of(), max(base_full, res_full) * p)
        base_key, residual_key = self._keys_of(
            kv, adapter, tokens if base_full >= res_full else tokens[:base_full * p])
        residual_pages: Sequence[int] = ()
        if kv.residual is not None:
            if res_full != base_full:
                residual_key = self._keys_of(kv, adapter, tokens[:res_full * p])[1]
            residual_pages = _first(kv.residual.pages, res_full)
        cursor = self.tree.insert(base_key, _first(kv.base.pages, base_full), residual_key,
                                  residual_pages, cursor)
        return (base_full, res_full), cursor

    # ------------------------------------------- shared context (base_activations)
    def shared_kv(self, tokens: Sequence[int], adapters: Sequence[AdapterId]) -> SharedKV:
        """Tables for one base-model pass over ``tokens`` that writes the base model's K/V and
        each of ``adapters``' residual (plain adapters, full pages): each holds the leading
        pages published on every side, so only the rest is computed."""
        base_key, keys = self._shared_keys(tokens, adapters)
        hits = [self.index.match(base_key.namespace, base_key.tokens, base_key.base_pages,
                                 base_key.salt)]
        hits += [self.residual_index.match(k.namespace, k.tokens, k.base_pages, k.salt)
                 for k in keys]
        common = min(len(h) for h in hits)
        shared = SharedKV(PageTable(self.pool),
                          {a: PageTable(self.residual_pool) for a in adapters})
        for table, pages in zip(shared.tables(), hits, strict=True):
            table.attach(pages[:common], common * self.pool.page_size)
        return shared

    def publish_shared(self, shared: SharedKV, tokens: Sequence[int]) -> None:
        """Publish a written shared context: the base pages as the base model's, each residual
        under the key a split session of its adapter matches."""
        full = len(tokens) // self.pool.page_size
        base_key, keys = self._shared_keys(tokens, list(shared.residuals))
        self.tree.insert(base_key, shared.base.pages[:full])
        for key, table in zip(keys, shared.residuals.values(), strict=True):
            self.residual_index.insert(key.namespace, key.tokens, table.pages[:full], None,
                                       key.base_pages, key.salt)

    def _shared_keys(self, tokens: Sequence[int], adapters: Sequence[AdapterId]
                     ) -> tuple[BaseKey, list[ResidualKey]]:
        tokens = tuple(tokens)
        base_key = self.keys(None, tokens, KVForm.SPLIT)[0]
        return base_key, [self.keys(a, tokens, KVForm.SPLIT, self._fresh_start(a))[1]
                          for a in adapters]

    def pin_published(self, kv: NodeKV, adapter: AdapterId | None, path: Sequence[int],
                      now: float) -> None:
        """Pin the base pages the index holds for ``path`` (``kv``'s) through the pause that
        follows."""
        base_key, _ = self._keys_of(kv, adapter, path)
        self.retention.pin(self.pool, self.index.match(base_key.namespace, base_key.tokens,
                                                       base_key.base_pages, base_key.salt), now)

    # ------------------------------------------------------------ memory
    def evict_for(self, needs: Mapping[PagePool, int]) -> None:
        """Evict each pool's own index once for what a whole tick will write (pages per
        pool), so a tick under pressure makes one eviction pass, and one batch of host
        copies, per pool instead of one per item; eviction only (no preemption, no pins):
        what is still short is each item's ``make_room`` to settle."""
        for pool, need in needs.items():
            if need > pool.num_free:
                self.index_of(pool).evict(need - pool.num_free)

    def make_room(self, pool: PagePool, need: int,
                  preempt: Callable[[PagePool, int], None] | None) -> None:
        """Free pages for a write: evict the pool's own index (never the other one; the
        residual index parks pages on the host tier), then, for committed work only
        (``preempt`` given), release speculation and after it pause pins; raise if still short."""
        self.evict_for({pool: need})
        if need > pool.num_free and preempt is not None:
            preempt(pool, need)
        if need > pool.num_free and preempt is not None:
            self.retention.release_for(pool, need, self.index_of(pool).evict)
        if need > pool.num_free:
            raise OutOfPagesError(f"need {need} {pool.kind.value} pages; {pool.num_free} free "
                                  f"after evicting the index and preempting speculation")

    def evict_all(self) -> int:
        """Drop every cached page: pause pins, the index, the host tier."""
        self.retention.release_all()
        return self.tree.evict_all()

    def check_integrity(self, tables: Sequence[PageTable]) -> None:
        """Refcounts equal the holders (these tables, the pause pins and the index) exactly,
        in every pool; every host slot is held by exactly one offloaded index entry."""
        for pool in self.pools():
            self.index_of(pool).check_integrity()
        expected = {pool: dict(self.index_of(pool).held_refs()) for pool in self.pools()}
        for table in [*tables, *self.retention.tables()]:
            refs = expected.setdefault(table.pool, {})
            for page in table.pages:
                refs[page] = refs.get(page, 0) + 1
        for pool, refs in expected.items():
            pool.check_integrity(refs)


def _first(pages: list[int], n: int) -> Sequence[int]:
    """``pages[:n]`` without a copy: the list itself when it has ``n`` pages (a table whose
    last page just filled), else a view of it (read at once, as ``PathPrefix`` says)."""
    return pages if len(pages) == n else PathPrefix(pages, n)
