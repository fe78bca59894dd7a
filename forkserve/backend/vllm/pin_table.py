"""PinTable: which vLLM block each full control-plane page keeps alive.

The mapping (docs/VLLM_BACKEND.md): a control-plane page id that is full holds exactly one
pin on a vLLM KV block with the same contents (same token prefix, same LoRA). vLLM then
cannot evict that block while the page id holds it, so a child whose prompt runs through
the page hits it in vLLM's prefix cache. The control plane's pool bounds the pins: at most
``num_pages`` blocks are pinned at once.

The Backend protocol carries no "page freed" event, so a pin is dropped when its page id is
written again (the pool reallocated it, or a commit truncated it mid-page) or is the target
of a copy. Handles are opaque: the runner's pinner creates and releases them.
"""
from __future__ import annotations

from typing import Generic, TypeVar

from forkserve.backend.protocol import PageId

Handle = TypeVar("Handle")


class PinTable(Generic[Handle]):
    def __init__(self) -> None:
        self._held: dict[PageId, Handle] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, page: PageId) -> bool:
        return page in self._held

    def get(self, page: PageId) -> Handle | None:
        return self._held.get(page)

    def hold(self, page: PageId, handle: Handle) -> Handle | None:
        """Record ``handle`` as the page's pin; returns the pin it replaces (to release)."""
        old = self._held.get(page)
        self._held[page] = handle
        return old

    def drop(self, page: PageId) -> Handle | None:
        """The page's contents changed: forget its pin and return it (to release), if any."""
        return self._held.pop(page, None)

    def drain(self) -> list[Handle]:
        """Forget every pin and return the handles (to release): the backend is closing."""
        handles = list(self._held.values())
        self._held.clear()
        return handles
