"""DecodeRows: a decode-only step as the host arrays its forward reads (issue 21).

One token per row: ``[B]`` int64 columns and ``[B, width]`` page tables, ``width`` the widest
row's pages. A CUDA graph copies them into its pinned input buffer; the eager forward wraps
them as tensors (``to_batch``, the same values ``batch.build`` computes from the items).

Two sources. ``of_items``: decode ``SeqWork`` items, their scalars gathered in one pass and
their page tables kept like ``of_batch``'s (an item repeating its page tuple reuses its row;
the tables check the items' page ids, which ``batch.validate`` then leaves). ``of_batch``: a
``DecodeBatch``'s columns in numpy, so no step walks a row's pages in Python (at 256 rows
over an 8K context that walk — a tuple per row, a validation pass per page, a table row
assigned from a tuple — was ~30 us a row, most of the GPU's idle time between steps); its
page tables and cascade groups come from ``KeptTables`` (``kept_tables.py``: the last
launch's, with only the rows whose pages changed written again). ``of_batch`` also checks
what ``batch.validate`` checks of such rows, on the columns; it answers None where that
check would refuse one, and the caller then runs the rows as items, whose validation
raises the error that names the row.

Ownership: arrays of this step (fresh, read-only views the batch owns, or read-only tables
``KeptTables`` may hand to later steps too: nobody writes them); page ids stay the control
plane's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from forkserve.backend.decode_batch import DecodeBatch
from forkserve.backend.protocol import SeqWork, form_conflict
from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.batch import Batch, BatchLimits, kv_merged
from forkserve.backend.torch.kept_tables import KeptTables
from forkserve.config import KVForm

ROW_FIELDS = ("input_ids", "positions", "token_slot", "slot_mapping", "res_slot_mapping",
              "seq_lens", "seq_slot", "kv_merge")
TABLE_FIELDS = ("block_tables", "res_block_tables")


@dataclass(frozen=True)
class DecodeRows:
    input_ids: np.ndarray         # [B] int64 each
    positions: np.ndarray
    token_slot: np.ndarray        # the token's adapter slot, -1: base model (aLoRA, before it)
    slot_mapping: np.ndarray
    res_slot_mapping: np.ndarray
    seq_lens: np.ndarray
    seq_slot: np.ndarray          # whose B rebuilds K/V on read, -1: merged or no adapter
    kv_merge: np.ndarray          # 1: a merged row of an adapter, its k/v delta in its base page
    block_tables: np.ndarray      # [B, width] int64, padded with the scratch page
    res_block_tables: np.ndarray  # [B, width] int64, the residual scratch page where none
    has_adapter: bool             # a row names an adapter (the graph key's LoRA flag)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def split(self) -> bool:
        """A row reads a residual (K/V rebuilt on read)."""
        return bool((self.seq_slot >= 0).any())

    @property
    def mixed(self) -> bool:
        """Merged rows of an adapter among split ones: their k/v LoRA delta goes into their
        base pages (the form mask; the mixed decode graph)."""
        return self.split and bool(self.kv_merge.any())

    def to_batch(self, device: torch.device, cascade: cascade_tiles.CascadePlan | None) -> Batch:
        """The eager forward's tensors: what ``batch.build`` makes of the same rows."""
        def tensor(values: np.ndarray, dtype: np.dtype) -> torch.Tensor:
            # A copy (some columns are the batch's read-only arrays), converted by numpy:
            # torch.tensor(array, dtype=) walks a 256 x 513 table element by element (~6 ms).
            return torch.from_numpy(np.array(values, dtype=dtype)).to(device, non_blocking=True)

        n, split = len(self), self.split
        seq_lens = tensor(self.seq_lens, np.int32)
        meta = AttentionMetadata(
            slot_mapping=tensor(self.slot_mapping, np.int64),
            res_slot_mapping=tensor(self.res_slot_mapping, np.int64) if split else None,
            block_tables=tensor(self.block_tables, np.int32),
            res_block_tables=tensor(self.res_block_tables, np.int32) if split else None,
            seq_lens=seq_lens, query_starts=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_slot=tensor(self.seq_slot, np.int64), query_lens_host=(1,) * n,
            seq_lens_host=tuple(self.seq_lens.tolist()),
            seq_slot_host=tuple(self.seq_slot.tolist()),
            decode_only=True,
            kv_merge_mask=tensor(self.kv_merge, np.bool_)[:, None] if self.mixed else None,
            cascade=cascade_tiles.to_device(cascade, device) if cascade is not None else None)
        return Batch(input_ids=tensor(self.input_ids, np.int64),
                     positions=tensor(self.positions, np.int64),
                     token_slot=tensor(self.token_slot, np.int64),
                     logits_indices=torch.arange(n, device=device), meta=meta,
                     use_lora=bool((self.token_slot >= 0).any()) or split)


