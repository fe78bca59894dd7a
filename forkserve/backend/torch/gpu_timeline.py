"""GpuTimeline: when the device worked and when it waited, step by step (a measurement hook).

Off by default (``TorchBackend.gpu_timeline`` is None): a benchmark turns it on with
``TorchBackend.record_gpu_timeline()``. Each ``forward`` then marks its start before the
runner enqueues anything and its end after the forward's last kernel (before sampling reads
the tokens back; a CUDA-graph decode step computes its greedy tokens inside the graph):
CUDA events on the step's stream, or wall-clock stamps on a CPU device (where the step runs
synchronously). The gap between one decode step's end and the next decode step's start is the
time the device idled while the host planned, which the engine's overlap is meant to hide.

The start mark precedes the runner's own host work (batch packing, the input copy), so that
work counts as busy: the idle figure is a lower bound of the device's real idle time.
Ownership: the timeline belongs to its backend; ``summary`` reads and ``reset`` drops the
marks (the events of at most one run are kept).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TimelineSummary:
    decode_steps: int
    busy_ms: float          # device time inside decode steps that follow another decode step
    idle_ms: float          # device time between those consecutive decode steps

    @property
    def idle_share(self) -> float:
        """Share of the decode phase's device time spent waiting for the host."""
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total else 0.0


class GpuTimeline:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # (start mark, end mark, decode-only step) per step, in launch order.
        self._steps: list[tuple[object, object, bool]] = []
        self._open: object | None = None

    def start(self) -> None:
        self._open = self._mark()

    def stop(self, decode: bool) -> None:
        if self._open is None:
            raise AssertionError("GpuTimeline.stop without start")
        self._steps.append((self._open, self._mark(), decode))
        self._open = None

    def reset(self) -> None:
        self._steps, self._open = [], None

    def summary(self) -> TimelineSummary:
        """Busy and idle time over consecutive decode steps (a prefill between two decode
        steps breaks the pair: its host work is not the decode loop's)."""
        if self.cuda:
            torch.cuda.synchronize()
        busy = idle = 0.0
        for (_, e0, d0), (s1, e1, d1) in zip(self._steps, self._steps[1:], strict=False):
            if d0 and d1:
                idle += self._elapsed_ms(e0, s1)
                busy += self._elapsed_ms(s1, e1)
        return TimelineSummary(sum(d for _, _, d in self._steps), busy, idle)

    def _mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _elapsed_ms(self, a: object, b: object) -> float:
        if self.cuda:
            return max(0.0, a.elapsed_time(b))
        return max(0.0, (b - a) * 1e3)
