"""WriteTracker: which KV slots a step has written (TorchBackend's debug mode).

The control plane promises that a table never claims a position no step wrote; a tensor
cannot tell a written zero from a never-written one, so this host-side mask follows every
write, copy and host trip of the backend's pages. It costs a few numpy ops per step and is
off unless ``TorchBackend.track_writes()`` turns it on (tests, the fault bench).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from forkserve.backend.protocol import HostCopy, PageId, PageKind, SeqWork


class WriteTracker:
    def __init__(self, pages: dict[PageKind, int], page_size: int, host_slots: int) -> None:
        self.page_size = page_size
        self._written = {kind: np.zeros((n, page_size), dtype=bool) for kind, n in pages.items()}
        self._host = np.zeros((host_slots, page_size), dtype=bool)

    def wrote(self, work: Sequence[SeqWork], base_kind: PageKind) -> None:
        """Mark what a successful step (validated: residual pages only on split items) wrote."""
        for item in work:
            sides = [(base_kind, item.slots.pages)] if item.write_base else []
            if item.slots.residual_pages is not None and item.write_residual:
                sides.append((PageKind.RESIDUAL, item.slots.residual_pages))
            sides += [(PageKind.RESIDUAL, t.residual_pages) for t in item.extra_residuals]
            positions = np.arange(item.start_pos, item.start_pos + len(item.tokens))
            for kind, pages in sides:
                rows = np.asarray(pages, dtype=np.int64)[positions // self.page_size]
                self._written[kind][rows, positions % self.page_size] = True

    def copied(self, kind: PageKind, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        for src, dst in pairs:
            self._written[kind][dst] = self._written[kind][src]

    def offloaded(self, copies: Sequence[HostCopy]) -> None:
        for c in copies:
            self._host[c.slot] = self._written[PageKind.RESIDUAL][c.page]
            self._written[PageKind.RESIDUAL][c.page] = False  # the device page is free now

    def restored(self, copies: Sequence[HostCopy]) -> None:
        for c in copies:
            self._written[PageKind.RESIDUAL][c.page] = self._host[c.slot]

    def first_unwritten(self, kind: PageKind, pages: Sequence[PageId], length: int) -> int | None:
        mask = self._written[kind][np.asarray(pages, dtype=np.int64)].reshape(-1)[:length]
        missing = np.flatnonzero(~mask)
        return int(missing[0]) if len(missing) else None
