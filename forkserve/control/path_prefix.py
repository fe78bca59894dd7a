"""PathPrefix: ``path[:n]`` of a live token list (or page list), read in place (issue 21).

Publishing the page a decode step just filled needs that page's tokens only: the index
resumes from the publisher's cursor and slices the pages after it (``PrefixIndex.insert``).
A tuple copy of the path cost O(context) per session per filled page (8K tokens x every
session, every 16 ticks) and left one large container per session for the garbage collector
to traverse; so did slicing the table's page list. The view costs O(1); only slices that
are not prefixes are copied, at their own length.

Lifetime: the view reads the list it was given, so it is valid only while that list keeps
its first ``n`` tokens; build it, use it, drop it (``KVCache.publish`` hands it to the index
within the call). It is never a dict key (equality is identity).
"""
from __future__ import annotations

import itertools
from typing import Iterator, Sequence, overload


class PathPrefix(Sequence[int]):
    __slots__ = ("_path", "_n")

    def __init__(self, path: Sequence[int], n: int) -> None:
        if not 0 <= n <= len(path):
            raise ValueError(f"a prefix of {n} tokens of a path of {len(path)}")
        self._path, self._n = path, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...

    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if start == 0 and step == 1:
                # A prefix of a prefix: still a view (itself when it is the whole of it).
                return self if stop == self._n else PathPrefix(self._path, max(stop, 0))
            return tuple(self._path[start:stop:step])
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._path[i % self._n]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._path, self._n)


def backing(seq: Sequence[int]) -> Sequence[int]:
    """What ``seq`` reads: a view's live list (equal to it at every index below its length,
    which is all a caller may read of it), anything else itself. Lets a hot loop index and
    slice in C (``PrefixIndex.insert``)."""
    return seq._path if isinstance(seq, PathPrefix) else seq
