"""Cascade attention's plan: which items of one backend step read the same leading pages.

Items whose page tables start with the same physical pages (32 agents over one published
context, the residuals of a fork over their trunk, a map-reduce fan-out) can read those
pages once per group: the backend attends the shared prefix for all the group's queries in
one pass, each item's own suffix alone, and merges the two by log-sum-exp. The control
plane owns the page ids, so the grouping is decided here, once per step, and crosses the
protocol as ``SeqWork.shared_prefix`` (ints only). A backend that ignores it stays correct.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from forkserve.backend.protocol import PageId, SeqWork, SharedPrefix


@dataclass(frozen=True)
class PrefixGroup:
    items: tuple[int, ...]  # indices into the step's work list, ascending
    pages: int              # leading pages every member lists and reads


@dataclass(frozen=True)
class PrefixSharing:
    """Strategy: group items by their first page, then keep the members and the prefix
    length that save the most page reads (``(members - 1) * pages``).

    Only pages wholly before an item's first new token count (``start_pos // page_size``):
    those are read, never written, by the step. A page-aligned shared prefix therefore ends
    where a context that ends mid-page was copied on write; the rest is each item's suffix.
    """

    page_size: int
    # A shorter shared prefix saves less than the second launch and the merge cost
    # (ForkServeConfig.shared_prefix_min_tokens); None: no groups.
    min_tokens: int | None = 256
    min_items: int = 2

    @property
    def min_pages(self) -> int | None:
        """Readable pages a row needs to join any group (None: no groups)."""
        return None if self.min_tokens is None else -(-self.min_tokens // self.page_size)

    def groups(self, work: Sequence[SeqWork]) -> tuple[PrefixGroup, ...]:
        return self.groups_of([(item.slots.pages, item.start_pos) for item in work])

    def groups_of(self, rows: Sequence[tuple[Sequence[PageId], int]]) -> tuple[PrefixGroup, ...]:
        """``groups`` over (pages, start position) rows: a step's ``SeqWork`` items and the
        rows of its ``DecodeBatch``, numbered together."""
        min_pages = self.min_pages
        if min_pages is None:
            return ()
        p = self.page_size
        readable = [min(len(pages), start // p) for pages, start in rows]
        by_first: dict[int, list[int]] = {}
        for i, (pages, _) in enumerate(rows):
            if readable[i] >= min_pages:
                by_first.setdefault(pages[0], []).append(i)
        groups = []
        for items in by_first.values():
            if len(items) < self.min_items:
                continue
            common = sorted(zip(self._commons(rows, readable, items[0], items[1:]), items[1:],
                                strict=True), reverse=True)
            best_k, best_saved = 0, 0
            # k followers share `pages` with the lead
            for k, (pages, _) in enumerate(common, start=1):
                if k + 1 >= self.min_items and pages >= min_pages and k * pages > best_saved:
                    best_k, best_saved = k, k * pages
            if best_k:
                members = (items[0], *(i for _, i in common[:best_k]))
                groups.append(PrefixGroup(tuple(sorted(members)), common[best_k - 1][0]))
        return tuple(sorted(groups, key=lambda g: g.items[0]))

    def annotate(self, work: Sequence[SeqWork]) -> list[SeqWork]:
        """``work`` with ``shared_prefix`` set on every grouped item (others unchanged)."""
        return marked(work, self.marks([(item.slots.pages, item.start_pos) for item in work]))

    def marks(self, rows: Sequence[tuple[Sequence[PageId], int]]) -> list[SharedPrefix | None]:
        """Each row's ``SharedPrefix`` (None: it reads alone)."""
        out: list[SharedPrefix | None] = [None] * len(rows)
        for number, group in enumerate(self.groups_of(rows)):
            mark = SharedPrefix(number, group.pages)
            for i in group.items:
                out[i] = mark
        return out

    def _commons(self, rows: Sequence[tuple[Sequence[PageId], int]], readable: Sequence[int],
                 lead: int, others: Sequence[int]) -> list[int]:
        """How many readable leading pages each of ``others`` shares with ``lead`` (indices
        into ``rows``; ``readable``: each row's pages wholly before its first new token)."""
        first = rows[lead][0]
        n_lead = readable[lead]
        if not isinstance(first, np.ndarray):
            return [_common(first, rows[i][0], min(n_lead, readable[i])) for i in others]
        # Numpy rows (steady decode): the lead's bytes once per length, each other row's
        # compared with them in C; a row that differs (or is not numpy) takes ``_common``.
        lead_bytes: dict[int, bytes] = {}
        out = []
        for i in others:
            pages, n = rows[i][0], min(n_lead, readable[i])
            if isinstance(pages, np.ndarray) and pages.dtype == first.dtype:
                mine = lead_bytes.get(n)
                if mine is None:
                    mine = lead_bytes[n] = first[:n].tobytes()
                if pages[:n].tobytes() == mine:
                    out.append(n)
                    continue
            out.append(_common(first, pages, n))
        return out


def _common(pa: Sequence[PageId], pb: Sequence[PageId], n: int) -> int:
    """Leading entries of ``pa`` and ``pb`` that are equal, of their first ``n``. The usual
    case (equal) is compared in C: tuples (items) as tuples, numpy rows (steady decode,
    engine/page_row.py) as their bytes (a member joining regroups the whole set)."""
    pa, pb = pa[:n], pb[:n]
    if isinstance(pa, tuple) and isinstance(pb, tuple):
        if pa == pb:
            return n
        return next(k for k in range(n) if pa[k] != pb[k])
    a, b = np.asarray(pa), np.asarray(pb)
    if a.dtype == b.dtype and a.tobytes() == b.tobytes():
        return n
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if len(differ) else n


def marked(work: Sequence[SeqWork], marks: Sequence[SharedPrefix | None]) -> list[SeqWork]:
    """``work`` with each item's mark set (items without one unchanged)."""
    return [item if mark is None else dataclasses.replace(item, shared_prefix=mark)
            for item, mark in zip(work, marks, strict=True)]
