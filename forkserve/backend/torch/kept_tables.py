"""KeptTables: the page tables and cascade plan of steady rows, kept from launch to launch.

A launch of steady rows (``decode_rows.of_batch``) needs each row's pages as a padded
``[B, width]`` table, the cascade groups checked against it (members list their lead's
first pages) and the groups as tiles (``cascade.plan``). Built from scratch every step
these were three passes over every page id of every row (~8 ms at 512 rows over 8K),
although they change only when a row joins, leaves or gains a page: the steady set hands
the same page-row object again for a row whose pages did not change, and the same marks
tuple while its groups stand (``DecodeBatch``: "repeated objects"). So the last launch's
are kept and keyed on those objects; a row whose page object is new (it gained a page, or
a new member took its place) is checked and written alone, into a copy (where most rows
are, a fresh table is built): a kept table is never written once handed out, so an earlier
step's ``DecodeRows`` stay as they were.
Decode items (``decode_rows.of_items``: a graph's step of ``SeqWork``s) keep their tables the
same way, keyed on each item's page tuple (``PageTable.frozen`` hands a sequence the same
one while its pages stand), and have their page ids checked there.

Everything refused here is refused as a fresh build would refuse it (the caller runs the
rows as items and validation names the row); ``tests/torch/test_kept_tables.py`` checks the
kept table and plan equal fresh ones through joins, leaves and page boundaries.

Ownership: the kept objects hold references to the last batch's page rows and marks (so
identity cannot be reused by another object); the arrays handed out are read-only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from forkserve.backend.protocol import SharedPrefix
from forkserve.backend.torch import cascade as cascade_tiles


@dataclass(frozen=True)
class _Table:
    rows: tuple                    # the page sequences it was built from (identity: the key)
    used: np.ndarray               # pages read per row
    present: np.ndarray | None     # the rows that list pages (None: all)
    table: np.ndarray              # [B, width], read-only


class KeptTable:
    """One side's table (UNIFIED or BASE pages, or RESIDUAL): ``build`` returns the padded
    table of ``pages``, reusing the last one's rows whose page object is the same."""

    def __init__(self) -> None:
        self._last: _Table | None = None
        # What the last build changed: (the table it started from, the rows it rewrote), or
        # None when it built every row.
        self.changed: tuple[np.ndarray, np.ndarray] | None = None

    def build(self, pages: tuple, used: np.ndarray, present: np.ndarray | None, limit: int,
              scratch: int) -> np.ndarray | None:
        """Each row's first ``used`` page ids (of the rows ``present`` marks; all when None)
        padded with ``scratch``; None if a row lists too few pages or one outside [0, limit)."""
        last = self._last
        moved = None  # the rows to write again; None: all, in a fresh table
        if last is not None and len(last.rows) == len(pages) and _same_mask(last.present, present):
            changed = used != last.used
            if pages is not last.rows:  # else no row changed: a tuple the set kept
                changed |= np.fromiter(map(_is_not, pages, last.rows), bool, len(pages))
            moved = changed.nonzero()[0]
            # A fresh table where the width changed or most rows moved: a row rewritten alone
            # costs up to ~4x its share of a fresh table, whose fixed cost is ~3 rows' (items
            # that repeat no page tuple would otherwise rewrite every row, one by one).
            if len(moved) and (len(moved) > 3 + len(pages) // 2
                               or last.table.shape[1] != used.max()):
                moved = None
        if moved is None:
            table = _table(pages, used, present, limit, scratch)
            self.changed = None
        else:
            table = last.table if not len(moved) else _rewrite(last.table, pages, used, moved,
                                                              limit, scratch)
            self.changed = (last.table, moved)
        if table is None:
            self._last = None
            return None
        table.flags.writeable = False
        self._last = _Table(pages, used, present, table)
        return table


def _is_not(a: object, b: object) -> bool:
    return a is not b