def of_items(work: Sequence[SeqWork], limits: BatchLimits, adapter_slots: Mapping[int, int],
             scratch_page: int, scratch_res_page: int, kept: KeptTables) -> DecodeRows | None:
    """Decode items (one token each), validated but for their pages
    (``batch.validate(page_ids=False)``): they may skip a side's write (``write_base`` /
    ``write_residual``), which steady rows never do. None where a row lists too few pages or
    a page id outside its pool, checked on the tables (``KeptTable.build``), not id by id:
    the caller then validates the items whole, which names the row. ``kept``: the last
    items' tables (its groups unused: ``validate`` checks the items'), reused for an item
    that repeats its page tuple (a control plane's ``PageTable.frozen``)."""
    p, n = limits.page_size, len(work)
    pages = tuple(s.slots.pages for s in work)
    residual = tuple(s.slots.residual_pages for s in work)
    used = np.fromiter((s.start_pos // p + 1 for s in work), np.int64, n)
    tables = kept.pages.build(pages, used, None, limits.num_pages, scratch_page)
    if tables is None:
        return None
    if any(r is not None for r in residual):
        res_tables = kept.residual.build(residual, used,
                                         np.fromiter((r is not None for r in residual), bool, n),
                                         limits.num_residual_pages, scratch_res_page)
        if res_tables is None:
            return None
    else:  # no row reads a residual (the kept residual table waits for items that do)
        res_tables = np.full(tables.shape, scratch_res_page, dtype=np.int64)
    # A row's scalars as a tuple, then every column in one conversion: a numpy store per
    # field and row was most of this function's time.
    rows: list[tuple[int, ...]] = []
    for seq, listed, res in zip(work, pages, residual, strict=True):
        slot = -1 if seq.adapter_id is None else adapter_slots[seq.adapter_id]
        at = seq.start_pos
        last = at // p
        rows.append((  # ROW_FIELDS's order
            seq.tokens[0], at,
            slot if at >= seq.adapter_start else -1,  # aLoRA: the base model before it
            listed[last] * p + at % p if seq.write_base else scratch_page * p,
            res[last] * p + at % p if res is not None and seq.write_residual
            else scratch_res_page * p,
            at + 1, slot if res is not None else -1, kv_merged(seq, slot, limits)))
    columns = np.array(rows, dtype=np.int64).T
    return DecodeRows(**dict(zip(ROW_FIELDS, columns, strict=True)), block_tables=tables,
                      res_block_tables=res_tables,
                      has_adapter=any(s.adapter_id is not None for s in work))


def of_batch(batch: DecodeBatch, limits: BatchLimits, adapter_slots: Mapping[int, int],
             scratch_page: int, scratch_res_page: int, kept: KeptTables) -> DecodeRows | None:
    """A ``DecodeBatch``'s rows (every one writes both sides), or None where ``batch.validate``
    would refuse one of them. ``kept``: the tables and groups of the last launch, reused
    where this batch repeats its objects (and updated to this one's)."""
    p, n = limits.page_size, len(batch)
    positions = batch.positions
    ids = np.asarray(batch.tokens, dtype=np.int64)
    if (positions.min() < 0 or batch.adapter_starts.min() < 0 or ids.min() < 0
            or ids.max() >= limits.vocab_size or positions.max() >= limits.max_context):
        return None
    if any(a is not None and a not in adapter_slots for a in set(batch.adapter_ids)):
        return None
    slot = np.fromiter((-1 if a is None else adapter_slots[a] for a in batch.adapter_ids),
                       np.int64, n)
    has_res = np.fromiter((r is not None for r in batch.residual_pages), bool, n)
    kinds = set(zip(batch.forms, batch.adapter_ids, has_res.tolist(), strict=True))
    if any(form_conflict(0, *kind) is not None for kind in kinds):
        return None
    if has_res.any() and not limits.disaggregated:
        return None
    # ``kv_merged`` on the columns (merged rows of an adapter, where the pool splits others).
    merged = np.fromiter((f is KVForm.MERGED for f in batch.forms), bool, n) & (slot >= 0)
    if merged.any() and not limits.merged_form:
        return None
    used = positions // p + 1
    rows = np.arange(n)
    offset = positions % p
    tables = kept.pages.build(batch.pages, used, None, limits.num_pages, scratch_page)
    if tables is None or not kept.groups.agree(batch.shared_prefix, tables, kept.pages.changed,
                                               positions):
        return None
    res_tables = kept.residual.build(batch.residual_pages, used, has_res,
                                     limits.num_residual_pages, scratch_res_page)
    if res_tables is None:
        return None
    last = used - 1
    return DecodeRows(
        input_ids=ids, positions=positions,
        token_slot=np.where(positions >= batch.adapter_starts, slot, -1),
        slot_mapping=tables[rows, last] * p + offset,
        res_slot_mapping=np.where(has_res, res_tables[rows, last] * p + offset,
                                  scratch_res_page * p),
        seq_lens=positions + 1, seq_slot=np.where(has_res, slot, -1),
        kv_merge=(merged & limits.disaggregated).astype(np.int64),
        block_tables=tables, res_block_tables=res_tables, has_adapter=bool((slot >= 0).any()))
