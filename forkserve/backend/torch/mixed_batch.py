"""join: one flattened batch of two, the second's sequences after the first's (issue 21).

A tick that mixes general items (a prefill, a committed tail) with steady decode rows runs
one eager forward over both. Built as items, the rows cost a ``SeqWork`` each and
``build``'s per-token lists (16 ms at 127 rows over 8K against 1.4 ms from columns), so the
items are built by ``build`` and the rows by ``DecodeRows.to_batch``, and the two are joined
here into what ``build`` makes of ``[*items, *rows]``: the same tensors, value for value.

A field one side leaves out means the same on that side everywhere: no residual writes or
reads (the residual scratch page), no extra residuals, every row writing (``base_writes``);
a side without residuals is merged throughout, so beside a split side its adapter tokens
get their k/v delta in the base pages (``kv_merge_mask``: ``build`` marks the aLoRA tokens
before the activation too, whose delta is zero). Neither side carries cascade tiles: the
joined step's, over its one-token sequences (``cascade.decode_marks`` of the items, then the
rows), are the caller's.

Ownership: fresh tensors of this step; the inputs are not written.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.batch import Batch
from forkserve.backend.torch.cascade import CascadeTiles


def join(a: Batch, b: Batch, scratch_page: int, scratch_res_page: int, page_size: int,
         cascade: CascadeTiles | None = None) -> Batch:
    """``b``'s tokens and sequences after ``a``'s, with the joined step's ``cascade`` tiles."""
    ma, mb = a.meta, b.meta
    assert ma.cascade is None and mb.cascade is None, "the tiles are the joined step's"
    tokens_a = len(a.input_ids)
    width = max(ma.block_tables.shape[1], mb.block_tables.shape[1])
    split = ma.res_slot_mapping is not None or mb.res_slot_mapping is not None
    extra = ma.extra_rows is not None or mb.extra_rows is not None

    def cat(field: str, fill: int | None = None, shift: int = 0) -> torch.Tensor:
        """The field of both sides; ``fill`` for a side that leaves it out (one per token,
        or per sequence for tables); ``shift`` added to ``b``'s values (token rows)."""
        parts = []
        for m, t in ((ma, a), (mb, b)):
            value = getattr(m if hasattr(m, field) else t, field)
            if value is None:
                value = _filled(m, t, field, fill, width)
            elif field.endswith("block_tables"):
                value = F.pad(value, (0, width - value.shape[1]), value=fill)
            parts.append(value)
        parts[1] = parts[1] + shift if shift else parts[1]
        return torch.cat(parts)

    meta = AttentionMetadata(
        slot_mapping=cat("slot_mapping"),
        res_slot_mapping=cat("res_slot_mapping", scratch_res_page * page_size) if split else None,
        block_tables=cat("block_tables", scratch_page),
        res_block_tables=cat("res_block_tables", scratch_res_page) if split else None,
        seq_lens=cat("seq_lens"),
        query_starts=torch.cat([ma.query_starts, mb.query_starts[1:] + tokens_a]),
        seq_slot=cat("seq_slot"),
        query_lens_host=ma.query_lens_host + mb.query_lens_host,
        seq_lens_host=ma.seq_lens_host + mb.seq_lens_host,
        seq_slot_host=ma.seq_slot_host + mb.seq_slot_host,
        decode_only=ma.decode_only and mb.decode_only,
        extra_rows=cat("extra_rows", shift=tokens_a) if extra else None,
        extra_token_slot=cat("extra_token_slot") if extra else None,
        extra_res_slot_mapping=cat("extra_res_slot_mapping") if extra else None,
        kv_merge_mask=_merge_mask(a, b) if split else None,
        cascade=cascade,
        shared_prefix_host=ma.shared_prefix_host and (
            ma.shared_prefix_host + (None,) * len(mb.query_lens_host)),
        base_writes=_writes(a, b, "base_writes", "slot_mapping"),
        res_writes=_writes(a, b, "res_writes", "res_slot_mapping") if split else None)
    return dataclasses.replace(
        a, input_ids=cat("input_ids"), positions=cat("positions"), token_slot=cat("token_slot"),
        logits_indices=cat("logits_indices", shift=tokens_a), meta=meta,
        use_lora=a.use_lora or b.use_lora)


def _filled(meta: AttentionMetadata, batch: Batch, field: str, fill: int | None,
            width: int) -> torch.Tensor:
    """What a side that leaves ``field`` out stands for: ``fill`` per token (per sequence
    and page for a table); nothing for the extra residuals."""
    device = batch.input_ids.device
    if field.startswith("extra_"):
        return torch.empty(0, dtype=torch.int64, device=device)
    if field == "res_block_tables":
        return torch.full((len(meta.seq_lens), width), fill, dtype=meta.block_tables.dtype,
                          device=device)
    return torch.full((len(batch.input_ids),), fill, dtype=meta.slot_mapping.dtype, device=device)


def _merge_mask(a: Batch, b: Batch) -> torch.Tensor | None:
    """The merged tokens of a split step: a side without residuals is merged throughout.
    None where both sides are split throughout (neither has a merged token: no k/v delta to
    add, as ``build`` leaves it of a split batch), known from the host; otherwise all false
    is kept (adds a zero delta) rather than asked of the device, which would wait."""
    if all(t.meta.kv_merge_mask is None and t.meta.res_slot_mapping is not None
           for t in (a, b)):
        return None

    def side(t: Batch) -> torch.Tensor:
        if t.meta.kv_merge_mask is not None:
            return t.meta.kv_merge_mask
        if t.meta.res_slot_mapping is not None:  # split throughout
            return torch.zeros_like(t.token_slot, dtype=torch.bool)[:, None]
        return (t.token_slot >= 0)[:, None]

    return torch.cat([side(a), side(b)])


def _writes(a: Batch, b: Batch, field: str,
            slots: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The joined rows that write (``base_writes`` / ``res_writes``): None where both sides
    write every row; a side without the field writes all its rows, one without residuals
    (``slots`` left out) none."""
    if all(getattr(t.meta, field) is None and getattr(t.meta, slots) is not None
           for t in (a, b)):
        return None
    rows, at = [], []
    shift = 0
    for t in (a, b):
        writes, mapping = getattr(t.meta, field), getattr(t.meta, slots)
        if writes is not None:
            rows.append(writes[0] + shift)
            at.append(writes[1])
        elif mapping is not None:
            rows.append(torch.arange(len(mapping), device=mapping.device) + shift)
            at.append(mapping)
        shift += len(t.input_ids)
    return torch.cat(rows), torch.cat(at)
