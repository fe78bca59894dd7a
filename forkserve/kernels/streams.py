"""One side CUDA stream per device, for kernels that run beside the current stream's.

Forks and joins are event records and waits (``wait_stream``, ``wait_event``), which CUDA
graph capture turns into parallel branches, so the callers stay capturable. Buffers a side
stream writes are allocated on the current stream before the fork: the caching allocator
then never hands them out while the side stream may still write them. Off CUDA there is no
side stream and callers run their work in order.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream (created on first use, kept for the process)."""
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return side


def side_by_side(main_work: Callable[[], None], side_work: Callable[[], None],
                 device: torch.device) -> None:
    """Run ``side_work`` on the side stream beside ``main_work`` on the current one; return
    with the current stream after both (graph-capturable fork/join). Sequential off CUDA."""
    if device.type != "cuda":
        main_work()
        side_work()
        return
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_work()
    main_work()
    main.wait_stream(side)


def row_pipeline(batch: int, slices: int, side_work: Callable[[int, int], None],
                 main_work: Callable[[int, int], None], device: torch.device) -> None:
    """Cut rows ``[0, batch)`` in ``slices`` near-equal slices: ``side_work(lo, hi)`` of each
    on the side stream, one after another, and ``main_work(lo, hi)`` of each on the current
    stream once that slice's side work is done (an event per slice), so the side stream
    works on slice i + 1 while the current one works on slice i. Returns with the current
    stream after all of it. In order, slice by slice, off CUDA."""
    slices = max(1, min(slices, batch))
    bounds = [(batch * i // slices, batch * (i + 1) // slices) for i in range(slices)]
    if device.type != "cuda":
        for lo, hi in bounds:
            side_work(lo, hi)
            main_work(lo, hi)
        return
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    for lo, hi in bounds:
        with torch.cuda.stream(side):
            side_work(lo, hi)
            done = torch.cuda.Event()
            done.record(side)
        main.wait_event(done)
        main_work(lo, hi)
    main.wait_stream(side)
