"""SharedKV: the tables of one shared-context prefill (``residual_source = base_activations``).

One base-model pass over a context many agents share writes its base pages and, from the
same activations, each listed adapter's rank-r residual (``SeqWork.extra_residuals``).
``KVCache.shared_kv`` builds the tables, already holding what is published of the context on
every side; ``Stepper.write_shared`` writes the rest; ``KVCache.publish_shared`` publishes it.

Ownership: a SharedKV owns one pool reference per page its tables list, from
``KVCache.shared_kv`` until ``release`` (the index keeps what was published). It is never a
session's: no node holds it and no tick sees it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import ResidualTarget
from forkserve.control.page_table import PageTable


@dataclass(frozen=True)
class SharedKV:
    base: PageTable                                # the base model's K/V (BASE pages)
    residuals: Mapping[AdapterId, PageTable]     # each adapter's residual (RESIDUAL pages)

    @property
    def length(self) -> int:
        """Tokens written on every side (the sides start equal and advance together)."""
        return self.base.length

    def tables(self) -> Iterator[PageTable]:
        yield self.base
        yield from self.residuals.values()

    def targets(self) -> tuple[ResidualTarget, ...]:
        """The residuals a step writes from the base pass's activations."""
        return tuple(ResidualTarget(a, table.frozen()) for a, table in self.residuals.items())

    def release(self) -> None:
        for table in self.tables():
            table.release()
