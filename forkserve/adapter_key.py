"""An adapter's identity below the interfaces: its ``AdapterId`` and its ``AdapterKey``.

A client names an adapter (the ``model`` of a request; ``ServedModel.adapters`` maps names
to ids). The Engine resolves a name to the backend's ``AdapterId`` (TorchBackend and
VllmBackend number resident adapters with ints; MockBackend keeps what it was given), and
sessions, nodes and ``SeqWork`` carry that id. The prefix index spells the id as a string in
its ``AdapterNamespace``; that spelling is an ``AdapterKey``: what ``PublishedPage.adapter``
holds and what the Ray routing stats map back to names. ``adapter_key`` is the interfaces'
one way to make one; control/dual_radix_tree.py still writes ``str(id)`` itself (the control
plane's adapter types move with issue 14's protocol change).
"""
from __future__ import annotations

from typing import NewType, TypeAlias

AdapterId: TypeAlias = int | str
AdapterKey = NewType("AdapterKey", str)


def adapter_key(adapter: AdapterId) -> AdapterKey:
    """The key the prefix index files ``adapter``'s pages under."""
    return AdapterKey(str(adapter))
