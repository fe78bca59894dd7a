"""PrefixIndex: the global index of committed full pages (the base side of the DualRadixTree).

A radix tree with one edge per page. An edge is keyed by a typed ``PageKey``: the page's
token ids and the ``Namespace`` of what computed its KV (the base model, or one adapter
version from one activation point): never a string glued from tokens, so two different
prefixes cannot collide. A path from the root spells a committed token prefix, page by
page. A path may start under BASE and continue under an adapter: an activated LoRA's
pages before its invocation are the base model's (``base_pages``), shared with base-model
sessions and other aLoRAs over the same prefix.

Trust boundary: every key also carries a ``CacheSalt``, so a match only ever reaches pages
published under an equal salt (a server's tenant and its request's ``cache_salt``). The
salt is in every edge, not just the first: no walk can cross from one boundary into another.

Ownership: the index holds one pool reference per published page, taken in ``insert``
and given back in ``evict``. Only committed tokens are inserted (the engine's commit,
root prefill and close paths); speculative pages never are. ``match`` hands back page
ids without taking references: the caller increfs what it keeps.

Host tier (optional, the residual index): ``evict`` parks a page in a ``HostTier`` slot
instead of dropping it; the entry stays in the tree, *offloaded*, holding the slot instead
of a page. Device-resident entries stay prefix-closed (an offloaded entry has only
offloaded descendants), so a match walks device pages first and then restores the
offloaded tail it reaches into fresh pages. When the host is full, its own LRU drops
offloaded leaves for good. The index owns every slot it holds and gives it back on restore,
on drop, or when a newly published page for the same prefix makes the host copy redundant.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

from forkserve.adapter_key import AdapterKey
from forkserve.backend.protocol import HostCopy, HostSlotId, PageId
from forkserve.control.eviction_frontier import EvictionFrontier
from forkserve.control.host_tier import HostTier
from forkserve.control.page_hash import ROOT_HASH, ChainSeed, chained
from forkserve.control.page_pool import PagePool
from forkserve.control.path_prefix import backing


@dataclass(frozen=True)
class BaseNamespace:
    """Pages computed by the base model: exact for it, and for every adapter before its
    activation point."""


@dataclass(frozen=True)
class AdapterNamespace:
    """Pages whose contents depend on one adapter version, applied from ``adapter_start``
    (0: a plain LoRA; an aLoRA's activation point; None: an aLoRA not invoked on the path)."""

    adapter: AdapterKey
    adapter_version: int = 0
    adapter_start: int | None = 0


@dataclass(frozen=True)
class ForwardNamespace:
    """Base-side K/V (xW) computed from an adapter's hidden states: the base model's weights
    over activations the adapter shaped, so it is exact only for that adapter (``writer``);
    ``writer`` None: some adapter's, shared across adapters by choice (``ShareBase``)."""

    writer: AdapterNamespace | None = None


Namespace = BaseNamespace | AdapterNamespace | ForwardNamespace
BASE = BaseNamespace()
CROSS_ADAPTER = ForwardNamespace()


@dataclass(frozen=True)
class CacheSalt:
    """The trust boundary a published page is shared within: pages published under one salt
    are never matched under another. ``UNSALTED`` (both None) is the default scope of callers
    that pass none (the engine used as a library, ``prefill_shared``). A tenant's salt has
    its ``tenant`` (and optionally a per-request ``name``); ``public(name)`` is a named prefix
    that several tenants explicitly opted into sharing."""

    tenant: str | None = None
    name: str | None = None

    @classmethod
    def public(cls, name: str) -> "CacheSalt":
        return cls(None, name)


UNSALTED = CacheSalt()


@dataclass(frozen=True, eq=False)
class KeyScope:
    """A namespace within a salt, interned per index (``PrefixIndex._scope``): two equal
    pairs are one object, so a ``PageKey`` hashes and compares by the scope's identity, in C,
    instead of calling the namespace's and the salt's Python ``__hash__``/``__eq__`` per page.
    Lifetime: held by the keys that use it; the index's interning table holds it weakly."""

    namespace: Namespace
    salt: CacheSalt


class PageKey(NamedTuple):
    """One edge: a page's tokens in a scope (only ``PageKey``s key an edge dict)."""

    tokens: tuple[int, ...]
    scope: KeyScope

    @property
    def namespace(self) -> Namespace:
        return self.scope.namespace

    @property
    def salt(self) -> CacheSalt:
        return self.scope.salt


@dataclass(eq=False, slots=True)
class _IndexNode:
    key: PageKey | None
    page: PageId | None
    parent: "_IndexNode | None"
    children: dict[PageKey, "_IndexNode"] = field(default_factory=dict)
    last_access: int = 0
    evicted: bool = False
    host: HostSlotId | None = None  # set while offloaded (``page`` is then None)
    device_children: int = 0        # children on a device page (``EvictionFrontier``)
    # ``page_hash.chained`` over the prefix this entry ends, once asked for (``_chain``): a
    # path continuing it hashes only its own pages (``InsertCursor.seed``).
    chain: int | None = None


class InsertCursor(NamedTuple):
    """Where a publisher's last insert (or the match its table took published pages from)
    ended, so the next insert keys and walks only the pages after it.

    Valid while its node is in the tree and the keys are namespaced the same way; otherwise
    it is ignored. (A NamedTuple: one is built per publish.)
    """

    namespace: "Namespace"
    base_pages: int
    node: _IndexNode
    pages: int
    salt: CacheSalt
    scope: KeyScope  # of ``namespace`` in ``salt``: a resumed insert looks up no scope
    # From a match: the next insert still refreshes the LRU of the pages before it, as the
    # walk from the root it replaces did (an insert's own cursor leaves them as they are).
    refresh: bool = False

    @property
    def seed(self) -> ChainSeed:
        """The chain end of the prefix the cursor ends (``page_hash``)."""
        return ChainSeed(self.pages, _chain(self.node))


def _chain(node: _IndexNode) -> int:
    """``node.chain``, hashed on first use from its nearest hashed ancestor down (an entry's
    parent and key never change, unlinked or not): most entries are never a seed, so an
    insert of new pages hashes none of them."""
    unhashed = []
    while node.chain is None:
        unhashed.append(node)
        node = node.parent
    prev = node.chain
    for node in reversed(unhashed):
        prev = node.chain = chained(prev, node.key.tokens)
    return prev


class IndexMatch(NamedTuple):
    """A match's pages and a cursor after them (an insert of the path resumes there)."""

    pages: list[PageId]
    cursor: InsertCursor


@dataclass(frozen=True)
class IndexEntry:
    namespace: Namespace
    prefix: tuple[int, ...]  # every token up to and including this page
    page: PageId
    salt: CacheSalt = UNSALTED


@dataclass(frozen=True)
class OffloadedEntry:
    namespace: Namespace
    prefix: tuple[int, ...]
    slot: HostSlotId
    salt: CacheSalt = UNSALTED


@dataclass
class _Eviction:
    """One eviction pass: the copies to issue and the pages to free once they are issued.
    Keyed by slot: a slot freed and reused within the pass keeps only its last copy."""

    copies: dict[HostSlotId, PageId] = field(default_factory=dict)
    released: list[PageId] = field(default_factory=list)


class PrefixIndex:
    def __init__(self, pool: PagePool, host: HostTier | None = None) -> None:
        self.pool = pool
        self.host = host
        self.page_size = pool.page_size
        self._root = _IndexNode(None, None, None, chain=ROOT_HASH)
        self._clock = itertools.count(1)
        self._entries = 0        # entries on a device page
        self.num_offloaded = 0   # entries in a host slot
        # References the index holds per page: a page may be published under two keys (a
        # base-model page an adapter's path also reaches under its provenance key).
        self._refs: collections.Counter[PageId] = collections.Counter()
        self._scopes: weakref.WeakValueDictionary[tuple[Namespace, CacheSalt], KeyScope] = \
            weakref.WeakValueDictionary()
        # What eviction may take next, so it never walks the tree.
        self._frontier = EvictionFrontier()

    @property
    def num_pages(self) -> int:
        """Device pages the index holds (a page under two keys counts once)."""
        return len(self._refs)

    def cache_only(self, page: PageId) -> bool:
        """Only the index holds the page: evicting it frees memory (no table reads it)."""
        return self.pool.refcount(page) == self._refs[page]

    @property
    def num_cache_only(self) -> int:
        """Device pages nothing but the index holds: cache, not load."""
        return self.pool.held_only(self._refs)  # ``cache_only`` of each page, in one pass

    def _scope(self, namespace: Namespace, salt: CacheSalt) -> KeyScope:
        scope = self._scopes.get((namespace, salt))
        if scope is None:
            scope = self._scopes[namespace, salt] = KeyScope(namespace, salt)
        return scope

    def _page_keys(self, namespace: Namespace, tokens: Sequence[int], base_pages: int,
                   salt: CacheSalt, first_page: int = 0, scope: KeyScope | None = None
                   ) -> Iterator[PageKey]:
        """The keys of ``tokens``' full pages from ``first_page`` (``scope``: ``namespace``'s,
        when the caller has it)."""
        p = self.page_size
        end = len(tokens) // p
        if first_page < min(base_pages, end):
            base = self._scope(BASE, salt)
            for i in range(first_page, min(base_pages, end)):
                yield PageKey(tuple(tokens[i * p:(i + 1) * p]), base)
            first_page = base_pages
        scope = scope or self._scope(namespace, salt)
        for i in range(first_page, end):
            yield PageKey(tuple(tokens[i * p:(i + 1) * p]), scope)

    def match(self, namespace: Namespace, tokens: Sequence[int], base_pages: int = 0,
              salt: CacheSalt = UNSALTED) -> list[PageId]:
        """Pages of the longest published page-aligned prefix of ``tokens`` under ``salt``; the
        first ``base_pages`` pages are keyed under BASE, the rest under ``namespace``. Offloaded
        entries the match reaches are restored first (see the module docstring)."""
        return self.match_at(namespace, tokens, base_pages, salt).pages

    def match_at(self, namespace: Namespace, tokens: Sequence[int], base_pages: int = 0,
                 salt: CacheSalt = UNSALTED) -> IndexMatch:
        """``match``, with a cursor after its pages: a table that takes them and later
        publishes ``tokens`` (or a path they start) resumes there instead of walking the
        matched prefix again, key by key (an 8K context per session opened on it)."""
        path = self._path(namespace, tokens, base_pages, salt)
        now = next(self._clock)
        for node in path:
            node.last_access = now
        self._restore(path)
        pages = list(itertools.takewhile(lambda p: p is not None, (n.page for n in path)))
        end = path[len(pages) - 1] if pages else self._root
        return IndexMatch(pages, InsertCursor(namespace, base_pages, end, len(pages), salt,
                                              self._scope(namespace, salt), refresh=True))

    def probe(self, namespace: Namespace, tokens: Sequence[int], base_pages: int = 0,
              salt: CacheSalt = UNSALTED) -> list[PageId | None]:
        """The entries ``match`` would find, touching nothing: each one's device page, None
        for one on the host. A probe (``KVCache.choose_form``) restores no page and
        refreshes no LRU."""
        return [n.page for n in self._path(namespace, tokens, base_pages, salt)]

    def held_run(self, namespace: Namespace, tokens: Sequence[int], base_pages: int = 0,
                 salt: CacheSalt = UNSALTED) -> int:
        """Of the leading device pages ``match`` would find, those a table or a pin holds
        besides the index (load, where a ``cache_only`` page is cache). A probe: it touches
        nothing. One walk, counting as it goes: ``KVCache.choose_form`` asks it two or three
        times a session it sizes, over the whole prompt (512 pages at 8K)."""
        held = 0
        for node in self._path(namespace, tokens, base_pages, salt):
            if node.page is None:
                break
            held += not self.cache_only(node.page)
        return held

    def _path(self, namespace: Namespace, tokens: Sequence[int], base_pages: int,
              salt: CacheSalt) -> list[_IndexNode]:
        node = self._root
        path: list[_IndexNode] = []
        for key in self._page_keys(namespace, tokens, base_pages, salt):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def _restore(self, path: list[_IndexNode]) -> None:
        """Bring the offloaded tail of a matched path back to device pages, making room by
        evicting (offloading) entries off the path; what still does not fit is recomputed."""
        offloaded = [n for n in path if n.page is None]
        if not offloaded:
            return
        short = len(offloaded) - self.pool.num_free
        if short > 0:
            self.evict(short, keep=frozenset(path))
        take = offloaded[:min(len(offloaded), self.pool.num_free)]
        pages = self.pool.alloc(len(take))  # the index's reference
        self.host.restore([HostCopy(page, n.host) for page, n in zip(pages, take, strict=True)])
        for page, n in zip(pages, take, strict=True):
            self.host.give_back(n.host)
            n.page, n.host = page, None
            self._refs[page] += 1
            self._frontier.to_device(n)
        self._entries += len(take)
        self.num_offloaded -= len(take)

    def insert(self, namespace: Namespace, tokens: Sequence[int], pages: Sequence[PageId],
               resume: InsertCursor | None = None, base_pages: int = 0,
               salt: CacheSalt = UNSALTED) -> InsertCursor:
        """Publish the full pages of a committed prefix; returns a cursor for the next call.

        Where a page for the same prefix is already published, the index keeps its own
        and the caller's stays private (both hold identical KV). With a valid ``resume``
        from an earlier insert (or ``match_at``) of a prefix of ``tokens``, only the pages
        after it are keyed and walked. ``base_pages`` and ``salt`` as in ``match``.
        """
        node = self._root
        first = 0
        scope = None
        # The walked pages must have been keyed as they would be now (BASE up to the same page).
        # (Identity first: a steady publisher passes the same namespace and salt objects.)
        if (resume is not None and (resume.namespace is namespace or resume.namespace == namespace)
                and (resume.salt is salt or resume.salt == salt)
                and not resume.node.evicted
                and min(resume.pages, resume.base_pages) == min(resume.pages, base_pages)
                # ...and the cursor's node still on the device (an offloaded one was evicted).
                and (resume.node.key is None or resume.node.page is not None)
                and resume.pages <= len(pages)):
            node, first, scope = resume.node, resume.pages, resume.scope
        scope = scope or self._scope(namespace, salt)
        now = next(self._clock)
        if first and resume.refresh:
            # Parent links, no keys: the matched pages are on the device (the caller's table
            # holds them), so the walk from the root would only have refreshed them.
            up = node
            while up is not self._root:
                up.last_access = now
                up = up.parent
        added = 0
        p = self.page_size
        # The keys of ``tokens``' full pages from ``first`` (``_page_keys``: BASE before
        # ``base_pages``), as many as there are pages; read in place (a view's list).
        end = min(len(tokens) // p, len(pages))
        base_scope = self._scope(BASE, salt) if first < min(base_pages, end) else None
        token_list, page_list = backing(tokens), backing(pages)
        for i in range(first, end):
            key = PageKey(tuple(token_list[i * p:(i + 1) * p]),
                          base_scope if i < base_pages else scope)
            page = page_list[i]
            child = node.children.get(key)
            if child is None:
                # A new entry has no children: every page after it is new too.
                node = self._graft(node, i, end, token_list, page_list, base_pages,
                                   base_scope, scope, now)
                added += end - i
                break
            if child.page is None:
                # Offloaded: the caller's page holds the same KV, so the host copy is redundant.
                self.pool.incref([page])
                self._refs[page] += 1
                self.host.give_back(child.host)
                child.page, child.host = page, None
                self._frontier.to_device(child)
                added += 1
                self.num_offloaded -= 1
            child.last_access = now
            node = child
        first = max(first, end)
        self._entries += added
        return InsertCursor(namespace, base_pages, node, first, salt, scope)

    def _graft(self, node: _IndexNode, i: int, end: int, token_list: Sequence[int],
               page_list: Sequence[PageId], base_pages: int, base_scope: KeyScope | None,
               scope: KeyScope, now: int) -> _IndexNode:
        """Link pages ``i..end`` as a new chain under ``node``; returns its last entry. One
        pass per page and one frontier update for the chain: a shared context's publish is
        512 pages for each of 33 paths at W = 32."""
        p = self.page_size
        pages = page_list[i:end]
        self.pool.incref(pages)
        refs = self._refs
        for page in pages:
            refs[page] = refs.get(page, 0) + 1  # (Counter's += calls __missing__ in Python)
        top = node
        for j, page in enumerate(pages, i):
            key = PageKey(tuple(token_list[j * p:(j + 1) * p]),
                          base_scope if j < base_pages else scope)
            child = _IndexNode(key, page, node, last_access=now, device_children=1)
            node.children[key] = child
            node = child
        node.device_children = 0  # the chain's last entry has no children
        self._frontier.grafted(top, node)
        return node

    def evict(self, max_pages: int | None = None, *, keep: frozenset = frozenset(),
              offload: bool = True) -> int:
        """Free least-recently-used device pages that nobody but the index holds; returns how
        many. With a host tier (and ``offload``) a page is parked there and its entry stays;
        otherwise the entry is dropped. ``keep``: entries a match is restoring, never touched."""
        host = self.host if offload else None
        heap = [(n.last_access, id(n), n) for n in self._frontier.device if n not in keep]
        heapq.heapify(heap)
        run = _Eviction()
        while heap and (max_pages is None or len(run.released) < max_pages):
            _, _, node = heapq.heappop(heap)
            # The index's own references are let go only after the pass, with the decref.
            if not self.cache_only(node.page):
                continue  # a live table still reads it; evicting would not free memory
            slot = self._host_slot(keep, run) if host is not None else None
            if slot is None and node.children:
                continue  # its offloaded children need it in the tree, and the host is full
            run.released.append(node.page)
            self._entries -= 1
            if slot is None:
                self._unlink(node)
            else:
                run.copies[slot] = node.page
                node.page, node.host = None, slot
                self.num_offloaded += 1
            parent = self._frontier.off_device(node, parked=slot is not None)
            if parent is not None and parent not in keep:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if host is not None:
            host.offload([HostCopy(page, slot) for slot, page in run.copies.items()])
        self._refs.subtract(run.released)
        for page in run.released:
            if not self._refs[page]:
                del self._refs[page]
        return self.pool.decref(run.released)  # only now: the copies above read these pages

    def drop_host(self, max_pages: int | None = None, keep: frozenset = frozenset()) -> int:
        """Drop least-recently-used offloaded leaves for good; returns how many."""
        return self._drop_offloaded(max_pages, keep, _Eviction())

    def _host_slot(self, keep: frozenset, run: _Eviction) -> HostSlotId | None:
        if self.host.num_free == 0:
            self._drop_offloaded(1, keep, run)
        return self.host.take() if self.host.num_free else None

    def _drop_offloaded(self, max_pages: int | None, keep: frozenset, run: _Eviction) -> int:
        heap = [(n.last_access, id(n), n) for n in self._frontier.host if n not in keep]
        heapq.heapify(heap)
        dropped = 0
        while heap and (max_pages is None or dropped < max_pages):
            _, _, node = heapq.heappop(heap)
            self._unlink(node)
            self.host.give_back(node.host)
            run.copies.pop(node.host, None)  # parked earlier in this pass: nothing to copy
            node.host = None
            self.num_offloaded -= 1
            dropped += 1
            parent = self._frontier.dropped(node)
            if parent is not None and parent not in keep:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if dropped:
            self.host.dropped(dropped)
        return dropped

    @staticmethod
    def _unlink(node: _IndexNode) -> None:
        del node.parent.children[node.key]
        node.evicted = True

    def _walk_nodes(self) -> Iterator[_IndexNode]:
        # One root for every namespace (a path may cross from BASE into an adapter's), so
        # there are no per-namespace roots to prune once empty.
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(self) -> Iterator[tuple[PageKey, tuple[int, ...], _IndexNode]]:
        """Every entry with the key of its own page (one path may cross from BASE into an
        adapter's namespace) and its whole token prefix."""
        stack = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for key, child in node.children.items():
                path = prefix + key.tokens
                yield key, path, child
                stack.append((child, path))

    def entries(self) -> Iterator[IndexEntry]:
        """Entries on a device page."""
        for key, prefix, node in self._walk():
            if node.page is not None:
                yield IndexEntry(key.namespace, prefix, node.page, key.salt)

    def offloaded_entries(self) -> Iterator[OffloadedEntry]:
        for key, prefix, node in self._walk():
            if node.page is None:
                yield OffloadedEntry(key.namespace, prefix, node.host, key.salt)

    def held_refs(self) -> dict[PageId, int]:
        refs: dict[PageId, int] = {}
        for entry in self.entries():
            refs[entry.page] = refs.get(entry.page, 0) + 1
        return refs

    def check_integrity(self) -> None:
        """Each entry is on a device page or in a host slot, never both; device entries are
        prefix-closed; the counters match; every host slot is held by exactly one entry."""
        device = offloaded = 0
        for node in self._walk_nodes():
            if (node.page is None) == (node.host is None):
                raise AssertionError(f"index entry with page {node.page} and host slot {node.host}")
            if node.page is None:
                offloaded += 1
                if any(c.page is not None for c in node.children.values()):
                    raise AssertionError(f"offloaded entry (slot {node.host}) has a device child")
            else:
                device += 1
        if dict(self._refs) != self.held_refs():
            raise AssertionError("the index's per-page reference counts disagree with its entries")
        if (device, offloaded) != (self._entries, self.num_offloaded):
            raise AssertionError(f"index counts {self._entries} device / {self.num_offloaded} host "
                                 f"entries, holds {device} / {offloaded}")
        self._frontier.check(self._walk_nodes())
        if self.host is not None:
            self.host.check_integrity([e.slot for e in self.offloaded_entries()])
