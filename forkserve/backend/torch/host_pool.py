"""HostResidualPool: host (CPU) copies of residual pages, the backend side of the host tier.

Holds k_res / v_res rows [layers, slots, P, r_max] for ``config.host_residual_pages`` slots
whose ids the control plane owns (``HostOffload``), pinned on CUDA.

Each call moves its whole batch with a fixed number of operations, however many pages, and
the host never waits for the device (issue 21: one synchronous ``.cpu()``/``.to()`` per pool
per item stalled the decode ticks of D1). Both directions keep the protocol's promise, that
the control plane may reuse the device page right after an offload and the slot right after
a restore, through ordering instead of waiting:

* offload: the pages are gathered on the compute stream, so a later step that rewrites the
  freed pages is queued after the gather; the bytes go to a pinned buffer on the side stream
  (``CopyLane``) and land in their slots on the host later (``_land``: at the next call, once
  their copy has completed; a restore of a slot not landed yet waits for that copy alone);
* restore: the slots are gathered on the host into a pinned buffer at once (the slot may be
  reused as soon as the call returns), copied on the side stream, and scattered into the
  pages on the compute stream after it, so the next step reads them.

Per call: one index copy, two gathers (K, V) and one transfer; a restore adds the scatter.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from forkserve.backend.protocol import HostCopy, PageKind
from forkserve.backend.torch.copy_lane import CopyLane, Landed
from forkserve.backend.torch.kv_pool import KVPool


@dataclass(frozen=True)
class _Landing:
    """An offload whose bytes are on their way to the host: [2 (K, V), layers, n, P, r]."""

    slots: torch.Tensor
    staged: torch.Tensor
    landed: Landed


class HostResidualPool:
    def __init__(self, pool: KVPool, slots: int) -> None:
        self.pool, self.num_slots = pool, slots
        k, _ = pool.tensors_of(PageKind.RESIDUAL)
        self.lane = CopyLane(k.device)
        shape = (k.shape[0], slots, *k.shape[2:])
        self.k = torch.zeros(shape, dtype=k.dtype, pin_memory=self.lane.pinned)
        self.v = torch.zeros(shape, dtype=k.dtype, pin_memory=self.lane.pinned)
        self._landing: deque[_Landing] = deque()

    def offload(self, copies: Sequence[HostCopy]) -> None:
        self._land()
        k, v = self.pool.tensors_of(PageKind.RESIDUAL)
        pages = self.lane.indices([c.page for c in copies])
        staged = torch.empty((2, k.shape[0], len(copies), *k.shape[2:]), dtype=k.dtype,
                             device=k.device)
        _gather(k, v, pages, staged)
        host, landed = self.lane.to_host(staged)
        self._landing.append(_Landing(torch.tensor([c.slot for c in copies], dtype=torch.long),
                                      host, landed))
        self._land()

    def restore(self, copies: Sequence[HostCopy]) -> None:
        slots = [c.slot for c in copies]
        self._land(frozenset(slots))
        index = torch.tensor(slots, dtype=torch.long)
        staged = self.lane.empty_host((2, self.k.shape[0], len(copies), *self.k.shape[2:]),
                                      self.k.dtype)
        _gather(self.k, self.v, index, staged)
        on_device = self.lane.to_device(staged)
        pages = self.lane.indices([c.page for c in copies])
        _scatter(*self.pool.tensors_of(PageKind.RESIDUAL), pages, on_device)

    def settle(self) -> None:
        """Land every offload still in flight (waits for their copies): the slots then hold
        what was offloaded (tests read ``k`` / ``v``)."""
        self._land(wait=True)

    def _land(self, slots: frozenset[int] = frozenset(), wait: bool = False) -> None:
        """Write offloads whose copies completed into their slots, in issue order (a slot
        offloaded twice keeps the later bytes); wait for those in flight up to the last one
        that writes one of ``slots`` (a restore reads them next), or for all with ``wait``."""
        must = len(self._landing) if wait else max(
            (i + 1 for i, landing in enumerate(self._landing)
             if slots and not slots.isdisjoint(landing.slots.tolist())), default=0)
        while self._landing and (must > 0 or self._landing[0].landed.done()):
            landing = self._landing.popleft()
            landing.landed.wait()
            _scatter(self.k, self.v, landing.slots, landing.staged)
            must -= 1


def _gather(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """K's and V's pages (or slots) ``index`` into ``out[0]`` and ``out[1]``."""
    torch.index_select(k, 1, index, out=out[0])
    torch.index_select(v, 1, index, out=out[1])


def _scatter(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``src[0]`` and ``src[1]`` into K's and V's pages (or slots) ``index``."""
    k.index_copy_(1, index, src[0])
    v.index_copy_(1, index, src[1])
