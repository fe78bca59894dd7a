"""NodeKV: the page tables of one node, one per page kind it uses.

Unified and full_reuse layouts use one table of UNIFIED pages. The disaggregated layout
(ForkKV) pairs a BASE table (shared across adapters) with a RESIDUAL table (this adapter's
rank-r pages). The two may reach different lengths: a cross-adapter fork aliases the
trunk's base pages but has no residual for it yet; a partial prefix hit may find one side
published and not the other. KV is valid up to ``length`` (the shorter side); positions
where only one side exists are filled by writing the other side alone (``regime``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from forkserve.backend.protocol import KVSlots, PageId
from forkserve.control.page_pool import PagePool
from forkserve.control.page_table import CopyPages, PageTable
from forkserve.control.prefix_index import UNSALTED, CacheSalt


@dataclass(frozen=True)
class Regime:
    """What the next write from ``length`` may cover and which sides it writes."""

    max_tokens: int | None  # None: unbounded (both sides end at ``length``)
    write_base: bool
    write_residual: bool


_BOTH_SIDES = Regime(None, True, True)  # the steady state: one shared value, not one per call


class NodeKV:
    def __init__(self, base: PageTable, residual: PageTable | None = None,
                 adapter_start: int | None = None, salt: CacheSalt = UNSALTED) -> None:
        self.base = base
        self.residual = residual
        # The activation point the KV was written under (``AdapterNamespace.adapter_start``):
        # None the base model everywhere, 0 a plain adapter, else an aLoRA's invocation start.
        self.adapter_start = adapter_start
        # The trust boundary of the session these tables belong to, fixed at open and kept
        # by every fork: what they match and publish in the prefix index (``KVCache.keys``).
        self.salt = salt

    @property
    def length(self) -> int:
        if self.residual is None:
            return self.base.length
        return min(self.base.length, self.residual.length)

    @property
    def pages(self) -> list[PageId]:
        return self.base.pages

    def tables(self) -> Iterator[PageTable]:
        yield self.base
        if self.residual is not None:
            yield self.residual

    def slots(self) -> KVSlots:
        res = self.residual.frozen() if self.residual is not None else None
        return KVSlots(self.base.frozen(), res)

    def fork(self, adapter_start: int | None) -> "NodeKV":
        return NodeKV(self.base.fork(), self.residual.fork() if self.residual is not None else None,
                      adapter_start, self.salt)

    def fork_base(self, residual_pool: PagePool | None, adapter_start: int | None) -> "NodeKV":
        """Alias the base pages only, with an empty residual (a fork to another adapter)."""
        return NodeKV(self.base.fork(),
                      PageTable(residual_pool) if residual_pool is not None else None,
                      adapter_start, self.salt)

    def regime(self) -> Regime:
        if self.residual is None or self.base.length == self.residual.length:
            return _BOTH_SIDES
        if self.base.length > self.residual.length:
            return Regime(self.base.length - self.residual.length, False, True)
        return Regime(self.residual.length - self.base.length, True, False)

    def pages_needed(self, n_new: int) -> dict[PagePool, int]:
        end = self.length + n_new
        return {t.pool: t.pages_needed(end - t.length) for t in self.tables() if end > t.length}

    def prepare_write(self, n_new: int, copy_pages: CopyPages) -> None:
        """Make the pages for [length, length + n_new) writable on every side that lacks them."""
        end = self.length + n_new
        for t in self.tables():
            if end > t.length:
                t.prepare_write(end - t.length, copy_pages)

    def truncate(self, n_tokens: int) -> None:
        for t in self.tables():
            t.truncate(n_tokens)

    def lengths(self) -> tuple[int, ...]:
        """Each side's length: the point ``rollback`` returns to if a write fails."""
        return tuple(t.length for t in self.tables())

    def rollback(self, lengths: tuple[int, ...]) -> None:
        """Undo a ``prepare_write`` whose step did not run: each side back to its length
        (pages past it go back to the pool; a copy-on-write page stays, holding the same KV)."""
        for t, n in zip(self.tables(), lengths, strict=True):
            t.truncate(n)

    def attach(self, base_pages: Sequence[PageId], residual_pages: Sequence[PageId] | None,
               limit_tokens: int) -> None:
        """Alias published pages (identical KV) past what each side already holds."""
        for table, pages in ((self.base, base_pages), (self.residual, residual_pages)):
            if table is not None and pages is not None:
                table.attach(pages, limit_tokens)

    def release(self) -> None:
        for t in self.tables():
            t.release()
