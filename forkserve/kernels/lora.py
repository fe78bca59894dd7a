"""Multi-LoRA shrink / expand over segments of tokens that share an adapter (SGMV), in Triton.

* shrink: ``y[t] = x[t] @ A[idx[t]]`` with ``A_all [num_adapters, in_dim, r_max]``;
  zero rows where ``idx = -1``. With ``out_slots`` the rows are written straight into a
  paged pool (``[num_pages, P, r_max]``, row ``slot = page * P + offset``): this is how the
  disaggregated layout fills its residual pages (x A_k, x A_v) without a copy.
* expand: ``out[t] += y[t] @ B[idx[t]]`` with ``B_all [num_adapters, r_max, out_dim]``
  (already scaled by alpha / r, zero-padded past each adapter's rank); no-op where -1.

Tokens are grouped into maximal runs of one adapter (segments); a decode batch where
every token has its own adapter degenerates to BGMV (segments of length 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(X, A, Y, SegStart, SegAdapter, Slots, in_dim, rank,
                   stride_xt, stride_aa, stride_ak, stride_yt,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, RANK: tl.constexpr,
                   HAS_SLOTS: tl.constexpr):
    seg = tl.program_id(0)
    t_blk = tl.program_id(1)
    s0 = tl.load(SegStart + seg)
    s1 = tl.load(SegStart + seg + 1)
    adapter = tl.load(SegAdapter + seg)
    a_safe = tl.maximum(adapter, 0)
    t = s0 + t_blk * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < s1
    r = tl.arange(0, RANK)
    r_ok = (r < rank) & (adapter >= 0)
    acc = tl.zeros([BLOCK_T, RANK], tl.float32)
    # Loop bound 0 for an empty tile or a no-adapter segment: nothing is read.
    k_stop = tl.where((s0 + t_blk * BLOCK_T < s1) & (adapter >= 0), in_dim, 0)
    for k0 in range(0, k_stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_dim
        x = tl.load(X + t[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(A + a_safe * stride_aa + k[:, None] * stride_ak + r[None, :],
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(x, a)
    if HAS_SLOTS:
        row = tl.load(Slots + t, mask=t_ok, other=-1)
        row_ok = t_ok & (row >= 0)
    else:
        row = t
        row_ok = t_ok
    tl.store(Y + row[:, None].to(tl.int64) * stride_yt + r[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & (r < rank)[None, :])


@triton.jit
def _expand_kernel(Y, B, Out, SegStart, SegAdapter, out_dim, rank,
                   stride_yt, stride_ba, stride_br, stride_ot,
                   BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, RANK: tl.constexpr):
    seg = tl.program_id(0)
    t_blk = tl.program_id(1)
    o_blk = tl.program_id(2)
    s0 = tl.load(SegStart + seg)
    s1 = tl.load(SegStart + seg + 1)
    adapter = tl.load(SegAdapter + seg)
    a_safe = tl.maximum(adapter, 0)
    t = s0 + t_blk * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = (t < s1) & (adapter >= 0)
    r = tl.arange(0, RANK)
    r_ok = r < rank
    o = o_blk * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = o < out_dim
    y = tl.load(Y + t[:, None].to(tl.int64) * stride_yt + r[None, :],
                mask=t_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(B + a_safe * stride_ba + r[:, None] * stride_br + o[None, :],
                mask=r_ok[:, None] & o_ok[None, :] & (adapter >= 0), other=0.0)
    delta = tl.dot(y.to(tl.float32), b.to(tl.float32))
    mask = t_ok[:, None] & o_ok[None, :]
    o_ptr = Out + t[:, None].to(tl.int64) * stride_ot + o[None, :]
    prev = tl.load(o_ptr, mask=mask, other=0.0)
    tl.store(o_ptr, (prev.to(tl.float32) + delta).to(Out.dtype.element_ty), mask=mask)


def segments(token_adapter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Maximal runs of equal adapter index: (seg_start int32 ``[S+1]``, seg_adapter int32
    ``[S]``, longest run). One host sync; a scheduler that already knows its segments
    passes them to ``sgmv_shrink`` / ``sgmv_expand`` directly."""
    adapters, counts = torch.unique_consecutive(token_adapter, return_counts=True)
    starts = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=token_adapter.device)
    starts[1:] = counts.cumsum(0)
    return starts, adapters.to(torch.int32), int(counts.max()) if counts.numel() else 0


