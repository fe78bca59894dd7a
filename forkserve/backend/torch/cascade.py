"""Cascade attention in TorchBackend: the control plane's prefix groups as kernel tiles.

The control plane marks items of a step that list the same leading pages
(``SeqWork.shared_prefix``, decided in ``control/sharing.py``). For a decode batch each
group becomes tiles of up to ``agents`` rows; the kernel reads a tile's prefix once for all
its rows and each row's suffix alone: ``kernels.cascade_decode`` over unified K/V (unified,
full_reuse, no-LoRA, adaptive merged), ``kernels.cascade_residual_decode`` in the split form
(shared base pages, each row's own residual). A group of one reads alone: no tile.

Graph-safe: a decode graph is captured per tiles bucket (powers of two); its tile table is
filled like every other input, unused tiles list no row, and the kernels split each range
on the device, so no host value of a replay is baked into the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from forkserve.backend.protocol import SeqWork, SharedPrefix
from forkserve.backend.torch.errors import InvalidWorkError


@dataclass(frozen=True)
class CascadePlan:
    """Host form: rows of the batch per tile (-1 pads to ``agents``), the tile's prefix in
    keys, and each row's first suffix key (its prefix, 0 outside every tile)."""

    tile_rows: tuple[tuple[int, ...], ...]
    tile_lens: tuple[int, ...]
    kv_starts: tuple[int, ...]


@dataclass(frozen=True)
class CascadeTiles:
    """Device form, as the attention backend reads it (int32)."""

    tile_seqs: torch.Tensor  # [n_tiles, agents]
    tile_lens: torch.Tensor  # [n_tiles]
    kv_starts: torch.Tensor  # [batch]


def tiles_bucket(n: int) -> int:
    """Tile slots a decode graph is captured with: 0, then powers of two."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def tiles_buckets(batch: int, agents: int) -> tuple[int, ...]:
    """The tiles buckets a decode batch of up to ``batch`` rows takes when its rows share one
    prefix (the agents of one context), or fewer of them do: no tile, then every bucket up to
    that of ``batch / agents`` tiles. (Past ``agents`` rows one group is several tiles: a
    graph captured ahead with one tile slot alone left every larger batch to capture its own
    on its first step, inside a timed decode tick.) A lone row shares with nobody."""
    if batch < 2:
        return (0,)
    top = tiles_bucket(-(-batch // agents))
    return (0, *(1 << i for i in range(top.bit_length())))


def check_groups(work: Sequence[SeqWork], page_size: int) -> None:
    """A group's members list the same first ``pages`` page ids, all before their new tokens.
    The error names the item (``seq_ids``), as ``batch.validate``'s do."""
    leads: dict[int, SeqWork] = {}
    for seq in work:
        mark = seq.shared_prefix
        if mark is None:
            continue
        error = None
        lead = leads.setdefault(mark.group, seq)
        if mark.pages < 0 or mark.pages * page_size > seq.start_pos:
            error = InvalidWorkError(f"seq {seq.seq_id}: shared prefix of {mark.pages} pages is "
                                     f"not wholly before position {seq.start_pos}")
        elif (lead.shared_prefix.pages != mark.pages
              or lead.slots.pages[:mark.pages] != seq.slots.pages[:mark.pages]):
            error = InvalidWorkError(f"seq {seq.seq_id}: shared prefix group {mark.group} "
                                     f"disagrees with seq {lead.seq_id} on its pages")
        if error is not None:
            error.seq_ids = (seq.seq_id,)
            raise error


def rows_agree(work: Sequence[SeqWork], marks: Sequence[SharedPrefix | None],
               table: np.ndarray) -> bool:
    """``check_groups`` across items and the rows after them (``marks``, their padded page
    ``table``), given each side checked alone: in a group of both, the rows' lead lists the
    items' lead's page count and first pages (a committed tail joins its rows' group)."""
    leads: dict[int, SeqWork] = {}
    for seq in work:
        if seq.shared_prefix is not None:
            leads.setdefault(seq.shared_prefix.group, seq)
    for i, mark in enumerate(marks):
        lead = leads.pop(mark.group, None) if mark is not None else None
        if lead is not None:
            k = lead.shared_prefix.pages
            if mark.pages != k or table[i, :k].tolist() != list(lead.slots.pages[:k]):
                return False
        if not leads:
            break
    return True


def decode_marks(work: Sequence[SeqWork]) -> list[SharedPrefix | None]:
    """The marks of the step's one-token items, in order: the sequences the decode kernels
    attend (every item of a decode batch; a prefill step's decode rows, ``step_rows.py``),
    which its tiles index."""
    return [s.shared_prefix for s in work if len(s.tokens) == 1]


def plan(marks: Sequence[SharedPrefix | None], page_size: int, agents: int) -> CascadePlan | None:
    """Tiles for the groups of at least two items (``marks``: each item's ``shared_prefix``);
    None when no item shares a prefix."""
    groups: dict[int, list[int]] = {}
    for i, mark in enumerate(marks):
        if mark is not None and mark.pages > 0:
            groups.setdefault(mark.group, []).append(i)
    rows, lens, starts = [], [], [0] * len(marks)
    for members in groups.values():
        if len(members) < 2:
            continue
        prefix = marks[members[0]].pages * page_size
        for at in range(0, len(members), agents):
            chunk = members[at:at + agents]
            rows.append((*chunk, *[-1] * (agents - len(chunk))))
            lens.append(prefix)
        for i in members:
            starts[i] = prefix
    return CascadePlan(tuple(rows), tuple(lens), tuple(starts)) if rows else None


def to_device(cascade: CascadePlan, device: torch.device) -> CascadeTiles:
    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return CascadeTiles(tensor(cascade.tile_rows), tensor(cascade.tile_lens),
                        tensor(cascade.kv_starts))


def fill(cascade: CascadePlan | None, out: Mapping[str, np.ndarray]) -> None:
    """Write a plan into a decode graph's host inputs (rows and tiles beyond it keep their
    padding: suffix from key 0, tiles of no row)."""
    if cascade is None:
        return
    n = len(cascade.tile_rows)
    out["kv_starts"][:len(cascade.kv_starts)] = cascade.kv_starts
    out["tile_seqs"][:n] = cascade.tile_rows
    out["tile_lens"][:n] = cascade.tile_lens
