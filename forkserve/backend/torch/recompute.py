"""Selective recompute (DroidSpeak-style; docs/QUALITY.md, mode b): the layers in which an
adapter's split item keeps K/V of its own instead of reading the shared base pages.

In a layer of ``config.recompute_layers`` a split item computes merged K/V (its k/v LoRA
delta added, K rotated) from its own hidden states and stores it beside its residual page,
in the pool's own store (``KVPool.own_layer``), addressed by the residual page ids and slots
the control plane already gives it. There it attends exactly as a unified item attends over
its pages; in every other layer it reads the shared base plus its residual. So the reader's
recomputed layers are exact for its hidden states, the others approximate, and with every
layer recomputed the item computes what the unified layout computes.

The own store travels with the residual page (publish, copy-on-write, eviction: one page id),
so no control-plane object knows about it. A step never mixes split items with base-model or
merged items while layers are recomputed (``group_forms``): in a recompute layer the split
items read another store.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from forkserve.backend.torch.attention import AttentionMetadata


def own_view(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` of an all-split batch as a unified batch over the own store: its pages are the
    residual pages (their padding the residual scratch page), no residual to rebuild and no
    shared prefix (pages shared on the base side are each item's own here)."""
    return dataclasses.replace(meta, slot_mapping=meta.res_slot_mapping,
                               block_tables=meta.res_block_tables, res_slot_mapping=None,
                               res_block_tables=None, kv_merge_mask=None, cascade=None,
                               base_writes=meta.res_writes, res_writes=None)


def group_forms(split: Sequence[bool]) -> list[list[int]]:
    """Item indices cut into steps of one form (the split items; the others), each in order."""
    groups = [[i for i, s in enumerate(split) if s], [i for i, s in enumerate(split) if not s]]
    return [g for g in groups if g]
