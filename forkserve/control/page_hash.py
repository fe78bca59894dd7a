"""Chained page hashes: one hash per full page of a path, each over the page's tokens and the
hash of the page before it, so equal hashes (collisions aside) mean equal token prefixes.

In-flight deduplication claims pages by these hashes (``control/inflight.py``), and every
``PrefixIndex`` entry keeps the hash of its own prefix: a path that continues a published
prefix starts its chain from that entry (``ChainSeed``) instead of hashing the 8K-token
context again per session (issue: prefill ticks at W=256 over one shared context).

A hash is only ever a hint: a collision can make a writer wait for pages it then does not
find (see ``control/inflight.py``); no page is ever matched by its hash.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple, Sequence

ROOT_HASH = 0  # the chain's value before the first page


def chained(prev: int, page: tuple[int, ...]) -> int:
    """The hash of a page whose tokens are ``page`` behind a prefix hashed ``prev``."""
    return hash((prev, page))


class ChainSeed(NamedTuple):
    """A prefix's chain end: its full ``pages`` and the hash of the last of them."""

    pages: int
    hash: int


ROOT_SEED = ChainSeed(0, ROOT_HASH)


@dataclass(frozen=True, slots=True)
class PageChain:
    """The chained hashes of a path's full pages from page ``first`` on (``before``: the hash
    of the pages before it). An ``array('q')`` (``hash`` is a C ssize_t): a chain of 8K tokens
    kept per prefill is one block, not 513 int objects a later tick would free one by one."""

    first: int
    before: int
    hashes: array

    @classmethod
    def at(cls, seed: ChainSeed) -> "PageChain":
        """An empty chain that continues the prefix ``seed`` ends."""
        return cls(seed.pages, seed.hash, array("q"))

    @property
    def end(self) -> int:
        """The page after the last hashed one."""
        return self.first + len(self.hashes)

    def run(self, lo: int, hi: int) -> array:
        """The hashes of pages ``lo`` to ``hi`` (``first <= lo``)."""
        if lo < self.first:
            raise IndexError(f"page {lo} is before this chain's first page {self.first}")
        return self.hashes[lo - self.first:hi - self.first]

    def extend(self, tokens: Sequence[int], page_size: int) -> "PageChain":
        """This chain over every full page of ``tokens`` (a path this chain is a prefix of)."""
        hashes = array("q", self.hashes)
        prev = hashes[-1] if hashes else self.before
        for i in range(self.end, len(tokens) // page_size):
            prev = chained(prev, tuple(tokens[i * page_size:(i + 1) * page_size]))
            hashes.append(prev)
        return PageChain(self.first, self.before, hashes)

