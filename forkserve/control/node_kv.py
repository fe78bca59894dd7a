"""NodeKV: the page tables of one node, one per page kind it uses.

Unified and full_reuse layouts use one table of UNIFIED pages. The disaggregated layout
(ForkKV) pairs a BASE table (shared across adapters) with a RESIDUAL table (this adapter's
rank-r pages); both cover the same positions, so they fork, grow, truncate and release
together. A node without an adapter has no residual table.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from forkserve.backend.protocol import KVSlots, PageId, PageKind
from forkserve.control.page_pool import PagePool
from forkserve.control.page_table import PageTable

CopyPagesOfKind = Callable[[PageKind, Sequence[tuple[PageId, PageId]]], None]


class NodeKV:
    def __init__(self, base: PageTable, residual: PageTable | None = None) -> None:
        self.base = base
        self.residual = residual

    @property
    def length(self) -> int:
        return self.base.length

    @property
    def pages(self) -> list[PageId]:
        return self.base.pages

    def tables(self) -> Iterator[PageTable]:
        yield self.base
        if self.residual is not None:
            yield self.residual

    def slots(self) -> KVSlots:
        res = tuple(self.residual.pages) if self.residual is not None else None
        return KVSlots(tuple(self.base.pages), res)

    def fork(self) -> "NodeKV":
        return NodeKV(self.base.fork(), self.residual.fork() if self.residual is not None else None)

    def pages_needed(self, n_new: int) -> dict[PagePool, int]:
        return {t.pool: t.pages_needed(n_new) for t in self.tables()}

    def prepare_write(self, n_new: int, copy_pages: CopyPagesOfKind) -> None:
        for t in self.tables():
            t.prepare_write(n_new, lambda pairs, kind=t.pool.kind: copy_pages(kind, pairs))

    def truncate(self, n_tokens: int) -> None:
        for t in self.tables():
            t.truncate(n_tokens)

    def attach(self, base_pages: Sequence[PageId], residual_pages: Sequence[PageId] | None,
               limit_tokens: int) -> None:
        """Alias published pages (identical KV) for positions past what is written."""
        n = len(base_pages) if residual_pages is None else min(len(base_pages), len(residual_pages))
        first = self.base.length // self.base.pool.page_size
        for table, pages in ((self.base, base_pages), (self.residual, residual_pages)):
            if table is None:
                continue
            for i in range(first, n):
                table.replace_page(i, pages[i])
            table.length = max(table.length, min(n * table.pool.page_size, limit_tokens))

    def release(self) -> None:
        for t in self.tables():
            t.release()
