"""SteadyDecode: the sessions in plain steady decode, kept from tick to tick (issue 21).

A session is *steady* when all a tick has to do for it is one decode step of its committed
tip: it is generating, its last sampled token waits to be written, it has no speculative
node, no verb in flight, both sides of its KV at one length, and (an aLoRA) its activation
point on the whole path is its table's. For those sessions the general path (a ``Demand``, a
``Grant``, ``pages_needed``/``prepare_write``, a ``SeqWork`` with its ``KVSlots``, ``_apply``,
``emit``) always does the same thing; the set does it with a few attribute writes per session
and hands the backend one ``DecodeBatch`` of columns.

Membership is decided once (``admit``, after a general-path step left the session in that
state) and lost at anything unusual, after which the general path takes the session again:
a verb on it (``Engine`` calls ``drop``), the end of its generation, a stop token or an
aLoRA's sampled token that may end an invocation (``SteadyRow.exits``), a page boundary the
pools cannot serve even after evicting their indexes, a last page someone else references, a
failed step (its rows become ordinary items, rolled back one by one).
``clear`` drops all (a tick whose decode slots or token budget would not grant every session).

Ownership: the set holds references to sessions, their tip nodes and the tips' tables; it
owns no page and no token. Pages are still allocated into, and owned by, the tip's
``PageTable``s exactly as ``prepare_write`` would, so ``Engine.check_integrity`` sees the
same state either path would leave. The column tuples it caches are rebuilt when a member
joins or leaves (static columns) or a member's table gains a page (the page column: each
member's ``PageRow`` view, appended in place); the cascade groups when a member joins or
leaves (a boundary cannot move them, ``prepare``). The positions column is the last one plus
one, in C (every member moves one position per ``prepare``), and the written tokens are what
the last ``apply`` took: rebuilt row by row only after a join, a leave or an ``unprepare``.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, KeysView, Sequence

import numpy as np

from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import SamplingParams, SharedPrefix
from forkserve.backend.step_handle import StepHandle
from forkserve.control.context_tree import Node, NodeState
from forkserve.control.kv_cache import KVCache
from forkserve.control.page_table import CopyPages, PageTable
from forkserve.control.sharing import PrefixSharing
from forkserve.engine.page_row import PageRow
from forkserve.engine.session import Session


class SteadyRow:
    """One steady session: what its rows in every tick's batch are built from."""

    __slots__ = ("session", "node", "kv", "base", "residual", "form", "adapter", "adapter_start",
                 "sampling", "base_row", "residual_row", "own_last", "tokens", "committed",
                 "generated", "stop", "exits")

    def __init__(self, session: Session, kv_cache: KVCache) -> None:
        node = session.tree.tip
        self.session, self.node, self.kv = session, node, node.table
        self.base: PageTable = node.table.base
        self.residual: PageTable | None = node.table.residual
        self.form = kv_cache.form_of(node.table, node.adapter)
        self.adapter = node.adapter
        # Fixed while steady: 0 for a plain adapter, None (run as base) without one; an aLoRA's
        # point moves only at a token that ends an invocation, which takes the row out first.
        self.adapter_start = kv_cache.adapter_start(node.table, node.adapter)
        self.sampling: SamplingParams = session.sampling
        # The tables' page ids as the batch lists them, appended in place at a boundary.
        self.base_row = PageRow(self.base)
        self.residual_row = None if self.residual is None else PageRow(self.residual)
        # Whether the last page of each side is known to be this table's alone (checked by
        # the first ``prepare`` inside it, or fresh from a boundary). Only a verb can share a
        # partial page (a fork), and a verb drops the session from the set first: the index,
        # pause pins and other sessions' matches reference full pages only.
        self.own_last = False
        # What ``Session.take`` appends to and reads (``apply`` does it inline): the tip's
        # tokens, the committed path, this generation's tokens and its stop set. Fixed while
        # the session stays: only a verb replaces them (``begin_generate``: a new row).
        self.tokens: list[int] = node.tokens
        self.committed: list[int] = session.tree.committed
        self.generated: list[int] = session.generated
        self.stop: frozenset = session.stop
        # Sampled tokens after which the session leaves the set before its next step: its
        # stop tokens, and an aLoRA's invocation's last (an occurrence may end there and move
        # the activation point: the general path rescans, ``Stepper.activate``).
        invocation = kv_cache.invocation(node.adapter)
        self.exits: frozenset = self.stop if invocation is None \
            else self.stop | {invocation.tokens[-1]}

    def follow(self) -> None:
        """The page rows catch up with the tables (a page added at a boundary, or given back)."""
        self.base_row.follow(self.base)
        if self.residual_row is not None:
            self.residual_row.follow(self.residual)


