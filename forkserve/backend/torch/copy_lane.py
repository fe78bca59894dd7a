"""CopyLane: copies between the device and pinned host memory that never make the host wait.

On CUDA the bytes cross on a side stream, ordered against the compute stream by events, so
a copy neither waits for the step in flight nor delays the next one more than its own
ordering needs; on a CPU device (the tests) they are plain copies done at once.

Lifetime (stream-safe): a device tensor read on the side stream is recorded there
(``record_stream``), and one written there is recorded on the compute stream that reads it,
so the caching allocator never hands its memory out while a copy still uses it; pinned
buffers come from PyTorch's caching host allocator, which keeps a block until the copies
that used it have completed.
"""
from __future__ import annotations

import torch


class Landed:
    """When a copy to the host has landed: ``done`` without waiting, ``wait`` blocks."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class CopyLane:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def pinned(self) -> bool:
        """Whether host buffers are pinned (the device is a GPU)."""
        return self._stream is not None

    def indices(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 index tensor on the device, copied without a host wait."""
        host = torch.tensor(values, dtype=torch.long)
        if self._stream is None:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, src: torch.Tensor) -> tuple[torch.Tensor, Landed]:
        """Start copying ``src`` (written by the compute stream) into a new pinned buffer;
        returns the buffer and when it has landed."""
        if self._stream is None:
            return src, Landed(None)
        compute = torch.cuda.current_stream(self.device)
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            out.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        src.record_stream(self._stream)
        return out, Landed(event)

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """Copy pinned ``src`` to the device; the compute stream waits for the copy (not the
        host), so what it queues next reads the bytes."""
        if self._stream is None:
            return src
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            out.copy_(src, non_blocking=True)
        compute.wait_stream(self._stream)
        out.record_stream(compute)
        return out

    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
