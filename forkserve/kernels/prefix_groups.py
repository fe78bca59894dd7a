"""Cascade prefill's groups in the form its kernels read: host plan in, int32 tensors out.

Which sequences of a varlen batch form a group, and over how many shared keys, is decided
on the host once per step (the engine: ``KernelAttention._plan`` from the control plane's
``SeqWork.shared_prefix`` marks and its prefill policy); ``prefill_groups`` lays it out for
``shared_prefix_prefill.py``'s launches, and plans the prefix launch's splits. No Triton
here: the kernels package imports it eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

# The prefix launch's query tile, in rows (tokens x padded GQA group), held by 8 warps as the
# decode cascade's prefix tiles (shared_prefix_prefill.py). Its keys are cut into splits,
# each a partial merged with the suffix's by log-sum-exp, until about PREFIX_PROGRAMS
# (query tile x KV head x split) programs run (two waves of one such program per SM on an
# H200's 132), none shorter than PREFIX_MIN_SPLIT_KEYS keys, at most PREFIX_MAX_SPLITS (8
# chunks of 32 tokens at GQA 4 are 1024 rows: 8 tiles x 8 KV heads, 64 programs unsplit
# over an 8K prefix, split 5 ways). Split bounds fall on SPLIT_ALIGN keys (whole key
# blocks). First estimates, to be measured on the H200 (kernel_bench --cascade-prefill).
PREFIX_ROWS = 128
PREFIX_PROGRAMS = 264
PREFIX_MIN_SPLIT_KEYS = 1024
PREFIX_MAX_SPLITS = 16
SPLIT_ALIGN = 64


def gqa_pad(n_heads: int, n_kv: int) -> int:
    """Query heads per KV head, padded to a power of two (a query tile's rows per token)."""
    return 1 << (n_heads // n_kv - 1).bit_length()


def prefix_splits(groups: Sequence[tuple[Sequence[int], int]], query_lens: Sequence[int],
                  n_heads: int, n_kv: int) -> int:
    """Splits of the prefix launch for ``groups`` (as ``prefill_groups`` takes them) over a
    batch of ``query_lens`` (host), at ``n_heads`` / ``n_kv`` heads."""
    if not groups:
        return 1
    rows = max(sum(query_lens[m] for m in members) for members, _ in groups)
    tile = max(1, PREFIX_ROWS // gqa_pad(n_heads, n_kv))
    programs = -(-rows // tile) * len(groups) * n_kv
    cap = min(prefix for _, prefix in groups) // PREFIX_MIN_SPLIT_KEYS
    return max(1, min(-(-PREFIX_PROGRAMS // programs), cap, PREFIX_MAX_SPLITS))


@dataclass(frozen=True)
class PrefillGroups:
    """A varlen batch's cascade groups as the kernels read them (int32 on the device), made
    once per step by ``prefill_groups``."""

    suffix_range: torch.Tensor  # [B, 2]: each sequence's own keys [prefix, seq_len) (0: none)
    rows: torch.Tensor          # [R]: q rows of each group's members, group after group
    starts: torch.Tensor        # [G + 1]: each group's first entry of ``rows``
    tables: torch.Tensor        # [G, W]: the page table a group's prefix is read through
    seq_lens: torch.Tensor      # [G]: prefix + the group's rows (stacked after the prefix)
    prefix_ranges: torch.Tensor  # [S, G, 2]: each split's keys of the prefix [lo, hi)
    max_rows: int               # the most rows of one group (host: the prefix launch's grid)
    grouped_rows: int           # rows in any group (host: fewer than T leaves rows alone)


    @property
    def splits(self) -> int:
        return self.prefix_ranges.shape[0]


def prefill_groups(groups: Sequence[tuple[Sequence[int], int]], query_lens: Sequence[int],
                   seq_lens: Sequence[int], block_tables: torch.Tensor,
                   splits: int = 1) -> PrefillGroups:
    """Device form of ``groups``: (member sequences of the batch, shared prefix in keys) per
    group, over a batch of ``query_lens`` / ``seq_lens`` (host) and its ``block_tables``,
    each prefix cut into ``splits`` ranges (``prefix_splits``; a short prefix leaves some
    empty). Every member's new tokens lie after the prefix and its table lists the group's
    pages there (the first member's are read); a sequence in no group attends all its keys."""
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
        prefix_ranges=ints([_bounds(p, splits)[s:s + 2] for s in range(splits)
                            for p in lens]).view(splits, -1, 2),
        max_rows=max(sizes, default=0), grouped_rows=len(rows))


def _bounds(prefix: int, splits: int) -> list[int]:
    """``splits + 1`` ascending bounds of ``[0, prefix)`` on ``SPLIT_ALIGN`` keys."""
    inner = [prefix * s // splits // SPLIT_ALIGN * SPLIT_ALIGN for s in range(1, splits)]
    return [0, *inner, prefix]
