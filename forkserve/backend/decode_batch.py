"""DecodeBatch: the protocol's column form for sessions in steady decode (issue 21).

One row per session that writes exactly one token (the one it sampled last tick) at
``positions[i]`` and samples the next. The control plane builds it once per tick from its
steady-decode set (``engine/steady.py``) instead of one ``SeqWork`` + ``KVSlots`` per session;
a row's pages are a read-only numpy int64 view of the set's copy of its table
(``engine/page_row.py``), so a row costs no copy of its table, even on the tick it gains a
page. ``items()`` turns them into tuples: ``SeqWork`` stays ints and tuples.

Ownership and lifetime: values only (ints, tuples, the requests' ``SamplingParams``), frozen,
valid for the one step they are passed to; page ids stay the control plane's, as in
``SeqWork``. Every row is a committed decode step that writes both sides of its KV
(``write_base`` and ``write_residual``), with no extra residuals and no prompt log-probs.

Repeated objects: from one step to the next the steady set hands the same page-row object
for a row whose pages did not change (a new one when it gains a page or a new member takes
its place) and the same ``shared_prefix`` tuple while its groups stand; an object handed
again lists what it listed then. A backend may key what it derives from them on the objects
(``backend/torch/kept_tables.py``: the page table and cascade tiles, reused across steps).

A backend that reads columns implements ``step_batched(work, batch)``; any other backend is
handed ``[*work, *batch.items()]`` through ``step`` (``step_handle.launch_step``): the two are
the same step.

Fed tokens (``fed``, ``Capabilities.fed_tokens``): a batch whose rows are, row for row, the
rows of a step launched before and not necessarily read back may carry that step's handle
instead of the tokens: row i writes the token row i of that step sampled, which a backend
that keeps its sampled tokens on the device takes from there (no read-back before the next
launch). ``tokens`` then holds placeholders. Only the overlap builds such a batch, only for
a backend that declares the capability; ``resolved`` turns it into a plain batch (it waits
for the earlier step's tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import numpy as np

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import KVSlots, PageId, SamplingParams, SeqWork, SharedPrefix
from forkserve.config import KVForm

if TYPE_CHECKING:
    from forkserve.backend.step_handle import StepHandle


@dataclass(frozen=True)
class DecodeBatch:
    seq_ids: tuple[int, ...]
    tokens: Sequence[int]          # the token each row writes (one per row)
    # Its absolute position (the row's ``start_pos``): a read-only int64 array (any sequence
    # given is made one), advanced in C from one step to the next.
    positions: np.ndarray
    pages: tuple[Sequence[PageId], ...]            # UNIFIED or BASE pages, position order
    # RESIDUAL pages per row (None for a row without them: merged K/V or no adapter).
    residual_pages: tuple[Sequence[PageId] | None, ...]
    forms: tuple[KVForm, ...]        # ``SeqWork.form`` of each row
    adapter_ids: tuple[AdapterId | None, ...]
    adapter_starts: np.ndarray     # ``SeqWork.adapter_start`` of each row (int64, as positions)
    sampling: tuple[SamplingParams, ...]
    # Cascade attention groups, numbered with the ``SeqWork`` items of the same step.
    shared_prefix: tuple[SharedPrefix | None, ...]
    # The step whose sampled tokens the rows write, row for row (``tokens``: placeholders);
    # None: ``tokens`` are the tokens. Only for a backend with ``Capabilities.fed_tokens``.
    fed: "StepHandle | None" = None

    def __post_init__(self) -> None:
        for name in ("positions", "adapter_starts"):
            column = np.asarray(getattr(self, name), dtype=np.int64)
            if column.flags.writeable:  # the batch is the step's: nobody rewrites it
                column = column.view()
                column.flags.writeable = False
            object.__setattr__(self, name, column)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def resolved(self, tokens: Sequence[int] | None = None) -> "DecodeBatch":
        """This batch with the tokens its ``fed`` step sampled (``tokens``: those, already
        read; None: asked of the step's handle, which waits for it), ``fed`` cleared."""
        if self.fed is None:
            return self
        if tokens is None:
            tokens = self.fed.result().next_tokens
        if len(tokens) != len(self):
            raise AssertionError(f"a fed batch of {len(self)} rows from a step of "
                                 f"{len(tokens)} tokens")
        return replace(self, tokens=tuple(tokens), fed=None)

    def items(self) -> list[SeqWork]:
        """The same rows as ``SeqWork`` items (for backends that take only those)."""
        assert self.fed is None, "a fed batch's tokens are placeholders: resolve it first"
        return [SeqWork(seq, (token,), pos, KVSlots(_ids(pages), _ids(residual)), adapter, sampling,
                        decode=True, form=form, adapter_start=start, shared_prefix=shared)
                for seq, token, pos, pages, residual, form, adapter, start, sampling, shared
                in zip(self.seq_ids, self.tokens, self.positions.tolist(), self.pages,
                       self.residual_pages, self.forms, self.adapter_ids,
                       self.adapter_starts.tolist(),
                       self.sampling, self.shared_prefix, strict=True)]


def _ids(pages: Sequence[PageId] | None) -> tuple[PageId, ...] | None:
    """A row's page ids as the tuple ``KVSlots`` carries."""
    if pages is None or isinstance(pages, tuple):
        return pages
    return tuple(np.asarray(pages).tolist())
