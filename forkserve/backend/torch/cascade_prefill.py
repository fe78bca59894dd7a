"""Cascade prefill in TorchBackend: a step's prefill chunks grouped by their shared prefix.

The control plane marks the items of a step that list the same leading pages
(``SeqWork.shared_prefix``, ``control/sharing.py``), prefill chunks as well as decode rows;
``batch.build`` carries the marks to attention (``AttentionMetadata.shared_prefix_host``).
Decode rows use them as tiles (``cascade.py``); here the chunks of a group (32 agents each
prefilling an observation over one context) become one ``kernels.cascade_prefill`` call:
the prefix read once for all their rows, each suffix alone, merged by log-sum-exp. Which
groups take it is the prefill policy's ``cascade_group`` (short chunks over a long prefix),
asked by ``KernelAttention._plan`` once per step on host counts: the part below is made
then and reused by every layer, so no layer reads the device back.

Unified form only (unified, full_reuse, no-LoRA, adaptive merged pages): in the split form
each member rebuilds its keys with its own adapter's residual, so ``_plan`` leaves every
chunk on its residual route (the ungrouped path, same result). A group of one, or of no
prefix, is no group: its chunk keeps the batch route.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from forkserve import kernels
from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.kv_pool import LayerKV
from forkserve.backend.torch.step_rows import prefill_part


@dataclass(frozen=True)
class CascadePart:
    """The chunks of one step on the ``CASCADE`` route: their rows of q, their attention
    view (batch order), the groups over that view as the kernels read them, its counts."""

    members: frozenset[int]   # indices into the step's sequences
    rows: torch.Tensor        # [R] int64
    view: AttentionMetadata
    groups: kernels.PrefillGroups
    counts: kernels.PrefillCounts

    def attend(self, q: torch.Tensor, kv: LayerKV, scale: float,
               use_triton: bool | None) -> torch.Tensor:
        """``q``: these chunks' rows only. Returns ``[R, Hq, D]``."""
        v = self.view
        return kernels.cascade_prefill(q, kv.k, kv.v, v.block_tables, v.seq_lens,
                                       v.query_starts, self.groups, scale,
                                       use_triton=use_triton, counts=self.counts)


def marked_groups(meta: AttentionMetadata, seqs: Sequence[int],
                  page_size: int) -> list[tuple[tuple[int, ...], int]]:
    """The groups of at least two of ``seqs`` (indices into ``meta``'s sequences) that
    share a prefix of at least one page: (members, prefix in keys), by first member."""
    groups: dict[int, list[int]] = {}
    marks = meta.shared_prefix_host
    for i in seqs:
        mark = marks[i] if marks else None
        if mark is not None and mark.pages > 0:
            groups.setdefault(mark.group, []).append(i)
    return [(tuple(m), marks[m[0]].pages * page_size) for m in groups.values() if len(m) >= 2]


def cascade_part(meta: AttentionMetadata, seqs: Sequence[int], page_size: int,
                 policy: kernels.PrefillAttentionPolicy,
                 heads: tuple[int, int]) -> CascadePart | None:
    """The part of ``seqs`` whose groups the policy sends to ``CASCADE``, its prefix launch
    split for ``heads`` (query, KV heads); None: no group."""
    lens = meta.query_lens_host
    chosen = [(m, prefix) for m, prefix in marked_groups(meta, seqs, page_size)
              if policy.cascade_group(prefix, tuple(lens[i] for i in m))]
    if not chosen:
        return None
    members = sorted(i for m, _ in chosen for i in m)
    at = {i: j for j, i in enumerate(members)}
    rows, view = prefill_part(meta, members)
    local = [(tuple(at[i] for i in m), p) for m, p in chosen]
    splits = kernels.prefix_splits(local, view.query_lens_host, *heads)
    groups = kernels.prefill_groups(local, view.query_lens_host, view.seq_lens_host,
                                    view.block_tables, splits)
    return CascadePart(frozenset(members), rows, view, groups,
                       kernels.PrefillCounts(view.query_lens_host, view.seq_lens_host))
