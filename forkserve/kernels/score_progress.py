"""How far two-pass decode's score pass has got, so the partial kernel can follow it key
tile by key tile instead of waiting for the whole pass (``follow``).

With ``pdl`` (residual_decode_triton.py) pass 2 is launched while pass 1 runs and waits for
pass 1's whole grid (``griddepcontrol.wait``) before its first score read: the two passes
still run one after the other, and pass 1 (tensor-core work, ~0.3x unified's time at batch
>= 8 on the H200) adds to pass 2's memory stream instead of hiding under it. Here pass 1
publishes, per sequence, KV head and key chunk, the absolute key up to which its scores
are written (after each segment of its chunk); a pass-2 program waits only for the keys of
the tile it is about to read.

Ownership and lifetime: ``ScoreProgress.flags`` is one int32 per ``(sequence, KV head,
chunk)`` of one decode call, allocated unwritten by the caller (``score_progress``). Each
score-pass program owns its chunk's flags: it zeroes them first, before it lets the next
launch start (``reset_progress``), then raises them after each segment of key tiles
(``publish_keys``). No other program writes them, so nothing is reset between calls and no
flag outlives the call that allocated it. A partial-kernel program only reads them
(``wait_for_keys``).

Measured on the H200 (docs/KERNELS.md "Round 16"): it loses to the whole-pass wait at every
point (the polls cost about what the overlap wins), so ``follow`` is off by default.

Why it cannot deadlock: with programmatic launch, pass 2's programs start only once every
pass-1 program has signalled (``griddepcontrol.launch_dependents``, the first thing each
does), so every program a pass-2 program waits on is already resident or done. Without
it (or in the interpreter) pass 2 starts after pass 1 ends and never waits.

Memory order is the release/acquire pattern of CUTLASS's generic barrier: a CTA barrier,
then one thread's ``fence.acq_rel.gpu`` and a relaxed store; the reader's
``ld.acquire.gpu`` before its own score loads (which bypass L1, ``.cg``).

In the interpreter (``SPIN`` False) programs run one after another: the wait reads the flag
once and returns what it says, and the reader masks keys past it, so a wrong index or
target shows as a wrong output rather than as a hang.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# One thread (tid 0) releases: the caller's CTA barrier ordered every thread's stores before
# it (CUTLASS GenericBarrier::arrive_inc).
_PUBLISH_ASM = tl.constexpr("""{
  .reg .pred p;
  .reg .b32 t;
  mov.u32 t, %tid.x;
  setp.eq.u32 p, t, 0;
  @p fence.acq_rel.gpu;
  @p st.relaxed.gpu.global.b32 [$1], $2;
  mov.b32 $0, 0;
}""")

# Poll until the flag reaches ``need``, from the last value seen (no load when it already
# does). Labels inside braces are local to the block in PTX.
_WAIT_ASM = tl.constexpr("""{
  .reg .pred p;
  .reg .b32 v;
  mov.b32 v, $1;
WAIT:
  setp.ge.s32 p, v, $3;
  @p bra DONE;
  ld.global.acquire.gpu.b32 v, [$2];
  bra WAIT;
DONE:
  mov.b32 $0, v;
}""")

# Every thread: its zeroed flags reach L2 before the next launch may read them.
_RELEASE_DEPENDENTS_ASM = tl.constexpr("""{
  fence.acq_rel.gpu;
  griddepcontrol.launch_dependents;
  mov.b32 $0, 0;
}""")


class ScoreProgress(NamedTuple):
    """One decode call's progress flags (module docstring): ``flags [batch, n_kv, chunks]``
    int32; ``chunk_len`` the score pass's keys per program (a multiple of both passes' key
    tiles), which both launches must use; ``segment`` the keys a score program scores
    between two publishes (a multiple of its key tile: each segment is one pipelined loop,
    and the CTA barrier of a publish sits between two)."""

    flags: torch.Tensor
    chunk_len: int
    segment: int


def score_progress(q: torch.Tensor, n_kv: int, span: int, chunk_len: int,
                   segment: int) -> ScoreProgress:
    """Unwritten flags for a score pass over ``span`` keys in chunks of ``chunk_len``."""
    return ScoreProgress(
        torch.empty(q.shape[0], n_kv, -(-span // chunk_len), dtype=torch.int32,
                    device=q.device), chunk_len, segment)


@triton.jit
def reset_progress(Flags, KV_HEADS: tl.constexpr, stride_fh, LAUNCH_DEPENDENTS: tl.constexpr):
    """A score-pass program's first step: zero its ``KV_HEADS`` flags (``Flags`` its first
    KV head's), then, launched with ``pdl``, let the next launch start."""
    for j in tl.static_range(KV_HEADS):
        tl.store(Flags + j * stride_fh, 0)
    if LAUNCH_DEPENDENTS:
        tl.debug_barrier()
        tl.inline_asm_elementwise(_RELEASE_DEPENDENTS_ASM, "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def publish_keys(Flags, keys, KV_HEADS: tl.constexpr, stride_fh, SPIN: tl.constexpr):
    """Scores of every key below ``keys`` are written (this program's, for its
    ``KV_HEADS`` heads): raise their flags, after every thread's stores."""
    if SPIN:
        tl.debug_barrier()
        for j in tl.static_range(KV_HEADS):
            tl.inline_asm_elementwise(_PUBLISH_ASM, "=r,l,r", [Flags + j * stride_fh, keys],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        for j in tl.static_range(KV_HEADS):
            tl.store(Flags + j * stride_fh, keys)


@triton.jit
def wait_for_keys(Flags, ready, need, SPIN: tl.constexpr):
    """The key up to which the flag at ``Flags`` says scores are written, at least ``need``
    with ``SPIN`` (polled from ``ready``, the last value seen; ``need`` 0 never polls).
    Without it, the flag as it stands: the caller masks keys at or past the result. The
    poll is a pure asm op to the compiler (a side-effecting one pinned the partial kernel's
    schedule: 160 -> 187 registers on sm_90a); the load mask's use of its result orders the
    score loads after it, and the ``ld.acquire`` orders them in the hardware."""
    if SPIN:
        ready = tl.inline_asm_elementwise(_WAIT_ASM, "=r,r,l,r", [ready, Flags, need],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        ready = tl.maximum(ready, tl.load(Flags, mask=need > 0, other=0))
    return ready


@triton.jit
def keys_needed(tile_start, stop, has_scores, BLOCK_N: tl.constexpr):
    """The key a reader of the ``BLOCK_N``-key tile at ``tile_start`` must see published:
    the tile's end (``stop`` at most); 0 (no wait) for an empty tile or a row without
    scores."""
    return tl.where(has_scores & (tile_start < stop), tl.minimum(tile_start + BLOCK_N, stop), 0)


@triton.jit
def load_published(row_ptrs, rows_ok, offs, keys_ok, ready, SPIN: tl.constexpr):
    """The scores at ``row_ptrs + offs[None, :]`` (``row_ptrs [rows, 1]``) that another
    program published during this launch, zero where masked and at keys from ``ready`` on
    (``wait_for_keys``; with ``SPIN`` past every key asked for, but the mask keeps each load
    behind the poll's result): from L2 (``.cg``), never from an L1 line filled before they
    were written."""
    keys_ok = keys_ok & (offs < ready)
    return tl.load(row_ptrs + offs[None, :], mask=rows_ok[:, None] & keys_ok[None, :],
                   other=0.0, cache_modifier=".cg")
