"""TreeLedger: the Frontend's record of every open tree's committed state.

A replica's memory dies with it, so what a client has been told is committed must live
outside it: after every verb that moves the committed spine the Frontend stores the
replica's ``TreeView`` here. When the replica is gone the tree is re-opened elsewhere from
exactly these tokens (a recompute: nothing committed is lost, speculative branches are).

The re-opened tree's root is a new node id. The client still holds the old committed tip,
so the ledger aliases every retired committed tip to the new root: a commit or fork from
the committed tip the client knew works unchanged after a fail-over.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.interfaces.ray_serve.protocol import RouteHint, TreeView
from forkserve.interfaces.server.errors import APIError


@dataclass(frozen=True)
class TreeRecord:
    tree_id: int
    adapter: str | None
    committed: tuple[int, ...]
    tip: int
    replica: str
    epoch: int = 0                        # bumped by every re-open
    aliases: tuple[tuple[int, int], ...] = ()  # (retired committed tip, the node that replaced it)
    salt: CacheSalt = UNSALTED           # a re-open keeps the tree's trust boundary

    def hint(self) -> RouteHint:
        return RouteHint(self.tree_id, self.adapter, salt=self.salt)

    def node(self, node_id: int) -> int:
        return dict(self.aliases).get(node_id, node_id)

    def nodes(self, node_ids: Iterable[int]) -> list[int]:
        return [self.node(n) for n in node_ids]


@dataclass
class TreeLedger:
    trees: dict[int, TreeRecord] = field(default_factory=dict)
    moves: int = 0                        # re-opens that landed on another replica (/metrics)
    _locks: dict[int, asyncio.Lock] = field(default_factory=dict)

    @staticmethod
    def new_id() -> int:
        # Random, not a counter: several Frontend replicas share one id space without talking.
        return secrets.randbits(62)

    def get(self, tree_id: int) -> TreeRecord:
        rec = self.trees.get(tree_id)
        if rec is None:
            raise APIError(404, f"unknown session {tree_id}", "NotFoundError")
        return rec

    def record(self, adapter: str | None, view: TreeView, salt: CacheSalt = UNSALTED) -> TreeRecord:
        rec = TreeRecord(view.tree_id, adapter, view.committed, view.tip, view.replica, salt=salt)
        self.trees[view.tree_id] = rec
        return rec

    def update(self, view: TreeView) -> None:
        rec = self.trees.get(view.tree_id)
        if rec is not None:
            self.trees[view.tree_id] = replace(rec, committed=view.committed, tip=view.tip,
                                               replica=view.replica)

    def reopened(self, old: TreeRecord, view: TreeView) -> TreeRecord:
        """The tree now lives on ``view.replica`` with root ``view.tip``: earlier tips alias it."""
        aliases = tuple((retired, view.tip) for retired, _ in old.aliases) + ((old.tip, view.tip),)
        rec = replace(old, committed=view.committed, tip=view.tip, replica=view.replica,
                      epoch=old.epoch + 1, aliases=aliases)
        self.trees[old.tree_id] = rec
        self.moves += view.replica != old.replica
        return rec

    def lock(self, tree_id: int) -> asyncio.Lock:
        """Serialises re-opens of one tree (two verbs may see its replica die at once)."""
        return self._locks.setdefault(tree_id, asyncio.Lock())

    def drop(self, tree_id: int) -> None:
        self.trees.pop(tree_id, None)
        self._locks.pop(tree_id, None)
