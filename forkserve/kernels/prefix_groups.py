"""Cascade prefill's groups in the form its kernels read: host plan in, int32 tensors out.

Which sequences of a varlen batch form a group, and over how many shared keys, is decided
on the host once per step (the engine: ``KernelAttention._plan`` from the control plane's
``SeqWork.shared_prefix`` marks and its prefill policy); ``prefill_groups`` lays it out for
``shared_prefix_prefill.py``'s two launches. No Triton here: the kernels package imports it eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch


@dataclass(frozen=True)
class PrefillGroups:
    """A varlen batch's cascade groups as the kernels read them (int32 on the device), made
    once per step by ``prefill_groups``."""

    suffix_range: torch.Tensor  # [B, 2]: each sequence's own keys [prefix, seq_len) (0: none)
    rows: torch.Tensor          # [R]: q rows of each group's members, group after group
    starts: torch.Tensor        # [G + 1]: each group's first entry of ``rows``
    tables: torch.Tensor        # [G, W]: the page table a group's prefix is read through
    seq_lens: torch.Tensor      # [G]: prefix + the group's rows (stacked after the prefix)
    prefix_range: torch.Tensor  # [G, 2]: (0, prefix)
    max_rows: int               # the most rows of one group (host: the prefix launch's grid)
    grouped_rows: int           # rows in any group (host: fewer than T leaves rows alone)


def prefill_groups(groups: Sequence[tuple[Sequence[int], int]], query_lens: Sequence[int],
                   seq_lens: Sequence[int], block_tables: torch.Tensor) -> PrefillGroups:
    """Device form of ``groups``: (member sequences of the batch, shared prefix in keys) per
    group, over a batch of ``query_lens`` / ``seq_lens`` (host) and its ``block_tables``.
    Every member's new tokens lie after the prefix and its table lists the group's pages
    there (the first member's are read); a sequence in no group attends all its keys."""
    starts = (0, *accumulate(query_lens))
    suffix = [[0, n] for n in seq_lens]
    rows, group_starts, lens, leads, seen = [], [0], [], [], set()
    for members, prefix in groups:
        if len(members) < 1 or prefix < 1:
            raise ValueError(f"a cascade group needs members and a prefix; got {members}, "
                             f"{prefix}")
        for m in members:
            if m in seen or prefix > seq_lens[m] - query_lens[m]:
                raise ValueError(f"sequence {m}: in two groups, or its new tokens start "
                                 f"before the group's prefix of {prefix} keys")
            seen.add(m)
            suffix[m][0] = prefix
            rows.extend(range(starts[m], starts[m + 1]))
        group_starts.append(len(rows))
        lens.append(prefix)
        leads.append(members[0])
    sizes = [b - a for a, b in zip(group_starts, group_starts[1:], strict=False)]
    device = block_tables.device

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).reshape(-1).to(device, non_blocking=True)

    return PrefillGroups(
        suffix_range=ints(suffix).view(-1, 2), rows=ints(rows), starts=ints(group_starts),
        tables=block_tables.index_select(0, ints(leads)),
        seq_lens=ints([p + n for p, n in zip(lens, sizes, strict=True)]),
        prefix_range=ints([[0, p] for p in lens]).view(-1, 2),
        max_rows=max(sizes, default=0), grouped_rows=len(rows))
