"""HostTier: a bounded set of host (CPU) slots that evicted RESIDUAL pages are parked in.

Residual pages are rank-r (about 64x smaller than base pages), so host memory holds many
of them and copying one back is far cheaper than recomputing its tokens.

Ownership: the tier owns the slot ids (the backend only stores what it is told, see
``HostOffload``). A slot handed out by ``take`` belongs to exactly one offloaded entry of
the residual ``PrefixIndex``; the index gives it back with ``give_back`` when the entry is
restored to a device page, adopts a freshly published device page, or is dropped for good
(the host tier's own LRU, run by the index). ``check_integrity`` checks that accounting.
"""
from __future__ import annotations

import time
from typing import Sequence

from forkserve.backend.protocol import HostCopy, HostOffload, HostSlotId, PageKind
from forkserve.control.metrics import EngineMetrics


class HostTier:
    def __init__(self, kind: PageKind, capacity: int, page_size: int, backend: HostOffload,
                 metrics: EngineMetrics) -> None:
        if capacity <= 0:
            raise ValueError(f"a host tier needs a positive capacity, got {capacity}")
        self.kind, self.capacity, self.page_size = kind, capacity, page_size
        self._backend, self._metrics = backend, metrics
        # Pop from the end: low slots first, as the page pools do.
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> HostSlotId:
        if not self._free:
            raise AssertionError(f"{self.kind.value} host tier: no free slot (the index drops one "
                                 "first)")
        return self._free.pop()

    def give_back(self, slot: HostSlotId) -> None:
        self._free.append(slot)

    def offload(self, copies: Sequence[HostCopy]) -> None:
        if copies:
            start = time.perf_counter()
            self._backend.offload_pages(self.kind, copies)
            m = self._metrics
            m.host_copy_ms += (time.perf_counter() - start) * 1e3
            m.host_offload_calls += 1
            m.offloaded_pages += len(copies)

    def restore(self, copies: Sequence[HostCopy]) -> None:
        if copies:
            start = time.perf_counter()
            self._backend.restore_pages(self.kind, copies)
            m = self._metrics
            m.host_copy_ms += (time.perf_counter() - start) * 1e3
            m.host_restore_calls += 1
            m.restored_pages += len(copies)
            m.restored_tokens += len(copies) * self.page_size

    def dropped(self, n: int) -> None:
        self._metrics.host_dropped_pages += n

    def check_integrity(self, held: Sequence[HostSlotId]) -> None:
        """Every slot is free or held by exactly one index entry, never both."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.kind.value} host tier: duplicate slot in free list")
        seen: set[HostSlotId] = set()
        for slot in held:
            if slot in seen:
                raise AssertionError(f"{self.kind.value} host slot {slot} held by two entries")
            if slot in free:
                raise AssertionError(f"{self.kind.value} host slot {slot} is held and free")
            seen.add(slot)
        if len(seen) + len(free) != self.capacity:
            raise AssertionError(f"{self.kind.value} host tier: "
                                 f"{self.capacity - len(seen) - len(free)} slots leaked (neither "
                                 "free nor held)")