def _rank_pad(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def sgmv_shrink(x: torch.Tensor, a_all: torch.Tensor, seg_start: torch.Tensor,
                seg_adapter: torch.Tensor, max_seg_len: int, out: torch.Tensor | None = None,
                out_slots: torch.Tensor | None = None, block_t: int = 16,
                block_k: int = 128) -> torch.Tensor:
    """Shrink by segments. x ``[T, in_dim]``; returns ``y [T, r_max]`` (or ``out``).

    With ``out_slots`` (int ``[T]``, -1 = skip), ``out`` is a paged pool
    ``[num_pages, P, r_max]`` and token t's row goes to flat row ``out_slots[t]``.
    """
    n_tok, in_dim = x.shape
    rank = a_all.shape[-1]
    assert x.stride(-1) == 1 and a_all.stride(-1) == 1
    if out is None:
        assert out_slots is None, "writing through slots needs the destination pool"
        out = torch.empty(n_tok, rank, dtype=x.dtype, device=x.device)
    rows = out.reshape(-1, out.shape[-1])  # a view for contiguous pools: writes land in out
    assert rows.data_ptr() == out.data_ptr() and rows.shape[-1] == rank
    n_seg = seg_adapter.numel()
    if n_tok == 0 or n_seg == 0:
        return out
    grid = (n_seg, max(1, -(-max_seg_len // block_t)))
    _shrink_kernel[grid](
        x, a_all, rows, seg_start, seg_adapter, out_slots, in_dim, rank,
        x.stride(0), a_all.stride(0), a_all.stride(1), rows.stride(0),
        BLOCK_T=block_t, BLOCK_K=block_k, RANK=_rank_pad(rank), HAS_SLOTS=out_slots is not None,
    )
    return out


def sgmv_expand(y: torch.Tensor, b_all: torch.Tensor, seg_start: torch.Tensor,
                seg_adapter: torch.Tensor, max_seg_len: int, out: torch.Tensor,
                block_t: int = 16, block_o: int = 128) -> torch.Tensor:
    """Expand by segments, accumulating in place: ``out [T, out_dim] += y @ B[seg]``."""
    n_tok, rank = y.shape
    out_dim = b_all.shape[-1]
    assert b_all.shape[1] == rank and y.stride(-1) == 1 and out.stride(-1) == 1
    n_seg = seg_adapter.numel()
    if n_tok == 0 or n_seg == 0:
        return out
    grid = (n_seg, max(1, -(-max_seg_len // block_t)), -(-out_dim // block_o))
    _expand_kernel[grid](
        y, b_all, out, seg_start, seg_adapter, out_dim, rank,
        y.stride(0), b_all.stride(0), b_all.stride(1), out.stride(0),
        BLOCK_T=block_t, BLOCK_O=block_o, RANK=_rank_pad(rank),
    )
    return out


def lora_shrink_triton(x: torch.Tensor, a_all: torch.Tensor, token_adapter: torch.Tensor,
                       out: torch.Tensor | None = None,
                       out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Shrink with a per-token adapter index (segments built here)."""
    seg_start, seg_adapter, longest = segments(token_adapter)
    return sgmv_shrink(x, a_all, seg_start, seg_adapter, longest, out=out, out_slots=out_slots)


def lora_expand_triton(y: torch.Tensor, b_all: torch.Tensor, token_adapter: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """Expand with a per-token adapter index, in place on ``out``."""
    seg_start, seg_adapter, longest = segments(token_adapter)
    return sgmv_expand(y, b_all, seg_start, seg_adapter, longest, out)
