"""Activated LoRA (aLoRA): where an adapter starts applying on a token path.

PEFT's semantics (``peft.tuners.lora.variants.calculate_alora_offsets``): the adapter
applies from the *start* of the *last* occurrence of its invocation tokens in the input;
every token before it runs as the base model, and with no occurrence the whole input does.
So the activation point is a property of the whole path, and it can move when tokens are
appended (a later occurrence). KV written under one activation point is stale under
another from the earlier of the two on; ``KVCache.activate`` truncates it there.

This follows PEFT's ``forward`` over the whole path (what a baseline that prefills the
committed tokens computes). PEFT's ``generate`` fixes the point from the prompt and ignores
an occurrence in generated tokens; here such an occurrence moves it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# Reads positions [start, end) of a node's path without copying the whole path.
PathSlice = Callable[[int, int], Sequence[int]]


@dataclass(frozen=True)
class Invocation:
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("an aLoRA invocation needs at least one token")

    def last_start(self, window: Sequence[int], offset: int) -> int | None:
        """Absolute start of the last occurrence inside ``window`` (which begins at ``offset``)."""
        n = len(self.tokens)
        for i in range(len(window) - n, -1, -1):
            if tuple(window[i:i + n]) == self.tokens:
                return offset + i
        return None


@dataclass(frozen=True)
class ActivationScan:
    """How far a node's path was searched, and the activation point found in it."""

    scanned: int = 0
    start: int | None = None  # None: the invocation has not occurred (all base model)

    def extend(self, invocation: Invocation, path: PathSlice, end: int) -> ActivationScan:
        """The scan of ``path[:end]``, searching only what is new (paths only grow)."""
        if end == self.scanned:
            return self
        # An occurrence that ends in the new tokens may start up to n - 1 tokens earlier.
        lo = max(0, self.scanned - len(invocation.tokens) + 1)
        found = invocation.last_start(path(lo, end), lo)
        return ActivationScan(end, found if found is not None else self.start)


def adapter_start(start: int | None, end: int) -> int:
    """``SeqWork.adapter_start`` of an item ending at ``end``: no occurrence runs it all as base."""
    return end if start is None else start


def earliest(a: int | None, b: int | None) -> int | None:
    """The earlier of two activation points (None: never)."""
    if a is None:
        return b
    return a if b is None else min(a, b)