# The batch's columns, read off the rows in C.
_NODE_ID, _NODE, _FORM, _ADAPTER, _ADAPTER_START, _SAMPLING = map(
    attrgetter, ("node.id", "node", "form", "adapter", "adapter_start", "sampling"))
_BASE_VIEW, _RESIDUAL_ROW = attrgetter("base_row.view"), attrgetter("residual_row")


class SteadyDecode:
    def __init__(self, kv: KVCache, sharing: PrefixSharing) -> None:
        self.kv, self.sharing, self.page_size = kv, sharing, sharing.page_size
        self._rows: dict[int, SteadyRow] = {}  # by session id, in admission order
        # Columns of the last batch, reused while the same rows run again.
        self._static: tuple | None = None
        self._pages: tuple | None = None
        self._marks: tuple[SharedPrefix | None, ...] | None = None
        # The members that gained a page in the last ``prepare`` (their held pages changed).
        self.grown: list[SteadyRow] = []
        # The members' positions after the last ``prepare`` (every member advances one per
        # ``prepare``, so the next is this + 1, in C) and the tokens the last ``apply`` took
        # with the static columns they were aligned with: the next step writes them.
        self._positions: np.ndarray | None = None
        self._sampled: tuple[tuple | None, Sequence[int]] | None = None
        # Bumped whenever a member joins or leaves: equal versions, the same rows in order.
        self.version = 0
        self._exit_rows: list[int] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, session_id: int) -> bool:
        return session_id in self._rows

    @property
    def ids(self) -> KeysView[int]:
        """The members' session ids, live (a tick's loops test membership without a call)."""
        return self._rows.keys()

    def admit(self, session: Session) -> None:
        """Take ``session`` in if a general-path step left it in steady decode."""
        if session.id in self._rows:
            return
        tip = session.tree.tip
        kv = tip.table
        if (session.error is not None or session.decode_left <= 0 or session.flush
                or session.hold_speculation or not session.generated_unwritten
                or tip.next_token is not None or kv is None or kv.base.length != tip.end - 1
                or kv.regime().max_tokens is not None
                or tip.next_token_sampling != session.sampling):
            return
        if any(n.state is NodeState.SPECULATIVE for n in session.tree.nodes.values()):
            return
        invocation = self.kv.invocation(tip.adapter)
        if invocation is not None:
            # The token the first step writes was sampled after the last scan: an aLoRA joins
            # only if its point on the whole path is still the one its table was written at.
            scan = tip.activation.extend(
                invocation, lambda s, e: session.tree.path_slice(tip, s, e), tip.end)
            if scan.start != kv.adapter_start:
                return
            tip.activation = scan
        self._rows[session.id] = SteadyRow(session, self.kv)
        self._changed()

    def drop(self, session_id: int) -> None:
        """The session leaves the set (a verb is about to change it, or it left the path)."""
        if self._rows.pop(session_id, None) is not None:
            self._changed()

    def clear(self) -> None:
        if self._rows:
            self._rows.clear()
            self._changed()

    def _changed(self) -> None:
        self._static = self._pages = self._marks = self._positions = self._sampled = None
        self._exit_rows = None
        self.version += 1

    def exit_rows(self) -> list[int]:
        """Indices (in member order) of the members with ``exits``: only their sampled token
        can take them out before their generation ends (fixed while a member stays)."""
        if self._exit_rows is None:
            self._exit_rows = [i for i, row in enumerate(self._rows.values()) if row.exits]
        return self._exit_rows

    def prepare(self, copy_pages: CopyPages) -> tuple[list[SteadyRow], list[Session]]:
        """Make each member's next position writable, as ``prepare_write(1)`` would. Returns
        the rows that run this tick and the sessions that left the set (the general path
        takes them this tick): a last page another holder references (it needs a copy on
        write), or a page boundary when the pools cannot serve every member at one even
        after one eviction pass of their indexes (``KVCache.evict_for``: under pressure the
        tick's boundary pages cost one pass and one batch of host copies, not one per member
        on the general path)."""
        p = self.page_size
        boundary, left = [], []
        self.grown = []
        # One pass: a member inside a page advances here (its last page is its own and has
        # room: prepare_write(1) adds no page); the others are sorted out below.
        for row in self._rows.values():
            base, residual = row.base, row.residual
            n = base.length
            if n % p == 0:
                boundary.append(row)
            elif not row.own_last and (base.pool.refcount(base.pages[-1]) != 1 or (
                    residual is not None and residual.pool.refcount(residual.pages[-1]) != 1)):
                left.append(row)
            else:
                row.own_last = True
                base.length = n + 1
                if residual is not None:
                    residual.length = n + 1
        if boundary:
            base_pool, residual_pool = self.kv.pool, self.kv.residual_pool
            residual = sum(r.residual is not None for r in boundary)
            self.kv.evict_for({base_pool: len(boundary),
                               **({residual_pool: residual} if residual else {})})
            if len(boundary) > base_pool.num_free or (
                    residual > 0 and residual > residual_pool.num_free):
                left += boundary
                boundary, residual = [], 0
            # prepare_write(1) of every boundary member, the pages allocated at once.
            fresh_residual = iter(residual_pool.alloc(residual) if residual else ())
            # The cascade groups stand: a boundary appends a fresh page behind the shared
            # ones (a member's write page is its own), so no common prefix moves; only a
            # member whose readable pages just reached a group's minimum may change them
            # (``PrefixSharing.groups_of``: it may now lead its first page's group).
            min_pages, regroup = self.sharing.min_pages, False
            for row, page in zip(boundary, base_pool.alloc(len(boundary)), strict=True):
                base = row.base
                base.grow(page)
                if row.residual is not None:
                    row.residual.grow(next(fresh_residual))
                row.own_last = True
                row.follow()
                if base.length // p == min_pages:
                    regroup = True
            self.grown = boundary
            self._pages = None
            if regroup:
                self._marks = None
        for row in left:
            self.drop(row.session.id)
        if self._positions is not None:  # a new array: the last step's batch keeps its own
            self._positions = self._positions + 1
        # Every member runs, in admission order: the cached columns stay aligned.
        return list(self._rows.values()), [r.session for r in left]

    def unprepare(self, rows: Sequence[SteadyRow]) -> None:
        """Undo ``prepare`` for ``rows`` (a step that will not run them): each table back one
        position, a page taken at a boundary given back."""
        for row in rows:
            row.kv.truncate(row.base.length - 1)
            row.follow()
        self._pages = self._marks = self._positions = None

    def batch(self, rows: Sequence[SteadyRow], tokens: Sequence[int] | None = None,
              fed: StepHandle | None = None) -> DecodeBatch:
        """The ``DecodeBatch`` of ``rows`` (all members, as ``prepare`` returned them); the
        cascade groups of these rows alone (``PrefixSharing.marks``) are asked again only
        when the members change or a boundary may move them. ``tokens``: what the rows write,
        when the path does not hold them yet (overlap: the step before sampled them and its
        tokens are not applied yet); None: each tip's last token. ``fed``: the rows write
        what that step (launched, not read back) sampled, row for row (``DecodeBatch.fed``;
        ``tokens`` ignored)."""
        if self._static is None:
            # (Columns of the rows' fields read by ``attrgetter`` in C, one pass each.)
            starts = list(map(_ADAPTER_START, rows))
            # Without an adapter the row runs as the base model: adapter_start past its token.
            as_base = np.array([s is None for s in starts], dtype=bool)
            self._static = (tuple(map(_NODE_ID, rows)), tuple(map(_FORM, rows)),
                            tuple(map(_ADAPTER, rows)),
                            (as_base, np.array([s or 0 for s in starts], dtype=np.int64),
                             bool(as_base.any())),
                            tuple(map(_SAMPLING, rows)), tuple(map(_NODE, rows)))
        seq_ids, forms, adapters, (as_base, starts, any_base), sampling, nodes = self._static
        if self._pages is None:
            residual_rows = tuple(map(_RESIDUAL_ROW, rows))
            self._pages = (tuple(map(_BASE_VIEW, rows)),
                           tuple(None if r is None else r.view for r in residual_rows)
                           if residual_rows.count(None) < len(residual_rows) else residual_rows)
        pages, residual = self._pages
        if self._positions is None:
            self._positions = np.fromiter((r.base.length - 1 for r in rows), np.int64, len(rows))
        positions = self._positions
        if self._marks is None:
            self._marks = tuple(self.sharing.marks(list(zip(pages, positions.tolist(),
                                                            strict=True))))
        adapter_starts = np.where(as_base, positions + 1, starts) if any_base else starts
        if fed is not None:
            written = (0,) * len(rows)  # placeholders: the backend reads ``fed``'s tokens
        elif tokens is not None:
            written = tuple(tokens)
        elif self._sampled is not None and self._sampled[0] is self._static:
            written = self._sampled[1]  # what the last apply took, row for row
        else:
            written = tuple(n.tokens[-1] for n in nodes)
        return DecodeBatch(seq_ids, written, positions, pages, residual, forms, adapters,
                           adapter_starts, sampling, self._marks, fed)

    def apply(self, rows: Sequence[SteadyRow], tokens: Sequence[int], now: float,
              publish: Callable[[Node], None], positions: np.ndarray | None = None) -> None:
        """As ``Stepper._apply`` then ``emit`` for each row: a write that filled a page is
        published, the sampled token joins the session (``Session.take``, inline); a
        generation that ended, or a token in the row's ``exits``, leaves the set. (The step
        wrote position ``end - 1``; with overlap the table may already reach one further, for
        the next step.) ``positions``: the column of the batch the rows ran as
        (``DecodeBatch.positions``), which finds the rows whose write filled a page in C
        (position ``end - 1`` is a page's last); None: each row's tip is read."""
        p = self.page_size
        static = self._static
        ended: list[int] = []
        # The filled pages first, in row order (a row's publish reads only its own path and
        # tables, which the other rows' tokens do not touch).
        if positions is not None:
            for i in np.flatnonzero(positions % p == p - 1).tolist():
                publish(rows[i].node)
        else:
            for row in rows:
                if row.node.end % p == 0:
                    publish(row.node)
        for row, token in zip(rows, tokens, strict=True):
            row.node.last_touch = now
            # ``Session.take``, inline (a member's tip is ``row.node``, its generated token
            # already unwritten: ``generated_unwritten`` stays True).
            row.tokens.append(token)
            row.committed.append(token)
            row.generated.append(token)
            session = row.session
            if token in row.stop:
                session.decode_left = 0
                session.finish_reason = "stop"
            else:
                session.decode_left -= 1
            if session.decode_left == 0:
                session.paused_since = now
                ended.append(session.id)
            elif token in row.exits:  # an aLoRA's point may move: the general path rescans
                ended.append(session.id)
        if ended:  # they leave the set together: one ``_changed``
            rows_by_id = self._rows
            if any([rows_by_id.pop(i, None) is not None for i in ended]):
                self._changed()
        # Unless a member left or joined since the rows' batch was built (a new ``_static``),
        # these tokens, row for row, are what the members' next step writes.
        self._sampled = (static, tuple(tokens)) if static is not None and static is self._static \
            and len(rows) == len(self._rows) else None
