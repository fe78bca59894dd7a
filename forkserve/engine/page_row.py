"""PageRow: one steady-decode member's page table as a growing numpy buffer (issue 21).

A ``DecodeBatch`` row lists a session's pages. A tuple of them (``PageTable.frozen()``) has
to be copied whole whenever the table gains a page, and in steady decode every member gains
one on the same tick (every ``page_size`` tokens): O(members x context pages) on that tick,
plus one large container per member for the garbage collector. The row keeps its own copy
of the table's page ids in a buffer with spare capacity, appends the new page in place and
hands out a read-only view of the listed prefix: O(1) per member per boundary.

Ownership: values only; the table still owns its pages. The buffer follows the table
(``follow``) after each change the steady set makes (a page appended at a boundary, one
given back by ``unprepare``); any other change takes the session out of the set first. A
view handed to a step stays valid for that step: later appends write past its end, and a
buffer that grows is a new array (the old one lives on in the views that read it).
"""
from __future__ import annotations

import numpy as np

from forkserve.control.page_table import PageTable


class PageRow:
    __slots__ = ("_buf", "_read_only", "_n", "view")

    def __init__(self, table: PageTable) -> None:
        self._n = -1
        self._grow(np.empty(0, dtype=np.int64))
        self.follow(table)

    def _grow(self, buf: np.ndarray) -> None:
        self._buf = buf
        # Views sliced from a read-only view are read-only: flagged once per buffer, not per view.
        self._read_only = buf.view()
        self._read_only.flags.writeable = False

    def follow(self, table: PageTable) -> None:
        """Catch up with ``table``: its last page appended, pages cut, or (anything else,
        at admission) copied once."""
        pages = table.pages
        n = len(pages)
        if n == self._n:
            return
        if n == self._n + 1 and n <= len(self._buf):
            self._buf[n - 1] = pages[-1]
        elif n > self._n:
            # Twice the room the table needs, so appends stay in place for as long again.
            buf = np.empty(max(16, 2 * n), dtype=np.int64)
            buf[:n] = pages
            self._grow(buf)
        # n < self._n: pages cut off the end; the ids before the cut are unchanged.
        self._n = n
        self.view = self._read_only[:n]
