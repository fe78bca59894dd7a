"""The cycle collector's passes inside a timed region, read from ``gc.callbacks``.

A full pass over a large heap stops the host for a tenth of a second or more, inside
whichever tick allocates across the collector's threshold; without this a run's figures
show the pause only as a slower tick (the shared-context write of disaggregated_base: 0.65 s
where the device worked 0.23 s). ``engine/heap.py`` is what keeps them short.

The callback is process-wide: one watch is installed at a time; ``close`` removes it.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class GcPauses:
    """A region's collector passes: how many were full (generation 2), and the seconds of
    all passes together."""

    full: int = 0
    seconds: float = 0.0


class GcWatch:
    def __init__(self) -> None:
        self._started = 0.0
        self._full = 0
        self._seconds = 0.0
        self._installed = False

    def install(self) -> GcWatch:
        """Start timing every pass; a second call (already installed) does nothing."""
        if not self._installed:
            gc.callbacks.append(self._on_pass)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_pass)
            self._installed = False

    def window(self) -> tuple[int, float]:
        return self._full, self._seconds

    def since(self, mark: tuple[int, float]) -> GcPauses:
        full, seconds = mark
        return GcPauses(self._full - full, round(self._seconds - seconds, 4))

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self._seconds += time.perf_counter() - self._started
        self._full += info["generation"] == 2
