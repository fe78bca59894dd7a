"""The decoder's glue as hand-written Triton: q/k RoPE, SiLU(gate) * up, the K/V page write.

torch.compile (Inductor, ``dynamic=True``) fused the first two into one kernel each, but slowly
on an H200 at the Llama-3-8B shape, 8K-token prefill (246 ms in all): RoPE over the q and k heads
of the fused qkv rows took 0.92 ms a layer (29.3 ms; ~168 MB moved, ~0.05 ms at bandwidth:
the generated kernel reads a strided slice and rolls within each head), SiLU * up 0.57 ms a
layer (18.1 ms; ~705 MB, 1.2 TB/s). The kernels here move each byte once with coalesced
loads: a head's two halves are loaded as two contiguous vectors, so rotate-half is a swap of
registers, not a gather. The K/V page write was two ``index_copy_`` launches a layer (64 a
decode step, 0.14-0.19 ms of it); ``write_kv_triton`` writes both in one.

RoPE and SiLU * up compute in float32 and round once on the store; inputs and outputs are
bf16, fp16 or fp32 (the K/V write is a copy). Launches depend only on shapes (no host sync,
no data-dependent allocation), so they are safe inside CUDA graph capture once compiled (the
graph runner's warm-up steps compile them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# The token count varies every prefill step: not specialised on (divisible by 16, equal to 1),
# so a run compiles one kernel per block shape rather than one per such class of lengths.
@triton.jit(do_not_specialize=["n_tokens"])
def _rope_qk_kernel(
    X, Cos, Sin, Out,
    n_tokens, n_heads,
    stride_xt, stride_ct, stride_st, stride_ot,
    HEAD_DIM: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
):
    # Program (token block, head group): a token's cos/sin rows are loaded once and serve
    # HEADS_PER_PROG heads; each head row is read as its low and high half, two contiguous
    # vectors, which is rotate-half without any shuffle.
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HALF_P2)
    ok = (t < n_tokens)[:, None] & (d < HALF)[None, :]
    t64 = t.to(tl.int64)[:, None]
    c_row = Cos + t64 * stride_ct + d[None, :]
    s_row = Sin + t64 * stride_st + d[None, :]
    cos_lo = tl.load(c_row, mask=ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(c_row + HALF, mask=ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(s_row, mask=ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(s_row + HALF, mask=ok, other=0.0).to(tl.float32)
    x_row = X + t64 * stride_xt + d[None, :]
    o_row = Out + t64 * stride_ot + d[None, :]
    h0 = tl.program_id(1) * HEADS_PER_PROG
    for i in tl.static_range(HEADS_PER_PROG):
        h = h0 + i
        h_ok = ok & (h < n_heads)
        x = x_row + h * HEAD_DIM
        lo = tl.load(x, mask=h_ok, other=0.0).to(tl.float32)
        hi = tl.load(x + HALF, mask=h_ok, other=0.0).to(tl.float32)
        # x * cos + roll(x, HALF) * sin, the signed-sin form (sin_lo carries the minus).
        o = o_row + h * HEAD_DIM
        tl.store(o, (lo * cos_lo + hi * sin_lo).to(Out.dtype.element_ty), mask=h_ok)
        tl.store(o + HALF, (hi * cos_hi + lo * sin_hi).to(Out.dtype.element_ty), mask=h_ok)


def rope_qk_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                   kv_heads: int, head_dim: int) -> torch.Tensor:
    """RoPE over the first ``q_heads + kv_heads`` heads of each row of ``qkv``.

    qkv: ``[T, >= (q_heads + kv_heads) * head_dim]``, any row stride, unit column stride (the
    fused q|k|v projection, or the k|v one with ``kv_heads=0``); cos, sin: ``[T, head_dim]``
    (any row stride), cos and *signed* sin as ``Rope.cos_sin`` returns them (``-sin | +sin``).
    Returns a new contiguous ``[T, q_heads + kv_heads, head_dim]`` of qkv's dtype equal to
    ``x * cos + roll(x, head_dim / 2) * sin`` per head (``fused.rope_qk``), in float32 math.
    """
    heads = q_heads + kv_heads
    n = qkv.shape[0]
    assert head_dim % 2 == 0 and qkv.shape[1] >= heads * head_dim, (qkv.shape, heads, head_dim)
    assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.shape == sin.shape == (n, head_dim), (cos.shape, sin.shape, n)
    out = torch.empty((n, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0 or heads == 0:
        return out
    # Long prefills: 16 tokens x 8 heads a program (cos/sin reused 8 times, ~2.5K programs at
    # 8K tokens x 40 heads); short batches (decode): one head a program for parallelism.
    block_t = min(16, triton.next_power_of_2(n))
    per_prog = 8 if n >= 1024 else 1
    half_p2 = triton.next_power_of_2(head_dim // 2)
    grid = (triton.cdiv(n, block_t), triton.cdiv(heads, per_prog))
    _rope_qk_kernel[grid](
        qkv, cos, sin, out, n, heads,
        qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0),
        HEAD_DIM=head_dim, HALF_P2=half_p2, BLOCK_T=block_t, HEADS_PER_PROG=per_prog,
        num_warps=max(1, min(4, block_t * half_p2 // 256)))  # ~8 elements a thread a half
    return out


@triton.jit
def _silu_mul_kernel(
    X, Out, n_cols, stride_xt, stride_ot,
    BLOCK: tl.constexpr,
):
    # Program (row, column block): gate and up of a row are two contiguous runs of the same
    # row, so both loads are fully coalesced and vectorised; int64 row offsets because
    # T * 2I passes 2^31 at 75K tokens of Llama-3-8B's 28672 columns.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_cols
    x = X + row * stride_xt + c
    gate = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x + n_cols, mask=ok, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_ot + c, act.to(Out.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` (gate first, any row stride, unit column
    stride): a new contiguous ``[T, I]`` of the input's dtype, float32 math (``fused.silu_mul``).
    """
    n, width = gate_up.shape
    assert width % 2 == 0 and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    cols = width // 2
    out = torch.empty((n, cols), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0 or cols == 0:
        return out
    # 2048 columns (8 warps, 8 elements a thread: 16-byte bf16 vectors) for long prefills;
    # at decode batch sizes smaller blocks keep more programs in flight.
    block = min(2048 if n >= 256 else 512, triton.next_power_of_2(cols))
    grid = (n, triton.cdiv(cols, block))
    _silu_mul_kernel[grid](gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=block,
                           num_warps=8 if block >= 2048 else 4)
    return out


@triton.jit
def _write_kv_kernel(
    K, V, KPool, VPool, Slots,
    n_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HEAD_DIM: tl.constexpr, HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr,
):
    # One program per written row: its K and V rows ([heads, head_dim] each) to the slot's
    # flat row of both pools, so K and V cost one launch instead of two index_copy_ calls.
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + row).to(tl.int64)
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    ok = (h < n_heads) & (d < HEAD_DIM)
    dst = slot * n_heads * HEAD_DIM + h * HEAD_DIM + d
    k = tl.load(K + row * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(V + row * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(KPool + dst, k.to(KPool.dtype.element_ty), mask=ok)
    tl.store(VPool + dst, v.to(VPool.dtype.element_ty), mask=ok)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                    v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """``k_pool.view(-1, H, D)[slots[i]] = k[i]`` and the same for v, in one launch.

    k, v: ``[W, H, D]``, any row and head stride, unit last stride (slices of the qkv
    projection); k_pool, v_pool: contiguous ``[pages, P, H, D]`` (flat slot ``page * P + j``);
    slots: ``[W]`` integer flat slots. Slots named twice get one of the rows (as
    ``index_copy_``); only the scratch slot is ever named twice.
    """
    n, heads, dim = k.shape
    assert v.shape == k.shape and k.stride(2) == 1 and v.stride(2) == 1, (k.stride(), v.stride())
    assert k_pool.is_contiguous() and v_pool.is_contiguous()
    assert k_pool.shape[-2:] == (heads, dim) and v_pool.shape[-2:] == (heads, dim)
    assert slots.shape == (n,), (slots.shape, n)
    if n == 0:
        return
    _write_kv_kernel[(n,)](
        k, v, k_pool, v_pool, slots, heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=dim, HEADS_P2=triton.next_power_of_2(heads),
        DIM_P2=triton.next_power_of_2(dim), num_warps=4)
