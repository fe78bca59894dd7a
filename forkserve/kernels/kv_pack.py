"""Gather paged K/V into one contiguous buffer, rebuilding the residual form on the way.

One Triton kernel serves both prefill routes that attend over contiguous K/V instead of
pages: the flash route packs every sequence's keys back to back (``cu_seqlens_k``), the
merged route (residual_merge.py) lays each sequence out from a page boundary so the paged
kernel can read the buffer as pages. In the disaggregated form a token's K/V are rebuilt
as they are copied, with the reference's formulas, added in float32:

    K = K_base + RoPE(K_res B_k)    at the token's absolute position
    V = V_base + V_res B_v

Grid ``(ceil(max_len / BLOCK_T), batch)``: a program copies BLOCK_T tokens of one sequence
for every KV head, so a token's residual rows and cos/sin rows are loaded once and serve all
heads; the up-projections are tensor-core products per head. Sequences with adapter -1
copy their base rows unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from forkserve.kernels.residual_triton import residual_offsets
from forkserve.kernels.rope import cached_rope_table


class ResidualPools(NamedTuple):
    """The disaggregated form's side of a layer: residual pools ``[pages, P, r]``, their block
    tables, the stacked pre-scaled ``B_k, B_v [adapters, r, Hkv * D]``, each sequence's
    adapter (int32, -1: none) and RoPE's ``inv_freq``."""

    k_res: torch.Tensor
    v_res: torch.Tensor
    res_block_tables: torch.Tensor
    b_k_all: torch.Tensor
    b_v_all: torch.Tensor
    adapter_idx: torch.Tensor
    inv_freq: torch.Tensor


