"""PrefixIndex: the global index of committed full pages (the base side of the DualRadixTree).

A radix tree with one edge per page. An edge is keyed by a typed ``PageKey``: the page's
token ids and the ``Namespace`` of what computed its KV (the base model, or one adapter
version from one activation point): never a string glued from tokens, so two different
prefixes cannot collide. A path from the root spells a committed token prefix, page by
page. A path may start under BASE and continue under an adapter: an activated LoRA's
pages before its invocation are the base model's (``base_pages``), shared with base-model
sessions and other aLoRAs over the same prefix.

Ownership: the index holds one pool reference per published page, taken in ``insert``
and given back in ``evict``. Only committed tokens are inserted (the engine's commit,
root prefill and close paths); speculative pages never are. ``match`` hands back page
ids without taking references: the caller increfs what it keeps.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from forkserve.backend.protocol import PageId
from forkserve.control.page_pool import PagePool


@dataclass(frozen=True)
class BaseNamespace:
    """Pages computed by the base model (or shared across adapters)."""


@dataclass(frozen=True)
class AdapterNamespace:
    """Pages whose contents depend on one adapter version, applied from ``adapter_start``
    (0: a plain LoRA; an aLoRA's activation point; None: an aLoRA not invoked on the path)."""

    adapter_id: str
    adapter_version: int = 0
    adapter_start: int | None = 0


Namespace = BaseNamespace | AdapterNamespace
BASE = BaseNamespace()


@dataclass(frozen=True)
class PageKey:
    tokens: tuple[int, ...]
    namespace: "Namespace" = BASE


@dataclass(eq=False)
class _IndexNode:
    key: PageKey | None
    page: PageId | None
    parent: "_IndexNode | None"
    children: dict[PageKey, "_IndexNode"] = field(default_factory=dict)
    last_access: int = 0
    evicted: bool = False


@dataclass(frozen=True)
class InsertCursor:
    """Where a publisher's last insert ended, so the next one hashes only the new pages.

    Valid while its node is in the tree and the keys are namespaced the same way; otherwise
    it is ignored.
    """

    namespace: "Namespace"
    base_pages: int
    node: _IndexNode
    pages: int


@dataclass(frozen=True)
class IndexEntry:
    namespace: Namespace
    prefix: tuple[int, ...]  # every token up to and including this page
    page: PageId


class PrefixIndex:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._root = _IndexNode(None, None, None)
        self._clock = itertools.count(1)
        self.num_pages = 0

    def _page_keys(self, namespace: Namespace, tokens: Sequence[int], base_pages: int,
                   first_page: int = 0) -> Iterator[PageKey]:
        p = self.page_size
        for start in range(first_page * p, len(tokens) - p + 1, p):
            yield PageKey(tuple(tokens[start:start + p]), BASE if start < base_pages * p else namespace)

    def match(self, namespace: Namespace, tokens: Sequence[int], base_pages: int = 0) -> list[PageId]:
        """Pages of the longest published page-aligned prefix of ``tokens``; the first
        ``base_pages`` pages are keyed under BASE, the rest under ``namespace``."""
        node = self._root
        pages: list[PageId] = []
        now = next(self._clock)
        for key in self._page_keys(namespace, tokens, base_pages):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            pages.append(node.page)
        return pages

    def insert(self, namespace: Namespace, tokens: Sequence[int], pages: Sequence[PageId],
               resume: InsertCursor | None = None, base_pages: int = 0) -> InsertCursor:
        """Publish the full pages of a committed prefix; returns a cursor for the next call.

        Where a page for the same prefix is already published, the index keeps its own
        and the caller's stays private (both hold identical KV). With a valid ``resume``
        from an earlier insert of a prefix of ``tokens``, only the pages after it are walked.
        ``base_pages`` as in ``match``.
        """
        node = self._root
        first = 0
        # The walked pages must have been keyed as they would be now (BASE up to the same page).
        if (resume is not None and resume.namespace == namespace and not resume.node.evicted
                and min(resume.pages, resume.base_pages) == min(resume.pages, base_pages)
                and resume.pages <= len(pages)):
            node, first = resume.node, resume.pages
        now = next(self._clock)
        added = 0
        for key, page in zip(self._page_keys(namespace, tokens, base_pages, first), pages[first:],
                             strict=False):
            child = node.children.get(key)
            if child is None:
                self.pool.incref([page])
                child = _IndexNode(key, page, node)
                node.children[key] = child
                added += 1
            child.last_access = now
            node = child
            first += 1
        self.num_pages += added
        return InsertCursor(namespace, base_pages, node, first)

    def evict(self, max_pages: int | None = None) -> int:
        """Free least-recently-used leaf pages that nobody but the index holds."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and (max_pages is None or freed < max_pages):
            _, _, leaf = heapq.heappop(heap)
            if self.pool.refcount(leaf.page) != 1:
                continue  # a live table still reads it; evicting would not free memory
            parent = leaf.parent
            del parent.children[leaf.key]
            leaf.evicted = True
            freed += self.pool.decref([leaf.page])
            self.num_pages -= 1
            if parent.page is not None and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> Iterator[_IndexNode]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.page is not None and not node.children:
                yield node
            stack.extend(node.children.values())

    def entries(self) -> Iterator[IndexEntry]:
        stack = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for key, child in node.children.items():
                path = prefix + key.tokens
                yield IndexEntry(key.namespace, path, child.page)
                stack.append((child, path))

    def held_refs(self) -> dict[PageId, int]:
        refs: dict[PageId, int] = {}
        for entry in self.entries():
            refs[entry.page] = refs.get(entry.page, 0) + 1
        return refs
