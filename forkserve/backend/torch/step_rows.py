"""A prefill step's one-token sequences, attended by the decode kernels.

A step that prefills is not ``decode_only``, but the engine puts the decode rows of the
sessions that are generating into the same step (a mixed tick: an agent's observation beside
28 agents' next tokens). Through the prefill kernels such a row is a query tile of one real
row over its whole context: in the residual form the fused kernel rebuilds every key of
that context per tile (on the H200, a tick of 202 prefill tokens beside 28 split decode rows
over an 8K context took 130-135 ms against 20 ms for the decode rows alone; docs/MULTILORA.md
"Round 4"). ``split_rows`` cuts such a step into two attention views over the same pools:
the sequences with more than one new token (the prefill kernels and their route) and those
with exactly one (the decode kernels, with the step's cascade tiles, which index exactly
these: ``cascade.decode_marks``). Both views are for attention only: the step's K/V and
residual writes are the whole batch's, done before either reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import torch

from forkserve.backend.torch.attention import AttentionMetadata


@dataclass(frozen=True)
class StepRows:
    """Rows of q (``[T, Hq, D]``) each view attends, and the views (``decode`` is
    ``decode_only`` and keeps the step's cascade tiles)."""

    prefill_q: torch.Tensor          # [P] int64
    decode_q: torch.Tensor           # [D] int64
    prefill: AttentionMetadata
    decode: AttentionMetadata


def split_rows(meta: AttentionMetadata) -> StepRows | None:
    """The two views of a step with one-token sequences beside longer ones; None where there
    is nothing to cut (no one-token sequence, or no longer one: the step takes one path)."""
    lens = meta.query_lens_host
    one = [i for i, n in enumerate(lens) if n == 1]
    many = [i for i, n in enumerate(lens) if n != 1]
    if meta.decode_only or not one or not any(lens[i] > 1 for i in many):
        return None
    starts = (0, *accumulate(lens))
    device = meta.seq_lens.device
    prefill_q = [r for i in many for r in range(starts[i], starts[i + 1])]
    return StepRows(
        prefill_q=torch.tensor(prefill_q, dtype=torch.int64).to(device, non_blocking=True),
        decode_q=torch.tensor([starts[i] for i in one], dtype=torch.int64).to(device,
                                                                               non_blocking=True),
        prefill=_view(meta, many, decode=False), decode=_view(meta, one, decode=True))


def prefill_part(meta: AttentionMetadata,
                 seqs: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """The rows of q (``[R]`` int64) and the prefill attention view of ``meta``'s sequences
    ``seqs``, in order (the sequences a step leaves to its prefill route once others took
    the FRESH one, kernel_attention.py)."""
    starts = (0, *accumulate(meta.query_lens_host))
    rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
    return (torch.tensor(rows, dtype=torch.int64).to(meta.seq_lens.device, non_blocking=True),
            _view(meta, seqs, decode=False))


def _view(meta: AttentionMetadata, seqs: list[int], decode: bool) -> AttentionMetadata:
    """``meta``'s sequences ``seqs``, in order, as attention reads them."""
    index = torch.tensor(seqs, dtype=torch.int64).to(meta.seq_lens.device, non_blocking=True)
    query_lens = tuple(meta.query_lens_host[i] for i in seqs)
    starts = torch.tensor((0, *accumulate(query_lens)), dtype=meta.query_starts.dtype)
    return dataclasses.replace(
        meta,
        block_tables=meta.block_tables.index_select(0, index),
        res_block_tables=(None if meta.res_block_tables is None
                          else meta.res_block_tables.index_select(0, index)),
        seq_lens=meta.seq_lens.index_select(0, index),
        query_starts=starts.to(meta.query_starts.device, non_blocking=True),
        seq_slot=meta.seq_slot.index_select(0, index),
        query_lens_host=query_lens,
        seq_lens_host=tuple(meta.seq_lens_host[i] for i in seqs),
        seq_slot_host=tuple(meta.seq_slot_host[i] for i in seqs),
        decode_only=decode, cascade=meta.cascade if decode else None,
        shared_prefix_host=() if decode or not meta.shared_prefix_host else tuple(
            meta.shared_prefix_host[i] for i in seqs))
