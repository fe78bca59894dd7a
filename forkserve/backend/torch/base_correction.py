"""What a split item does to shared base K/V before attending over it (``config.base_correction``;
docs/QUALITY.md, mode d): a strategy of the eager attention path.

The pool tags every base slot with its writer (``KVPool.writer``: the adapter slot + 1 of the
forward that wrote it, 0 for the base model, ``UNKNOWN_WRITER`` (-1) before any write and after
the writer's adapter left: row 0 of ``pair_row``, no correction). On read, a split item of
adapter slot s (the reader) adds, at each position whose writer w is another adapter or the base
model, that pair's fitted offset (``offset_table.py``); its own positions, every base-model or
merged item's reads and every pair without a table get exactly zero. The control plane is
unchanged: who may read whose pages is still ``KVCache.may_read``; this only changes what a
permitted read returns.

K is stored rotated, and the offset is fitted before RoPE (there it does not depend on the
position), so the stored K is de-rotated to z_k, the estimate computed from it and rotated
back at the position: K_read = K + RoPE_p(c_k + z_k U_k V_k^T); V_read = V + c_v + V U_v V_v^T.
"""
from __future__ import annotations

from typing import Mapping, Protocol

import torch

from forkserve.backend.torch.model_config import ModelConfig
from forkserve.backend.torch.offset_table import BASE_MODEL, OffsetTable
from forkserve.backend.torch.rope import Rope, apply_rope
from forkserve.config import BaseCorrection


class Correction(Protocol):
    # Whether the pool must tag base slots with their writer (``KVPool.writer``).
    tags_writers: bool

    def bind(self, slots: Mapping[str, int]) -> None:
        """The resident adapters' slots, by name (called whenever they change)."""

    def correct(self, keys: torch.Tensor, values: torch.Tensor, writers: torch.Tensor,
                reader: torch.Tensor, layer: int, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values [..., S, Hkv, D] of a layer's base pages (K rotated at positions 0..S-1),
        writers [..., S] their tags, reader [...] the reading item's adapter slot (-1: none)."""


class NoCorrection:
    tags_writers = False

    def bind(self, slots: Mapping[str, int]) -> None:
        pass

    def correct(self, keys: torch.Tensor, values: torch.Tensor, writers: torch.Tensor,
                reader: torch.Tensor, layer: int, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values


class OffsetCorrection:
    """The fitted offsets of ``OffsetTable`` on device. Row 0 of every table is zero: the row of
    every (writer, reader) without a fitted pair, the writer itself reading, and every read by
    something that is not a split adapter item."""

    tags_writers = True

    def __init__(self, cfg: ModelConfig, max_slots: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        # [writer tag + 1, reader slot + 1] -> table row; updated in place (graphs hold it).
        self.pair_row = torch.zeros(max_slots + 2, max_slots + 1, dtype=torch.int64, device=device)
        self._tables(OffsetTable(0, 0.0, 0, ()))
        self._slots: Mapping[str, int] = {}

    def install(self, table: OffsetTable) -> None:
        """Replace the tables (before any CUDA graph is captured: graphs hold the tensors)."""
        layers, kv = self.cfg.num_layers, self.cfg.kv_size
        for p in table.pairs:
            if p.c.shape != (layers, 2, kv) or p.u.shape != (layers, 2, kv, table.rank):
                raise ValueError(f"offset pair {p.writer!r} -> {p.reader!r} has shapes "
                                 f"{tuple(p.c.shape)} / {tuple(p.u.shape)}, not this model's "
                                 f"({layers}, 2, {kv}) at rank {table.rank}")
        self._tables(table)
        self.bind(self._slots)

    def _tables(self, table: OffsetTable) -> None:
        self.table: OffsetTable = table
        layers, kv, rank = self.cfg.num_layers, self.cfg.kv_size, table.rank

        def stacked(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
            return torch.stack([torch.zeros(shape, dtype=self.dtype), *[t.cpu() for t in parts]]
                               ).to(self.device, self.dtype)

        self.c = stacked([p.c for p in table.pairs], (layers, 2, kv))
        self.u = stacked([p.u for p in table.pairs], (layers, 2, kv, rank))
        self.vt = stacked([p.vt for p in table.pairs], (layers, 2, rank, kv))

    def bind(self, slots: Mapping[str, int]) -> None:
        self._slots = dict(slots)
        tag = {BASE_MODEL: 0, **{name: s + 1 for name, s in slots.items()}}
        self.pair_row.zero_()
        for row, p in enumerate(self.table.pairs, start=1):
            if p.writer != p.reader and p.writer in tag and p.reader in slots:
                self.pair_row[tag[p.writer] + 1, slots[p.reader] + 1] = row

    def correct(self, keys: torch.Tensor, values: torch.Tensor, writers: torch.Tensor,
                reader: torch.Tensor, layer: int, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.pair_row[writers.long() + 1, (reader + 1).unsqueeze(-1)]   # [..., S]
        seq, shape = keys.shape[-3], keys.shape
        cos, sin = rope.cos_sin(torch.arange(seq, device=keys.device), keys.dtype)
        z_k = apply_rope(keys, cos, -sin).flatten(-2)
        offset = [self.c[rows, layer, side] for side in (0, 1)]               # [..., S, kv]
        if self.table.rank:
            for side, z in ((0, z_k), (1, values.flatten(-2))):
                coef = torch.einsum("...k,...kr->...r", z, self.u[rows, layer, side])
                offset[side] = offset[side] + torch.einsum("...r,...rk->...k", coef,
                                                           self.vt[rows, layer, side])
        return (keys + apply_rope(offset[0].view(shape), cos, sin),
                values + offset[1].view(values.shape))


def correction_for(choice: BaseCorrection, cfg: ModelConfig, max_slots: int, device: torch.device,
                   dtype: torch.dtype) -> NoCorrection | OffsetCorrection:
    if choice is BaseCorrection.OFFSET:
        return OffsetCorrection(cfg, max_slots, device, dtype)
    return NoCorrection()
