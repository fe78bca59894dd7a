"""An adapter's identity below the interfaces: its ``AdapterId`` and its ``AdapterKey``.

A client names an adapter (the ``model`` of a request; ``ServedModel.adapters`` maps names
to ids). The Engine's verbs take a name or an id and resolve it to the backend's
``AdapterId`` (TorchBackend and VllmBackend number resident adapters with ints; MockBackend
keeps what it was given); from there down one type: sessions, nodes, ``SeqWork``,
``ResidualTarget``, ``DecodeBatch`` and ``ResidualKey`` carry that id. The prefix index
spells it as a string in its ``AdapterNamespace``; that spelling is an ``AdapterKey``
(``adapter_key``, the one way to make one): what ``PublishedPage.adapter`` holds and what the
Ray routing stats map back to names.
"""
from __future__ import annotations

from typing import NewType, TypeAlias

AdapterId: TypeAlias = int | str
AdapterKey = NewType("AdapterKey", str)


def adapter_key(adapter: AdapterId) -> AdapterKey:
    """The key the prefix index files ``adapter``'s pages under."""
    return AdapterKey(str(adapter))
