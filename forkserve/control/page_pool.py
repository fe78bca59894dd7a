"""PagePool: a fixed set of KV pages of one kind, refcounted.

Ownership: a page id returned by ``alloc`` carries one reference, owned by the caller.
Every holder (a node's PageTable, the prefix index) owns exactly one reference per page
it lists, takes it with ``incref`` and gives it back with ``decref``; the page returns to
the free list when its last reference goes. The pool never frees a referenced page.
"""
from __future__ import annotations

from collections.abc import Mapping

from forkserve.backend.protocol import PageId, PageKind
from forkserve.errors import OutOfPagesError


class PagePool:
    def __init__(self, kind: PageKind, num_pages: int, page_size: int) -> None:
        self.kind = kind
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # Pop from the end: low ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: PageId) -> int:
        return self._refs[page]

    def held_only(self, held: Mapping[PageId, int]) -> int:
        """Pages of ``held`` (a holder's references per page) that no one else references.
        One pass over ``held`` reading the counts in place: the adaptive layout asks at every
        form it chooses (``PrefixIndex.num_cache_only``), over every page the index holds."""
        refs = self._refs
        return sum(1 for page, n in held.items() if refs[page] == n)

    def alloc(self, n: int) -> list[PageId]:
        if n > len(self._free):
            raise OutOfPagesError(
                f"{self.kind.value} pool: need {n} pages, {len(self._free)} of {self.num_pages} "
                "free")
        free = self._free
        # What n pops would return (the end of the free list, last first), cut in C.
        pages = free[len(free) - n:]
        pages.reverse()
        del free[len(free) - n:]
        refs = self._refs
        for p in pages:
            refs[p] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"incref of free page {p} in {self.kind.value} pool")
            self._refs[p] += 1

    def decref(self, pages) -> int:
        """Drop one reference per page; returns how many pages became free."""
        freed = 0
        for p in pages:
            if self._refs[p] <= 0:
                raise AssertionError(f"decref of free page {p} in {self.kind.value} pool")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def check_integrity(self, expected_refs: dict[PageId, int]) -> None:
        """Every page is free or referenced, and refcounts equal the holders' count exactly."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.kind.value} pool: duplicate page in free list")
        for page in range(self.num_pages):
            refs = self._refs[page]
            if refs < 0:
                raise AssertionError(f"page {page}: negative refcount {refs}")
            want = expected_refs.get(page, 0)
            if refs != want:
                raise AssertionError(f"{self.kind.value} page {page}: refcount {refs}, "
                                     f"holders {want}")
            if (refs == 0) != (page in free):
                raise AssertionError(f"{self.kind.value} page {page}: refcount {refs} but "
                                     f"free={page in free}")
