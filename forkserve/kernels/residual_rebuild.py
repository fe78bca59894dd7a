"""The FRESH route's residual rebuild in one Triton launch: an adapter's K/V from this step's rows.

A cold prefill in the split form (backend/torch/fresh_prefill.py) rebuilds one sequence's
keys and values from the tensors the step has just projected, for one adapter slot:

    K = k + RoPE(k_res @ B_k)    at positions 0 .. n - 1
    V = v + v_res @ B_v

Eager, that is a matmul, a roll, a multiply, an addcmul and an add for K and an addmm for V:
six launches, each a full pass over ``[n, Hkv * D]`` (H200, Llama-3-8B shape: ~0.08 ms at 1K
tokens against a 0.035 ms attention, 0.18 ms at 8K). Here every K and V element is read once
and written once, with the rank-r products as tensor-core ``tl.dot`` tiles on the way.

Grid ``(ceil(n / BLOCK_T), ceil(Hkv / HEADS_PER_PROG), sides)``: a program rebuilds BLOCK_T
rows of HEADS_PER_PROG heads of one side (axis 2: K then V, or the one side asked), so the
residual rows and cos/sin rows it loads serve all its heads. A head's K is loaded as its low
and high half, two contiguous vectors, and B_k's columns likewise, so rotate-half is a swap of
registers (as glue.py's ``_rope_qk_kernel``). The products accumulate in float32 and each
output rounds once on the store (the eager form rounds the product, the rotation and the sum
to the model dtype one after the other: the two agree to a rounding or two of the output).
Launches depend only on shapes: no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# The token count varies every prefill: not specialised on, so one kernel per block shape.
@triton.jit(do_not_specialize=["n_tokens"])
def _rebuild_kernel(
    K, V, KR, VR, BK, BV, Cos, Sin, OutK, OutV,
    n_tokens, n_heads, rank,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_krt, stride_vrt,
    stride_bkr, stride_bvr, stride_ct, stride_st, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, RANK: tl.constexpr, BLOCK_T: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr, FIRST_SIDE: tl.constexpr, DOT_F32: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t64 = t.to(tl.int64)[:, None]
    row_ok = (t < n_tokens)[:, None]
    r = tl.arange(0, RANK)
    # RANK is r padded to the dot's minimum of 16: the padding's rows of B and columns of the
    # residual load as zeros, so they add nothing.
    res_ok = row_ok & (r < rank)[None, :]
    h0 = tl.program_id(1) * HEADS_PER_PROG
    if FIRST_SIDE + tl.program_id(2) == 0:
        d = tl.arange(0, HALF)[None, :]
        kr = tl.load(KR + t64 * stride_krt + r[None, :], mask=res_ok, other=0.0)
        c_row = Cos + t64 * stride_ct + d
        s_row = Sin + t64 * stride_st + d
        cos_lo = tl.load(c_row, mask=row_ok, other=0.0).to(tl.float32)
        cos_hi = tl.load(c_row + HALF, mask=row_ok, other=0.0).to(tl.float32)
        sin_lo = tl.load(s_row, mask=row_ok, other=0.0).to(tl.float32)
        sin_hi = tl.load(s_row + HALF, mask=row_ok, other=0.0).to(tl.float32)
        if DOT_F32:
            kr = kr.to(tl.float32)
        for i in tl.static_range(HEADS_PER_PROG):
            h = h0 + i
            h_ok = h < n_heads
            b_at = BK + r[:, None] * stride_bkr + h * HEAD_DIM + d
            b_ok = (r < rank)[:, None] & h_ok
            b_lo = tl.load(b_at, mask=b_ok, other=0.0)
            b_hi = tl.load(b_at + HALF, mask=b_ok, other=0.0)
            if DOT_F32:
                # fp32 operands (fp32 models, and the interpreter, which mishandles bf16
                # arithmetic): exact products, as the eager matmul, not tf32.
                up_lo = tl.dot(kr, b_lo.to(tl.float32), input_precision="ieee")
                up_hi = tl.dot(kr, b_hi.to(tl.float32), input_precision="ieee")
            else:
                up_lo = tl.dot(kr, b_lo)
                up_hi = tl.dot(kr, b_hi)
            ok = row_ok & h_ok
            k_at = K + t64 * stride_kt + h * stride_kh + d
            k_lo = tl.load(k_at, mask=ok, other=0.0).to(tl.float32)
            k_hi = tl.load(k_at + HALF, mask=ok, other=0.0).to(tl.float32)
            # x * cos + roll(x, HALF) * sin, the signed-sin form (sin_lo carries the minus).
            k_lo += up_lo * cos_lo + up_hi * sin_lo
            k_hi += up_hi * cos_hi + up_lo * sin_hi
            o_at = OutK + t64 * stride_ot + h * stride_oh + d
            tl.store(o_at, k_lo.to(OutK.dtype.element_ty), mask=ok)
            tl.store(o_at + HALF, k_hi.to(OutK.dtype.element_ty), mask=ok)
    else:
        # Names apart from the K side's: the compiler types a name once across both
        # branches of a runtime if (``d`` is [1, HALF] there).
        dv = tl.arange(0, HEAD_DIM)[None, :]
        vr = tl.load(VR + t64 * stride_vrt + r[None, :], mask=res_ok, other=0.0)
        if DOT_F32:
            vr = vr.to(tl.float32)
        for i in tl.static_range(HEADS_PER_PROG):
            h = h0 + i
            h_ok = h < n_heads
            b = tl.load(BV + r[:, None] * stride_bvr + h * HEAD_DIM + dv,
                        mask=(r < rank)[:, None] & h_ok, other=0.0)
            if DOT_F32:
                up = tl.dot(vr, b.to(tl.float32), input_precision="ieee")
            else:
                up = tl.dot(vr, b)
            ok = row_ok & h_ok
            val = tl.load(V + t64 * stride_vt + h * stride_vh + dv, mask=ok, other=0.0)
            out = val.to(tl.float32) + up
            tl.store(OutV + t64 * stride_ot + h * stride_oh + dv, out.to(OutV.dtype.element_ty),
                     mask=ok)


def rebuild_supported(head_dim: int) -> bool:
    """Head dims the kernel takes: a power of two with halves of at least the dot's 16."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def rebuild_kv_triton(k: torch.Tensor, v: torch.Tensor, k_res: torch.Tensor | None,
                      v_res: torch.Tensor | None, b_k: torch.Tensor | None,
                      b_v: torch.Tensor | None, cos: torch.Tensor | None,
                      sin: torch.Tensor | None,
                      heads_per_prog: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's K, V over ``n`` rows at positions ``0 .. n - 1``.

    k, v: ``[n, Hkv, D]``, any row and head stride, unit last stride (slices of the kv
    projection); k_res, v_res: ``[n, r]``, any row stride, unit column stride; b_k, b_v: one
    slot's pre-scaled ``[r, Hkv * D]`` (any row stride, unit column stride); cos, sin:
    ``[>= n, D]`` (rows 0 .. n - 1 used), cos and *signed* sin as ``Rope.cos_sin`` returns them.
    b_k (b_v) None: that side is returned as given, not rebuilt. Returns new contiguous
    ``[n, Hkv, D]`` tensors of k's dtype for the rebuilt sides, float32 math (the eager form:
    ``reference.rebuild_kv_ref``). D: ``rebuild_supported``. ``heads_per_prog``: heads a
    program rebuilds (default: from n, below).
    """
    n, heads, dim = k.shape
    if not rebuild_supported(dim):
        raise ValueError(f"rebuild_kv needs a power-of-two head dim of at least 32, got {dim}")
    sides = [s for s, b in ((0, b_k), (1, b_v)) if b is not None]
    if not sides or n == 0:
        return k, v
    assert v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1, (k.stride(), v.stride())
    out_k = k if b_k is None else torch.empty((n, heads, dim), dtype=k.dtype, device=k.device)
    out_v = v if b_v is None else torch.empty((n, heads, dim), dtype=v.dtype, device=v.device)
    # The side not rebuilt gets the other's arguments: its branch is compiled, never run.
    if b_k is None:
        k_res, b_k, cos, sin = v_res, b_v, v, v
    if b_v is None:
        v_res, b_v = k_res, b_k
    rank = b_k.shape[0]
    assert b_k.shape == b_v.shape == (rank, heads * dim), (b_k.shape, b_v.shape)
    assert k_res.shape == v_res.shape == (n, rank), (k_res.shape, v_res.shape)
    assert k_res.stride(1) == 1 and v_res.stride(1) == 1
    assert b_k.stride(1) == 1 and b_v.stride(1) == 1 and cos.stride(-1) == 1
    assert sin.stride(-1) == 1 and cos.shape[0] >= n and sin.shape[0] >= n
    out = out_k if 0 in sides else out_v
    # Tensor-core products need one 16-bit operand dtype; anything else (fp32 models, mixed
    # dtypes, the interpreter) multiplies in fp32.
    operands = {k_res.dtype, v_res.dtype, b_k.dtype, b_v.dtype}
    # Rows of 64: a 64 x 16 x 64 product per half-head. Heads per program double while at
    # least ~512 programs remain, so long prefills reuse the residual and cos/sin rows over
    # more heads and short ones still fill the GPU (Llama-3-8B's 8 heads: 1 a program at 1K
    # tokens, 256 programs; 8 at 32K, 1024).
    block_t = 64
    blocks = triton.cdiv(n, block_t)
    per_prog = heads_per_prog or 1
    while (heads_per_prog is None and per_prog < heads
           and blocks * triton.cdiv(heads, 2 * per_prog) * len(sides) >= 512):
        per_prog *= 2
    grid = (blocks, triton.cdiv(heads, per_prog), len(sides))
    _rebuild_kernel[grid](
        k, v, k_res, v_res, b_k, b_v, cos, sin, out_k, out_v,
        n, heads, rank,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_res.stride(0), v_res.stride(0),
        b_k.stride(0), b_v.stride(0), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=dim, RANK=max(16, triton.next_power_of_2(rank)), BLOCK_T=block_t,
        HEADS_PER_PROG=per_prog, FIRST_SIDE=sides[0],
        DOT_F32=not k.is_cuda or len(operands) > 1 or torch.float32 in operands, num_warps=4)
    return out_k, out_v
