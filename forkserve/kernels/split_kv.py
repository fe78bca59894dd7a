"""Split-KV (flash-decoding) frame shared by every decode kernel: unified, ResidualAttention
and cascade decode.

A decode row's keys are cut into splits; each program writes one split's partial (output
normalised by its own softmax sum, and its log2-sum-exp) and ``merge_partials`` combines
a row's partials by log-sum-exp. This module owns the split plan, the partial buffers'
shape, the device function that writes a partial, and the merge; the kernels that fill the
partials live in decode_attention.py (the split-K loop), residual_decode_triton.py (the
ResidualAttention passes) and shared_prefix.py (cascade tiles). Partial buffers are
temporaries of one call (the caching allocator, or a CUDA graph's pool, reuses them).

Two plans: ``plan_splits`` cuts ``[0, bound)`` into splits of one host-known length (the
residual and cascade drivers); ``dynamic_splits`` only picks a count, and each program cuts
its own sequence's keys on the device (``DYN_SPLIT``; unified decode's default), so a bound
far above the real lengths (a CUDA graph's table width) makes no split longer.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A key range of at most this many positions is not split further (the merge costs more).
MIN_SPLIT_TOKENS = 256
NO_LIMIT = 2 ** 30
# The dynamic plan (unified decode, ``dynamic_splits``): programs per SM it aims for (the
# unified kernel fits 5 per SM at 64-key tiles: docs/KERNELS.md), the fewest keys a split
# may hold where the key bound caps the count, and the most splits.
DYN_PROGRAMS_PER_SM = 4
DYN_MIN_SPLIT_TOKENS = 64
DYN_MAX_SPLITS = 64


@triton.jit
def store_partial(acc, l_i, m_i, out_ptr, lse_ptr, row_ok, d):
    """Write a split's partial: ``acc / l`` at ``out_ptr + d`` and its log2-sum-exp at
    ``lse_ptr``. A row that saw no key gets -inf, which the merge skips (its output slot
    may then stay unwritten)."""
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + d[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr, lse, mask=row_ok)


# The split count and the strides it sets change from step to step; one build serves every
# value (decode_attention._STEP_INTS says why). The splits are read in fixed tiles of
# MERGE_BLOCK_S for the same reason: a tile sized to the count made one build per power of
# two, and a count class first met inside a timed run built there (react W=32, round 11:
# BLOCK_S=32 in unified's run, 0.2 s).
MERGE_BLOCK_S = 32


@triton.jit(do_not_specialize=["num_splits", "stride_ob", "stride_oh", "stride_lb", "stride_lh"])
def _merge_kernel(PartOut, PartLse, Out, num_splits,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  stride_fb, stride_fh,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    lse_row = PartLse + b * stride_lb + h * stride_lh
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m = tl.maximum(m, tl.max(tl.load(lse_row + s, mask=s < num_splits,
                                         other=float("-inf")), 0))
    acc = tl.zeros([HEAD_DIM], tl.float32)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        lse = tl.load(lse_row + s, mask=s_ok, other=float("-inf"))
        w = tl.where(s_ok, tl.exp2(lse - m), 0.0)
        # A slot with no keys may never have been written (cascade: rows of no tile): skip
        # its read.
        live = s_ok & (lse > float("-inf"))
        part = tl.load(PartOut + b * stride_ob + h * stride_oh + s[:, None] * stride_os
                       + d[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
        den += tl.sum(w, 0)
    tl.store(Out + b * stride_fb + h * stride_fh + d, (acc / den).to(Out.dtype.element_ty))


@triton.jit
def store_live_partial(acc, l_i, m_i, out_ptr, lse_ptr, row_ok, d):
    """``store_partial`` that writes no output for a row that saw no key (its log2-sum-exp
    -inf tells the merge to skip the slot): a dynamic plan's empty splits write 4 bytes a
    row, not a head_dim row of zeros."""
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(out_ptr + d[None, :], out, mask=(row_ok & has_keys)[:, None])
    tl.store(lse_ptr, lse, mask=row_ok)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA, for the interpreter's plans)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def waves_of(n_programs: int, device: torch.device, waves: int = 2) -> int:
    """How many ways to cut each program's work for about ``waves`` waves of programs."""
    return max(1, -(-waves * sm_count(device) // max(n_programs, 1)))


def key_bound(seq_lens: torch.Tensor, max_seq_len: int | None) -> int:
    """A host bound on every sequence's keys: the caller's (a CUDA graph passes its table
    width), else the longest length (one host sync)."""
    return int(seq_lens.max()) if max_seq_len is None else max_seq_len


def plan_splits(n_programs: int, span: int, device: torch.device, block_n: int,
                num_splits: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len) for a key span of ``span`` positions.

    Enough splits for ~2 waves of programs on the device, never splits shorter than
    MIN_SPLIT_TOKENS; ``split_len`` is a multiple of ``block_n`` so RoPE block starts stay
    aligned. ``num_splits`` forces a count (tests use it to exercise the merge).
    """
    span = max(span, 1)
    if num_splits is None:
        num_splits = max(1, min(waves_of(n_programs, device), span // MIN_SPLIT_TOKENS))
    split_len = -(-span // num_splits)
    split_len = -(-split_len // block_n) * block_n
    return -(-span // split_len), split_len


def dynamic_splits(n_programs: int, bound: int, sms: int, block_n: int,
                   num_splits: int | None = None, programs_per_sm: int = DYN_PROGRAMS_PER_SM,
                   min_split: int = DYN_MIN_SPLIT_TOKENS) -> int:
    """Splits per sequence for the dynamic plan (``DYN_SPLIT``: each program cuts its own
    sequence's keys into this many, on the device, so the plan needs no exact length).

    Enough ``n_programs``-program splits for about ``programs_per_sm`` programs per SM
    (rounded down: a batch that already fills them runs in one split, which needs no
    merge), never more than a split per ``min_split`` keys of ``bound`` (a host bound on
    every length: a graph's table width; its only use here is this cap, so a wide table
    costs empty programs, not longer ones) nor ``DYN_MAX_SPLITS``. ``num_splits`` forces it.
    """
    if num_splits is not None:
        return max(1, num_splits)
    want = programs_per_sm * sms // max(n_programs, 1)
    cap = -(-max(bound, 1) // max(min_split, block_n))
    return max(1, min(want, cap, DYN_MAX_SPLITS))


def empty_partials(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial buffers for ``q [batch, H, D]``: outputs ``[batch, H, S, D]`` and
    log2-sum-exps ``[batch, H, S]``, float32, unwritten."""
    batch, n_heads, head_dim = q.shape
    part_out = torch.empty(batch, n_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(batch, n_heads, num_splits, dtype=torch.float32, device=q.device)
    return part_out, part_lse


def merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                   num_splits: int) -> torch.Tensor:
    """Combine split partials by log-sum-exp into ``out [batch, H, D]``; returns ``out``."""
    batch, n_heads, _, head_dim = part_out.shape
    _merge_kernel[(batch, n_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=MERGE_BLOCK_S,
    )
    return out


PartialFill = Callable[[torch.Tensor, torch.Tensor, int, int], None]


def split_decode(q: torch.Tensor, n_programs: int, max_seq_len: int, num_splits: int | None,
                 block_n: int, fill: PartialFill) -> torch.Tensor:
    """One decode call over splits of ``[0, max_seq_len)``: plans them for ``n_programs``
    programs per split, has ``fill(part_out, part_lse, num_splits, split_len)`` write every
    partial, merges into a tensor like ``q``."""
    splits, split_len = plan_splits(n_programs, max_seq_len, q.device, block_n, num_splits)
    part_out, part_lse = empty_partials(q, splits)
    fill(part_out, part_lse, splits, split_len)
    return merge_partials(part_out, part_lse, torch.empty_like(q), splits)


# fill(out_or_partials, part_lse or None, num_splits): one split (``part_lse`` None) writes
# the normalised output itself.
DynamicFill = Callable[[torch.Tensor, torch.Tensor | None, int], None]


def dynamic_split_decode(q: torch.Tensor, n_programs: int, bound: int, num_splits: int | None,
                         block_n: int, fill: DynamicFill, out: torch.Tensor | None = None,
                         **tuning) -> torch.Tensor:
    """One decode call on the dynamic plan (``dynamic_splits``; ``tuning`` its keywords):
    ``fill`` writes every split partial of each sequence's own keys (``DYN_SPLIT``), merged
    into ``out`` (default a new tensor like ``q``); at one split it writes ``out`` directly
    (no merge)."""
    splits = dynamic_splits(n_programs, bound, sm_count(q.device), block_n, num_splits, **tuning)
    out = torch.empty_like(q) if out is None else out
    if splits == 1:
        fill(out, None, 1)
        return out
    part_out, part_lse = empty_partials(q, splits)
    fill(part_out, part_lse, splits)
    return merge_partials(part_out, part_lse, out, splits)
