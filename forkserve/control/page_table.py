"""PageTable: the pages one node's KV lives in, in position order.

A table owns one pool reference per listed page. ``fork`` is the seed's two-word copy:
the list and the length, plus one incref per page. Writes go through ``prepare_write``,
which copies a shared partial last page first (copy-on-write) and allocates only the
pages the new tokens need, so a fork never pays for its trunk.

``pages`` is read by everyone and changed only by this class's methods: each change drops
the cached tuple ``frozen()`` hands to ``KVSlots``, so a decode step that adds no page reuses
the same tuple instead of copying the whole table again (O(1) per session per tick).
"""
from __future__ import annotations

from typing import Callable, Sequence

from forkserve.backend.protocol import PageId, PageKind
from forkserve.control.page_pool import PagePool

# The backend's ``copy_pages``: the table names its own pool's kind.
CopyPages = Callable[[PageKind, Sequence[tuple[PageId, PageId]]], None]


class PageTable:
    def __init__(self, pool: PagePool, pages: list[PageId] | None = None, length: int = 0) -> None:
        self.pool = pool
        self.pages: list[PageId] = pages if pages is not None else []
        # Tokens whose KV is (or is being) written through this table.
        self.length = length
        self._frozen: tuple[PageId, ...] | None = None

    def frozen(self) -> tuple[PageId, ...]:
        """``pages`` as a tuple, rebuilt only after the list changed."""
        if self._frozen is None:
            self._frozen = tuple(self.pages)
        return self._frozen

    def fork(self) -> "PageTable":
        self.pool.incref(self.pages)
        return PageTable(self.pool, list(self.pages), self.length)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.pool.page_size)

    def pages_needed(self, n_new: int) -> int:
        """Pages a write of ``n_new`` tokens would allocate (CoW copy included)."""
        p = self.pool.page_size
        cow = 1 if self.length % p and self.pool.refcount(self.pages[-1]) > 1 else 0
        return self.pages_for(self.length + n_new) - len(self.pages) + cow

    def prepare_write(self, n_new: int, copy_pages: CopyPages) -> None:
        """Make pages for positions [length, length + n_new) exclusively ours."""
        p = self.pool.page_size
        if self.length % p and self.pool.refcount(self.pages[-1]) > 1:
            (fresh,) = self.pool.alloc(1)
            copy_pages(self.pool.kind, [(self.pages[-1], fresh)])
            self.pool.decref([self.pages[-1]])
            self.pages[-1] = fresh
            self._frozen = None
        extra = self.pages_for(self.length + n_new) - len(self.pages)
        if extra > 0:
            self.pages.extend(self.pool.alloc(extra))
            self._frozen = None
        self.length += n_new

    def grow(self, page: PageId) -> None:
        """``prepare_write(1)`` at a page boundary, with the page already allocated for this
        table (its reference becomes the table's): the steady-decode set allocates the
        pages of all its members' boundaries in one ``alloc``."""
        assert self.length == len(self.pages) * self.pool.page_size, "grow only at a boundary"
        self.pages.append(page)
        self._frozen = None
        self.length += 1

    def truncate(self, n_tokens: int) -> None:
        """Keep positions [0, n_tokens); pages past them go back to the pool."""
        keep = self.pages_for(n_tokens)
        if keep < len(self.pages):
            self.pool.decref(self.pages[keep:])
            del self.pages[keep:]
            self._frozen = None
        self.length = min(self.length, n_tokens)

    def attach(self, pages: Sequence[PageId], limit_tokens: int) -> None:
        """Alias published pages (identical KV) past what this table already holds."""
        p = self.pool.page_size
        for i in range(self.length // p, len(pages)):
            self.replace_page(i, pages[i])
        self.length = max(self.length, min(len(pages) * p, limit_tokens))

    def replace_page(self, index: int, page: PageId) -> None:
        """Swap in a page already holding identical KV (a prefix-index hit); takes a reference."""
        self.pool.incref([page])
        self._frozen = None
        if index < len(self.pages):
            self.pool.decref([self.pages[index]])
            self.pages[index] = page
        else:
            assert index == len(self.pages), "index pages attach in order"
            self.pages.append(page)

    def release(self) -> None:
        self.pool.decref(self.pages)
        self.pages = []
        self._frozen = None
        self.length = 0
