"""Work items in, one flattened batch out: validation first, then index tensors.

`validate` runs before anything is written, so a rejected step leaves the pools untouched.
`build` turns SeqWork items into token-major tensors (T tokens over B sequences) and the
AttentionMetadata every attention backend reads. With a residual pool, an adapter's item
in the split form (``SeqWork.form``) reads base + residual pages (K/V rebuilt on read) and
one in the merged form gets its k/v LoRA delta in the base pages; a batch holding only
merged items is built exactly as in the unified layout. `write_base` covers the item's
`pages` in every layout (unified pages too); `write_residual` its residual pages; in a
prefill, the rows of a side not written are left out of its scatter (``base_writes`` /
``res_writes``). Padding (for CUDA graphs) points at the pool's scratch page, never at a
real one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from forkserve import errors
from forkserve.backend.protocol import SeqWork, form_conflict
from forkserve.backend.torch import cascade as cascade_tiles
from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.errors import (
    ContextLengthError,
    InvalidWorkError,
    TokenOutOfVocabError,
    UnknownAdapterError,
)
from forkserve.config import KVForm


@dataclass(frozen=True)
class BatchLimits:
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int
    num_residual_pages: int
    disaggregated: bool  # the pool keeps BASE + RESIDUAL pages (split items may run)
    recompute: bool = False  # selective recompute layers: split items keep own K/V in some layers
    # An adapter's item may run merged (every layout but disaggregated): beside split items
    # its k/v LoRA delta goes into the base pages (``kv_merged``), in a decode graph too.
    merged_form: bool = True


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    token_slot: torch.Tensor      # [T] adapter slot per token, -1 none
    logits_indices: torch.Tensor  # rows of T whose logits are computed
    meta: AttentionMetadata
    use_lora: bool


def _check_pages(seq: SeqWork, pages: Sequence[int], limit: int, need: int, what: str,
                 page_size: int) -> None:
    if len(pages) * page_size < need:
        raise InvalidWorkError(f"seq {seq.seq_id}: {len(pages)} {what} pages of {page_size} tokens "
                               f"cannot hold positions [0, {need})")
    bad = [p for p in pages[: -(-need // page_size)] if not 0 <= p < limit]
    if bad:
        raise InvalidWorkError(f"seq {seq.seq_id}: {what} page ids {bad} outside [0, {limit})")


def validate(work: Sequence[SeqWork], limits: BatchLimits, adapter_slots: Mapping[int, int],
             page_ids: bool = True) -> None:
    """Check every item before anything is written; an error names its item (``seq_ids``),
    so the caller can fail that item alone and run the others. ``page_ids`` False: the
    items' ``slots`` (both sides) are left to the caller, who checks them on the tables it
    builds (``decode_rows.of_items``) and validates again where those refuse one."""
    for seq in work:
        try:
            _validate_item(seq, limits, adapter_slots, page_ids)
        except errors.ForkServeError as exc:
            exc.seq_ids = (seq.seq_id,)
            raise
    cascade_tiles.check_groups(work, limits.page_size)


def _validate_item(seq: SeqWork, limits: BatchLimits, adapter_slots: Mapping[int, int],
                   page_ids: bool) -> None:
    if not seq.tokens:
        raise InvalidWorkError(f"seq {seq.seq_id}: no tokens")
    if seq.start_pos < 0:
        raise InvalidWorkError(f"seq {seq.seq_id}: negative start_pos {seq.start_pos}")
    if seq.adapter_start < 0:
        raise InvalidWorkError(f"seq {seq.seq_id}: negative adapter_start {seq.adapter_start}")
    bad = [t for t in seq.tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise TokenOutOfVocabError(f"seq {seq.seq_id}: token ids {bad[:5]} outside the vocabulary "
                                   f"[0, {limits.vocab_size})")
    end = seq.start_pos + len(seq.tokens)
    if end > limits.max_context:
        raise ContextLengthError(f"seq {seq.seq_id}: {end} tokens exceed the model's context of "
                                 f"{limits.max_context}")
    if seq.adapter_id is not None and seq.adapter_id not in adapter_slots:
        raise UnknownAdapterError(f"seq {seq.seq_id}: adapter id {seq.adapter_id} is not resident")
    if page_ids:
        _check_pages(seq, seq.slots.pages, limits.num_pages, end, "KV", limits.page_size)
    conflict = form_conflict(seq.seq_id, seq.form, seq.adapter_id,
                             seq.slots.residual_pages is not None)
    if conflict is not None:
        raise InvalidWorkError(conflict)
    if seq.adapter_id is not None and seq.form is KVForm.MERGED and not limits.merged_form:
        raise InvalidWorkError(f"seq {seq.seq_id}: this layout keeps an adapter's K/V split; "
                               f"merged K/V of adapter {seq.adapter_id!r} needs another layout")
    if seq.slots.residual_pages is not None:
        if not limits.disaggregated:
            raise InvalidWorkError(f"seq {seq.seq_id}: the split form needs a residual pool; "
                                   f"this layout keeps merged K/V only")
        if page_ids:
            _check_pages(seq, seq.slots.residual_pages, limits.num_residual_pages, end,
                         "residual", limits.page_size)
    if seq.extra_residuals and limits.recompute:
        raise InvalidWorkError(f"seq {seq.seq_id}: extra residuals (base_activations) cannot "
                               f"fill the recompute layers' own K/V, which only the adapter's "
                               f"own forward computes")
    for target in seq.extra_residuals:
        if not limits.disaggregated:
            raise InvalidWorkError(f"seq {seq.seq_id}: extra residuals need the disaggregated "
                                   f"layout")
        if target.adapter_id not in adapter_slots:
            raise UnknownAdapterError(f"seq {seq.seq_id}: adapter id {target.adapter_id} is not "
                                      f"resident")
        _check_pages(seq, target.residual_pages, limits.num_residual_pages, end, "residual",
                     limits.page_size)


def kv_merged(seq: SeqWork, slot: int, limits: BatchLimits) -> bool:
    """Whether an item's k/v LoRA delta goes into its base pages although the batch may
    write residuals: a merged item of an adapter beside split ones (adaptive layout)."""
    return limits.disaggregated and slot >= 0 and seq.form is KVForm.MERGED


def _page_slots(pages: Sequence[int], start: int, end: int, p: int) -> list[int]:
    """The flat KV slots of positions [start, end) behind ``pages``: a run per page, not a
    Python step per token (an 8K-token item is 512 runs)."""
    out: list[int] = []
    for page in range(start // p, -(-end // p)):
        at = pages[page] * p - page * p  # slot of position x on this page: at + x
        out.extend(range(at + max(start, page * p), at + min(end, (page + 1) * p)))
    return out


def _extra_residual_writes(seq: SeqWork, first: int, adapter_slots: Mapping[int, int],
                           p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """base_activations: the rows, adapter slots and flat residual slots of every target's
    writes for ``seq``'s tokens (rows from ``first``), target after target. Tensor
    arithmetic per target, not a Python step per token and target: a shared 8K context
    for 32 adapters is 262K writes (~0.13 s of host time a pass as a loop)."""
    n = len(seq.tokens)
    at = torch.arange(seq.start_pos, seq.start_pos + n)
    lo, hi = seq.start_pos // p, -(-(seq.start_pos + n) // p)
    page_of, offset = at // p - lo, at % p
    slots, res = [], []
    for target in seq.extra_residuals:
        pages = torch.tensor(target.residual_pages[lo:hi], dtype=torch.int64)
        res.append(pages[page_of] * p + offset)
        slots.append(torch.full((n,), adapter_slots[target.adapter_id], dtype=torch.int64))
    rows = torch.arange(first, first + n).repeat(len(seq.extra_residuals))
    return rows, torch.cat(slots), torch.cat(res)


def build(work: Sequence[SeqWork], limits: BatchLimits, adapter_slots: Mapping[int, int],
          all_logits: bool, device: torch.device, scratch_page: int, scratch_res_page: int,
          cascade: cascade_tiles.CascadePlan | None = None, marks: bool = False) -> Batch:
    """Flatten `work` (already validated). Logits rows: every token if all_logits, else every
    token of an item that asks for prompt log-probabilities and the last token of any other
    item that samples. `cascade`: tiles of a decode batch; `marks`: carry the items' shared
    prefix marks to attention (a step that prefills may group its chunks)."""
    p = limits.page_size
    ids, pos, tok_slot, slots, res_slots, logit_rows, merged_tokens = [], [], [], [], [], [], []
    extra: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    base_rows, base_at, res_rows, res_at = [], [], [], []
    tables, res_tables, seq_lens, qlens, seq_slot = [], [], [], [], []
    for seq in work:
        slot = -1 if seq.adapter_id is None else adapter_slots[seq.adapter_id]
        n, end = len(seq.tokens), seq.start_pos + len(seq.tokens)
        pages = seq.slots.pages
        res = seq.slots.residual_pages
        merged = kv_merged(seq, slot, limits)
        first = len(ids)
        start = seq.start_pos
        ids.extend(seq.tokens)
        pos.extend(range(start, end))
        # Activated LoRA: tokens before the invocation run as the base model (no LoRA delta:
        # a merged item's base pages get base K/V there, a split item's residual zeros).
        before = min(max(seq.adapter_start - start, 0), n)
        tok_slot.extend([-1] * before + [slot] * (n - before))
        merged_tokens.extend([merged] * n)
        # A side that is already present (write_base / write_residual False: aliased pages
        # of a fork, a partial prefix hit) is read, never rewritten: its write goes to scratch.
        slots.extend(_page_slots(pages, start, end, p) if seq.write_base
                     else [scratch_page * p] * n)
        res_slots.extend(_page_slots(res, start, end, p) if res is not None and seq.write_residual
                         else [scratch_res_page * p] * n)
        # The same writes as row lists (``base_writes``), used where some row skips its write.
        if seq.write_base:
            base_rows.extend(range(first, first + n))
            base_at.extend(slots[first:])
        if res is not None and seq.write_residual:
            res_rows.extend(range(first, first + n))
            res_at.extend(res_slots[first:])
        if seq.extra_residuals:
            extra.append(_extra_residual_writes(seq, first, adapter_slots, p))
        if all_logits or seq.prompt_logprobs is not None:
            logit_rows.extend(range(first, first + n))
        elif seq.sampling is not None:
            logit_rows.append(first + n - 1)
        used = -(-end // p)
        tables.append(list(pages[:used]))
        res_tables.append(list(res[:used]) if res is not None else [scratch_res_page] * used)
        seq_lens.append(end)
        qlens.append(n)
        seq_slot.append(slot if res is not None else -1)  # whose B rebuilds K/V on read
    split = any(s >= 0 for s in seq_slot)
    width = max(len(t) for t in tables)
    tables = [t + [scratch_page] * (width - len(t)) for t in tables]
    res_tables = [t + [scratch_res_page] * (width - len(t)) for t in res_tables]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def extra_part(i: int) -> torch.Tensor | None:
        return torch.cat([e[i] for e in extra]).to(device, non_blocking=True) if extra else None

    decode_only = all(n == 1 for n in qlens)
    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        res_slot_mapping=tensor(res_slots, torch.int64) if split else None,
        block_tables=tensor(tables, torch.int32),
        res_block_tables=tensor(res_tables, torch.int32) if split else None,
        seq_lens=tensor(seq_lens, torch.int32),
        query_starts=tensor(starts, torch.int32),
        seq_slot=tensor(seq_slot, torch.int64),
        query_lens_host=tuple(qlens),
        seq_lens_host=tuple(seq_lens),
        seq_slot_host=tuple(seq_slot),
        decode_only=decode_only,
        extra_rows=extra_part(0),
        extra_token_slot=extra_part(1),
        extra_res_slot_mapping=extra_part(2),
        kv_merge_mask=tensor(merged_tokens, torch.bool)[:, None]
        if split and any(merged_tokens) else None,
        cascade=cascade_tiles.to_device(cascade, device) if cascade is not None else None,
        shared_prefix_host=tuple(s.shared_prefix for s in work)
        if marks and not decode_only
        and any(s.shared_prefix is not None for s in work) else (),
        # A decode step keeps every row's write (its rows as DecodeRows makes them: one token
        # each, so a skipped write costs one scratch row, not a contended scatter).
        base_writes=(tensor(base_rows, torch.int64), tensor(base_at, torch.int64))
        if len(base_rows) < len(ids) and not decode_only else None,
        res_writes=(tensor(res_rows, torch.int64), tensor(res_at, torch.int64))
        if split and len(res_rows) < len(ids) and not decode_only else None,
    )
    return Batch(input_ids=tensor(ids, torch.int64), positions=tensor(pos, torch.int64),
                 token_slot=tensor(tok_slot, torch.int64),
                 logits_indices=tensor(logit_rows, torch.int64),
                 # A split item needs the LoRA pass even where every token is before its aLoRA
                 # activation: its (zero) residual is written through it.
                 meta=meta, use_lora=any(s >= 0 for s in tok_slot) or split or bool(extra))

