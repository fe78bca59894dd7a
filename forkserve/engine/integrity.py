"""``check_integrity``: the Engine's invariants over every session's tables, the pools and
the prefix trees, checked exactly (tests and the fault machines call it after every op).

Refcounts equal holders; every live node's tables hold as many pages as their lengths need
and no more than the node's end; aborted nodes hold nothing; each tip is committed with its
table; and, where the backend can tell (``first_unwritten``), no table or published page
claims a position no step wrote. Reads only; the caller settles any step in flight first.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from forkserve.backend.protocol import PageId, PageKind
from forkserve.control.context_tree import NodeState
from forkserve.control.kv_cache import KVCache
from forkserve.control.page_table import PageTable
from forkserve.engine.session import Session

# ``Backend.first_unwritten``: the first position of ``length`` over ``pages`` no step wrote.
FirstUnwritten = Callable[[PageKind, Sequence[PageId], int], int | None]


def check_integrity(sessions: Iterable[Session], kv: KVCache,
                    first_unwritten: FirstUnwritten | None) -> None:
    tables: list[PageTable] = []
    p = kv.pool.page_size
    for session in sessions:
        for node in session.tree.nodes.values():
            if node.table is None:
                continue
            if node.state is NodeState.ABORTED:
                raise AssertionError(f"aborted node {node.id} still holds pages")
            for t in node.table.tables():
                if len(t.pages) != -(-t.length // p) or t.length > node.end:
                    raise AssertionError(f"node {node.id}: {len(t.pages)} {t.pool.kind.value} "
                                         f"pages for {t.length} tokens (end {node.end})")
                tables.append(t)
        tip = session.tree.tip
        if tip.state is not NodeState.COMMITTED or tip.table is None:
            raise AssertionError(f"session {session.id}: tip {tip.id} lost its table")
    kv.check_integrity(tables)
    if first_unwritten is not None:
        _check_written(tables, kv, first_unwritten)


def _check_written(tables: list[PageTable], kv: KVCache, first_unwritten: FirstUnwritten) -> None:
    """A table never runs ahead of its KV; a published page is wholly written."""
    for t in tables:
        pos = first_unwritten(t.pool.kind, t.pages, t.length)
        if pos is not None:
            raise AssertionError(f"a {t.pool.kind.value} table claims {t.length} tokens but "
                                 f"position {pos} was never written")
    for pool in kv.pools():
        for entry in kv.index_of(pool).entries():
            pos = first_unwritten(pool.kind, [entry.page], pool.page_size)
            if pos is not None:
                raise AssertionError(f"published {pool.kind.value} page {entry.page} has "
                                     f"unwritten slot {pos}")
