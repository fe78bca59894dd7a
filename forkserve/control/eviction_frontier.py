"""EvictionFrontier: the prefix index's entries that eviction may take next, kept up to date
as entries move between the device, the host tier and nowhere.

Eviction takes least-recently-used *device leaves* (device entries none of whose children
is on the device: taking one keeps the device entries prefix-closed), and the host tier's
LRU drops *host leaves* (offloaded entries without children). Finding them by walking the
tree made every eviction O(entries); with the host tier on, offloaded entries stay in the
tree, so under pressure each page boundary of a decode tick paid a Python walk over tens of
thousands of nodes (issue 21: decode steps 2.5x slower with D1 on). The frontier is updated
in O(1) per move, so an eviction reads only the leaves.

Each node counts its device children (``device_children``); the root is never a leaf.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from forkserve.control.prefix_index import _IndexNode


class EvictionFrontier:
    def __init__(self) -> None:
        self.device: set[_IndexNode] = set()
        self.host: set[_IndexNode] = set()

    def to_device(self, node: _IndexNode) -> None:
        """``node`` now holds a device page (published, adopted or restored); its parent,
        on the device by prefix closure, has a device child."""
        parent = node.parent
        if parent.key is not None:
            parent.device_children += 1
            self.device.discard(parent)
            self.host.discard(parent)
        self.host.discard(node)
        if node.device_children == 0:
            self.device.add(node)

    def grafted(self, parent: _IndexNode, last: _IndexNode) -> None:
        """A new chain of device entries hangs from ``parent`` (each with one device child,
        ``last`` with none): what ``to_device`` of each, in order, would leave."""
        if parent.key is not None:
            parent.device_children += 1
            self.device.discard(parent)
            self.host.discard(parent)
        self.device.add(last)

    def off_device(self, node: _IndexNode, parked: bool) -> _IndexNode | None:
        """``node`` left the device: parked in a host slot, or (not ``parked``) unlinked.
        Returns its parent when that became a device leaf (eviction may take it next)."""
        self.device.discard(node)
        if parked and not node.children:
            self.host.add(node)
        parent = node.parent
        if parent.key is None:
            return None
        parent.device_children -= 1
        if parent.device_children == 0 and parent.page is not None:
            self.device.add(parent)
            return parent
        return None

    def dropped(self, node: _IndexNode) -> _IndexNode | None:
        """Offloaded ``node`` was unlinked for good. Returns its parent when that became a
        host leaf (the host's LRU may drop it next)."""
        self.host.discard(node)
        parent = node.parent
        if parent.key is not None and parent.page is None and not parent.children:
            self.host.add(parent)
            return parent
        return None

    def check(self, nodes: Iterable[_IndexNode]) -> None:
        """The sets and the counts equal what a walk over every entry finds."""
        device, host = set(), set()
        for node in nodes:
            count = sum(c.page is not None for c in node.children.values())
            if count != node.device_children:
                raise AssertionError(f"index entry counts {node.device_children} device children, "
                                     f"has {count}")
            if node.page is not None and count == 0:
                device.add(node)
            elif node.page is None and not node.children:
                host.add(node)
        if device != self.device or host != self.host:
            raise AssertionError(f"eviction frontier: {len(self.device)} device / "
                                 f"{len(self.host)} host leaves tracked, {len(device)} / "
                                 f"{len(host)} in the tree")