@triton.jit
def _pack_kernel(
    K, V, KR, VR, BK, BV, RopeTable, OutK, OutV,
    BlockTables, ResBlockTables, KeyLens, DstStarts, AdapterIdx,
    n_kv, rank,
    stride_kp, stride_ks, stride_kh,
    stride_rp, stride_rs, stride_ba, stride_br,
    stride_bt, stride_rbt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    RANK: tl.constexpr, HAS_RES: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    b = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs < tl.load(KeyLens + b)
    page = tl.load(BlockTables + b * stride_bt + offs // PAGE_SIZE, mask=t_ok, other=0)
    src = page.to(tl.int64) * stride_kp + (offs % PAGE_SIZE) * stride_ks
    dst = (tl.load(DstStarts + b).to(tl.int64) + offs) * stride_ot
    d_lo = tl.arange(0, HALF)
    d = tl.arange(0, HEAD_DIM)
    row_ok = t_ok[:, None]
    if HAS_RES:
        adapter = tl.load(AdapterIdx + b)
        a_safe = tl.maximum(adapter, 0)
        r = tl.arange(0, RANK)
        r_ok = (r < rank) & (adapter >= 0)
        b_ok = r_ok[:, None]
        rn_ok = t_ok & (adapter >= 0)
        r_off = residual_offsets(ResBlockTables, b * stride_rbt, offs, rn_ok, stride_rp, stride_rs,
                                 PAGE_SIZE)
        res_mask = rn_ok[:, None] & r_ok[None, :]
        kr = tl.load(KR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
        vr = tl.load(VR + r_off[:, None] + r[None, :], mask=res_mask, other=0.0)
        # Table rows at the tokens' own positions (packing starts at position 0): exact,
        # no angle addition needed.
        row = RopeTable + offs[:, None] * (2 * HALF) + d_lo[None, :]
        cos = tl.load(row, mask=row_ok, other=0.0)
        sin = tl.load(row + HALF, mask=row_ok, other=0.0)
    for h in range(0, n_kv):
        k_at = K + (src + h * stride_kh)[:, None]
        v_at = V + (src + h * stride_kh)[:, None]
        k_to = OutK + (dst + h * stride_oh)[:, None]
        v_to = OutV + (dst + h * stride_oh)[:, None]
        if HAS_RES:
            b_at = a_safe * stride_ba + r[:, None] * stride_br + h * HEAD_DIM
            up_lo = tl.dot(kr, tl.load(BK + b_at + d_lo[None, :], mask=b_ok, other=0.0))
            up_hi = tl.dot(kr, tl.load(BK + b_at + HALF + d_lo[None, :], mask=b_ok, other=0.0))
            k_lo = tl.load(k_at + d_lo[None, :], mask=row_ok, other=0.0).to(tl.float32)
            k_hi = tl.load(k_at + HALF + d_lo[None, :], mask=row_ok, other=0.0).to(tl.float32)
            k_lo += up_lo * cos - up_hi * sin
            k_hi += up_hi * cos + up_lo * sin
            tl.store(k_to + d_lo[None, :], k_lo.to(OutK.dtype.element_ty), mask=row_ok)
            tl.store(k_to + HALF + d_lo[None, :], k_hi.to(OutK.dtype.element_ty), mask=row_ok)
            bv = tl.load(BV + b_at + d[None, :], mask=b_ok, other=0.0)
            v = tl.load(v_at + d[None, :], mask=row_ok, other=0.0).to(tl.float32) + tl.dot(vr, bv)
            tl.store(v_to + d[None, :], v.to(OutV.dtype.element_ty), mask=row_ok)
        else:
            tl.store(k_to + d[None, :], tl.load(k_at + d[None, :], mask=row_ok), mask=row_ok)
            tl.store(v_to + d[None, :], tl.load(v_at + d[None, :], mask=row_ok), mask=row_ok)


def pack_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
            key_lens: torch.Tensor, dst_starts: torch.Tensor, rows: int, max_len: int,
            residual: ResidualPools | None = None, block_t: int = 32,
            num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[rows, Hkv, D]`` (pool dtype): keys ``0 .. key_lens[b]-1`` of sequence b (through
    its block table, rebuilt with ``residual``) at rows ``dst_starts[b] + position``.

    ``rows`` and ``max_len`` (the largest ``key_lens``) are host counts: no device read-back.
    Rows no sequence writes are left uninitialised. The buffers are new on every call and
    belong to the caller (a prefill route holds them for one layer's attention).
    """
    _, page_size, n_kv, head_dim = k_pool.shape
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"pack_kv needs a power-of-two head dim of at least 16, got {head_dim}")
    if k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1:
        raise ValueError("K and V pools must share strides with contiguous rows")
    out_k = torch.empty(rows, n_kv, head_dim, dtype=k_pool.dtype, device=k_pool.device)
    out_v = torch.empty_like(out_k)
    batch = key_lens.numel()
    if rows == 0 or max_len == 0 or batch == 0:
        return out_k, out_v
    if residual is not None:
        rp = residual
        rank = rp.b_k_all.shape[1]
        if rp.k_res.shape[-1] != rank or rp.k_res.stride() != rp.v_res.stride():
            raise ValueError("residual pools and B matrices disagree on rank or strides")
        table = cached_rope_table(rp.inv_freq, max_len)
        res_args = (rp.k_res, rp.v_res, rp.b_k_all, rp.b_v_all, table)
        res_tables, adapter_idx = rp.res_block_tables, rp.adapter_idx
        res_strides = (rp.k_res.stride(0), rp.k_res.stride(1), rp.b_k_all.stride(0),
                       rp.b_k_all.stride(1))
        rbt_stride = res_tables.stride(0)
    else:
        res_args = (None,) * 5
        res_tables = adapter_idx = None
        rank, res_strides, rbt_stride = 0, (0, 0, 0, 0), 0
    grid = (triton.cdiv(max_len, block_t), batch)
    _pack_kernel[grid](
        k_pool, v_pool, *res_args, out_k, out_v,
        block_tables, res_tables, key_lens, dst_starts, adapter_idx,
        n_kv, rank,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), *res_strides,
        block_tables.stride(0), rbt_stride, out_k.stride(0), out_k.stride(1),
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_T=block_t,
        RANK=max(16, triton.next_power_of_2(rank)), HAS_RES=residual is not None,
        num_warps=num_warps,
    )
    return out_k, out_v
