"""WaitingSessions: the sessions an admission point holds back, as the running aggregate the
adaptive layout weighs (``layout_policy.Queued``).

The policy needs three numbers about the queue behind the session being opened: how many
wait, their footprint, and how much of this prompt they share (the pages a split queue
writes once). Recounting the queue at every open costs O(queue) per open; here each
arrival and departure updates the aggregate by its own prompt alone, so an open reads it
in O(log pages) whatever the queue's length.

Shared prefix: a reference count per full-page prefix (``page_hash``'s chain, within the
session's ``CacheSalt``: pages are shared only inside one trust boundary) over the waiting
prompts. A page every waiting prompt holds has a count equal to the queue's length, and
counts only fall along a chain, so the pages of this prompt that the whole queue shares are
found by bisection. The aggregate assumes what ``Queued`` says: each waiting session its
own adapter (merged copies are not shared between them), each the mean footprint.
"""
from __future__ import annotations

import bisect
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from forkserve.control.layout_policy import Queued
from forkserve.control.page_hash import ROOT_SEED, PageChain
from forkserve.control.prefix_index import UNSALTED, CacheSalt
from forkserve.errors import InvalidStateError


@dataclass(frozen=True, eq=False)  # identity: two requests with one prompt are two waiters
class Waiter:
    """One waiting session: its prompt's page chain, its boundary and its peak footprint
    (prompt + every token it may generate: what admission would reserve)."""

    chain: array
    salt: CacheSalt
    footprint: int


class WaitingSessions:
    """``holds_for_room``: whether the admission point opens a session only once its pages
    fit (``Queued.holds_for_room``): every ``queued`` answer says so, an empty queue's too."""

    def __init__(self, page_size: int, holds_for_room: bool = False) -> None:
        self.page_size = page_size
        self._empty = Queued(holds_for_room=holds_for_room)
        self._members: set[Waiter] = set()
        self._tokens = 0
        self._prefixes: Counter[tuple[CacheSalt, int]] = Counter()

    def waiter(self, prompt: Sequence[int], footprint: int,
               salt: CacheSalt = UNSALTED) -> Waiter:
        """A waiter for ``prompt`` (not yet added): its chain is hashed once, here, so the
        caller may do it outside whatever guards the queue."""
        return Waiter(PageChain.at(ROOT_SEED).extend(prompt, self.page_size).hashes, salt,
                      footprint)

    def add(self, waiter: Waiter) -> None:
        if waiter in self._members:
            raise InvalidStateError("this waiter is already queued")
        self._members.add(waiter)
        self._tokens += waiter.footprint
        self._prefixes.update((waiter.salt, h) for h in waiter.chain)

    def remove(self, waiter: Waiter) -> None:
        """``waiter`` leaves the queue: opened, refused or cancelled."""
        if waiter not in self._members:
            raise InvalidStateError("this waiter is not queued")
        self._members.remove(waiter)
        self._tokens -= waiter.footprint
        for h in waiter.chain:
            key = (waiter.salt, h)
            if self._prefixes[key] == 1:
                del self._prefixes[key]  # no zero counts: the census is the waiters' pages only
            else:
                self._prefixes[key] -= 1

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, waiter: Waiter) -> bool:
        return waiter in self._members

    def queued(self, opening: Waiter) -> Queued:
        """The queue as ``Queued`` sees it from ``opening``: every other waiter (``opening``
        may still be one: an admission controller sizes a request before admitting it), the
        mean footprint rounded up, and the leading full pages of ``opening``'s prompt that
        every other waiter's prompt starts with."""
        waiting = len(self._members)
        own = opening in self._members
        sessions, tokens = waiting - own, self._tokens - (opening.footprint if own else 0)
        if not sessions:
            return self._empty
        # Every other waiter holds a page of ``opening``'s chain iff its count is ``waiting``
        # (``opening``, when queued, holds all of its own). Counts only fall along a chain:
        # bisect for the first page someone lacks.
        salt, chain, prefixes = opening.salt, opening.chain, self._prefixes
        shared = bisect.bisect_left(range(len(chain)), True,
                                    key=lambda k: prefixes.get((salt, chain[k]), 0) < waiting)
        return Queued(sessions, -(-tokens // sessions), shared * self.page_size,
                      self._empty.holds_for_room)