def _same_mask(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def _rewrite(kept: np.ndarray, pages: tuple, used: np.ndarray, rows: np.ndarray, limit: int,
             scratch: int) -> np.ndarray | None:
    """A copy of ``kept`` with ``rows`` written afresh; None as ``_table`` refuses."""
    table = kept.copy()
    for i in rows.tolist():
        listed, need = pages[i], int(used[i])
        if listed is None:
            continue  # a row without pages on this side keeps its padding
        if len(listed) < need:
            return None
        row = np.asarray(listed[:need], dtype=np.int64)
        if need and (row.min() < 0 or row.max() >= limit):
            return None
        table[i, :need] = row
        table[i, need:] = scratch
    return table


def _table(pages: Sequence[Sequence[int] | None], used: np.ndarray, present: np.ndarray | None,
           limit: int, scratch: int) -> np.ndarray | None:
    """Each row's first ``used`` page ids (of the rows ``present`` marks; all when None) in a
    table padded with ``scratch``; None if a row lists too few pages or one outside [0, limit)."""
    n, width = len(used), int(used.max())
    table = np.full((n, width), scratch, dtype=np.int64)
    if present is not None:
        if not present.any():
            return table
        listed = [pages[i] for i in np.flatnonzero(present).tolist()]
        need = used[present]
    else:
        listed, need = list(pages), used
    lengths = np.fromiter(map(len, listed), np.int64, len(listed))
    if (lengths < need).any():
        return None
    # The common case lists exactly the pages a row reads (a steady row's page view).
    cut = (listed if np.array_equal(lengths, need)
           else [r[:u] for r, u in zip(listed, need.tolist(), strict=True)])
    # Items' page tuples convert id by id either way; fromiter skips concatenate's array per
    # tuple (half its time at 64 rows).
    flat = (np.fromiter(itertools.chain.from_iterable(cut), np.int64, int(need.sum()))
            if isinstance(cut[0], tuple) else np.concatenate(cut).astype(np.int64, copy=False))
    if flat.min() < 0 or flat.max() >= limit:
        return None
    mask = np.arange(width) < used[:, None]
    if present is not None:
        mask &= present[:, None]
    table[mask] = flat  # row-major, as the rows were joined
    return table


@dataclass(frozen=True)
class _Groups:
    """What a marks tuple says, computed once per tuple."""

    marks: tuple[SharedPrefix | None, ...]
    well_formed: bool              # each group's members claim one page count, none negative
    groups: tuple[tuple[np.ndarray, int], ...]  # (members, pages) per group with pages > 0
    keys: np.ndarray               # each row's claimed prefix in keys (0 outside a group)
    plan: cascade_tiles.CascadePlan | None


class KeptGroups:
    """The cascade groups of the last marks: their check against a table
    (``cascade.check_groups`` on the columns) and their tiles."""

    def __init__(self, page_size: int, agents: int) -> None:
        self.page_size, self.agents = page_size, agents
        self._groups: _Groups | None = None
        # The last table the groups were found to agree with.
        self._agreed: np.ndarray | None = None

    def _of(self, marks: tuple[SharedPrefix | None, ...]) -> _Groups:
        if self._groups is None or self._groups.marks is not marks:
            self._groups = _groups_of(marks, self.page_size, self.agents)
            self._agreed = None
        return self._groups

    def plan(self, marks: tuple[SharedPrefix | None, ...]) -> cascade_tiles.CascadePlan | None:
        return self._of(marks).plan

    def agree(self, marks: tuple[SharedPrefix | None, ...], table: np.ndarray,
              changed: tuple[np.ndarray, np.ndarray] | None, positions: np.ndarray) -> bool:
        """A group's members list its lead's (first member's) page count and page ids, all
        before their new token. ``changed``: ``KeptTable.changed`` of ``table``."""
        g = self._of(marks)
        if not g.well_formed or (positions < g.keys).any():
            return False
        if self._agreed is table:
            return True
        moved = None  # None: every row is new to the check
        if self._agreed is not None and changed is not None and self._agreed is changed[0]:
            moved = np.zeros(len(table), dtype=bool)
            moved[changed[1]] = True
        for members, k in g.groups:
            lead = members[0]
            # Rows not rewritten since the table found to agree still list its prefix: with
            # the lead among them, only the rewritten ones are compared with it.
            rows = members if moved is None or moved[lead] else members[moved[members]]
            if len(rows) and (table[rows, :k] != table[lead, :k]).any():
                return False
        self._agreed = table
        return True


def _groups_of(marks: tuple[SharedPrefix | None, ...], page_size: int, agents: int) -> _Groups:
    members: dict[int, list[int]] = {}
    for i, mark in enumerate(marks):
        if mark is not None:
            members.setdefault(mark.group, []).append(i)
    keys = np.zeros(len(marks), dtype=np.int64)
    groups = []
    well_formed = True
    for rows in members.values():
        k = marks[rows[0]].pages
        if k < 0 or any(marks[i].pages != k for i in rows):
            well_formed = False
        keys[rows] = k * page_size
        if k > 0:
            groups.append((np.array(rows), k))
    return _Groups(marks, well_formed, tuple(groups), keys,
                   cascade_tiles.plan(marks, page_size, agents))


class KeptTables:
    """What a backend keeps of its last launch of steady rows: both sides' tables and the
    cascade groups."""

    def __init__(self, page_size: int, agents: int) -> None:
        self.pages, self.residual = KeptTable(), KeptTable()
        self.groups = KeptGroups(page_size, agents)
