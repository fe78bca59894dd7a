"""ResidualAttention decode in one warp-specialized launch (Gluon, Hopper; ``variant="ws"``).

Two-pass decode (residual_decode_triton.py) runs the q-folded residual score (tensor-core
bound: ``D x G x r`` multiply-adds per key and KV head) before the base K/V stream (memory
bound), one after the other. Triton's own warp specialization does not take this loop
(KERNELS.md "Round 17": its producer lowering takes TMA loads only, and the page gathers are
not). Here the roles are explicit (``gl.warp_specialize``):

* the **loader** (one warp) gathers each 64-key tile by TMA, one box per page: the page's
  ``K_base, V_base`` halves for the program's KV head, the residual rows ``K_res, V_res`` and
  the tile's cos|sin rows from the bf16 RoPE table, into a ring of ``STAGES`` shared-memory
  slots, each with a ready and an empty mbarrier;
* the **consumer** (the default partition, one warp group) takes the slots in order: the
  base scores ``K @ q^T`` and the folded residual scores ``cos @ Fc + sin @ Fs`` as wgmma
  with the keys as M, all four in flight before one wait; the rank contraction with
  ``K_res`` in each thread's registers (the folds' rows in lane order, ``_fold_rows``); the
  online softmax; ``V^T @ p`` by wgmma beside ``V_res^T @ p`` by mma_v2; then it frees the
  slot. (Round 21 on the H200: the next tile's score products issued before this tile's
  softmax lost 0.04-0.26x unified, the consumer then holding two of the three slots; each
  slot's K and V halves on barriers of their own gained nothing.)

So the HBM stream of the next tiles runs while this tile's products do. The GQA group (padded
to 4 or 8 query columns with zero queries, ``padded_group``) is spread over the wgmma's 8 or
16 columns by interleaving: query ``g`` is column ``2 g`` (``join`` with zeros, ``split``
back). The consumer makes the folded matrices ``Fc, Fs``
(residual_score_qfold.py's algebra) and the interleaved queries itself, both scaled into the
log2 domain, once its first tile has landed, so the loader's first gathers run meanwhile
(round 21: 0.00-0.04x unified faster than making them before the fork); ``B_v`` is applied
once after the loop. (A tile's page rows read by the loader as one small tensor before its
slot wait, instead of one by one beside the copies, gained nothing either.)

Grid ``(batch * n_kv, splits)``; a program's keys are its split of its own sequence
(``DYN_SPLIT``, the dynamic plan), its output the partials ``merge_partials`` combines, or
the output itself at one split. Shapes it takes (``ws_shape``): 16-key pages, head_dim 128, a
GQA group of up to 8, residual rank 16 (or 32 with a group of up to 4), bf16, contiguous
pools; the rest stay on two-pass, and so do the taken shapes the decode policy has not
measured (``decode_policy.MEASURED_WS_SHAPES``).
"""
from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from forkserve.kernels.residual_decode_triton import cuda_capability
from forkserve.kernels.rope import cached_rope_table, rope_table_in
from forkserve.kernels.split_kv import dynamic_splits, empty_partials, merge_partials, sm_count

LOG2E = 1.4426950408889634
PAGE = 16
TILE = 64  # keys per slot: the wgmma M of the score products
STAGES = 3
PROGRAMS_PER_SM = 1  # 3 slots of 52 KiB, ~178 KiB in all: one program per SM
# The registers each thread starts with: the loader's warp group is cut to 40 (its
# ``warp_specialize`` count), the consumer keeps these.
MAXNREG = 256


def hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU: the kernel lowers to sm_90a's wgmma, which later
    architectures (sm_100, sm_120) do not have."""
    return cuda_capability(device) == (9, 0)


# The pool ranks the kernel takes (a K_res row is one TMA box; the V_res product's M).
# Which of the shapes ``ws_shape`` takes the decode policy picks is the policy's
# (``decode_policy.MEASURED_WS_SHAPES``: those measured on the H200).
RANKS = (16, 32)


def padded_group(group: int) -> int | None:
    """The query columns a KV head's GQA ``group`` takes in the kernel (4 or 8: the score
    wgmma's N is twice it, at least 8), the rest zero queries; None past 8."""
    return 4 if 1 <= group <= 4 else 8 if group <= 8 else None


def builds_for(group: int, rank: int) -> bool:
    """Whether the kernel is built for a GQA ``group`` and pool ``rank``: a group of at most
    8, rank 16 or 32 with the padded group times the rank at most 128 (the folds ``Fc, Fs``
    are ``2 x G r x 64`` bf16 of shared memory beside the slot ring)."""
    padded = padded_group(group)
    return padded is not None and rank in RANKS and padded * rank <= 128


def ws_shape(q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor
             ) -> tuple[int, int] | None:
    """``(GQA group, rank)`` where ``residual_decode_ws`` takes these tensors on this device,
    else None: 16-key pages, head_dim 128, a group and rank it ``builds_for``, bf16,
    contiguous pools, sm_90."""
    n_kv, head_dim = k_base.shape[2], k_base.shape[3]
    group, rank = q.shape[1] // n_kv, k_res.shape[2]
    # The TMA descriptors view the pools as 2-D row-major tensors.
    ok = (q.dtype == torch.bfloat16 and k_base.shape[1] == PAGE
          and k_base.is_contiguous() and k_res.is_contiguous() and q.stride(2) == 1
          and head_dim == 128 and q.shape[1] == group * n_kv and builds_for(group, rank)
          and hopper(q.device))
    return (group, rank) if ok else None


def supports(q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor) -> bool:
    """Whether ``residual_decode_ws`` takes these shapes on this device (``ws_shape``)."""
    return ws_shape(q, k_base, k_res) is not None


@gluon.constexpr_function
def wgmma_layout(n, num_warps):
    """The accumulator of a keys-as-M (or head-dim-as-M) wgmma ``[64, n]``."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.constexpr_function
def mma2_layout(num_warps):
    """The accumulator of the ``V_res^T p`` product (``[r, 2G]``, mma_v2)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, 8])


@gluon.jit
def _loader(args):
    """The loader partition (one warp): TMA gathers of every tile of the program's keys."""
    descs, bars, bufs, _, scalars, _ = args
    kd, vd, krd, vrd, csd = descs
    ready, empty = bars
    k_lo, k_hi, v_lo, v_hi, kr, vr, cs_c, cs_s = bufs
    bt_row, rbt_row, kv_col, start, stop, seq_len, n_tiles, has_res = scalars
    HALF: gl.constexpr = k_lo.type.shape[2]
    T: gl.constexpr = k_lo.type.shape[1]
    NS: gl.constexpr = k_lo.type.shape[0]
    P: gl.constexpr = kd.block_type.shape[0]
    kv_bytes: gl.constexpr = 4 * (T // P) * kd.block_type.nbytes
    res_bytes: gl.constexpr = 2 * (T // P) * krd.block_type.nbytes + 2 * csd.block_type.nbytes
    last_page = (seq_len - 1) // P
    for i in range(n_tiles):
        s = i % NS
        mbarrier.wait(empty.index(s), ((i // NS) & 1) ^ 1)
        n0 = start + i * T
        bar = ready.index(s)
        # expect's byte count is a constant: one of the two, by predicate.
        mbarrier.expect(bar, kv_bytes + res_bytes, pred=has_res)
        mbarrier.expect(bar, kv_bytes, pred=not has_res)
        for j in gl.static_range(T // P):
            # Pages past the sequence's end (a split's last tile) are clamped to its last
            # page: in bounds, and the compute side masks their keys.
            pi = gl.minimum(n0 // P + j, last_page)
            row = gl.load(bt_row + pi) * P
            tma.async_copy_global_to_shared(kd, [row, kv_col], bar, k_lo.index(s).slice(j * P, P))
            tma.async_copy_global_to_shared(kd, [row, kv_col + HALF], bar,
                                            k_hi.index(s).slice(j * P, P))
            tma.async_copy_global_to_shared(vd, [row, kv_col], bar, v_lo.index(s).slice(j * P, P))
            tma.async_copy_global_to_shared(vd, [row, kv_col + HALF], bar,
                                            v_hi.index(s).slice(j * P, P))
            if has_res:
                rrow = gl.load(rbt_row + pi) * P
                tma.async_copy_global_to_shared(krd, [rrow, 0], bar, kr.index(s).slice(j * P, P))
                tma.async_copy_global_to_shared(vrd, [rrow, 0], bar, vr.index(s).slice(j * P, P))
        if has_res:
            # The table's rows past its end read as zeros (TMA fills out-of-bounds boxes).
            tma.async_copy_global_to_shared(csd, [n0, 0], bar, cs_c.index(s))
            tma.async_copy_global_to_shared(csd, [n0, HALF], bar, cs_s.index(s))


@gluon.jit
def _zero_rows_from(buf, first):
    """Rows ``first..`` of the shared-memory tile ``buf`` set to zero."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, buf.type.shape[0], layout=gl.SliceLayout(1, layout))
    x = buf.load(layout)
    buf.store(gl.where(gl.expand_dims(rows < first, 1), x, gl.zeros_like(x)))


@gluon.jit
def _zero_values_from(bufs, s, first, has_res):
    """Slot ``s``'s ``V`` rows (and ``V_res``'s, for a row with an adapter) from ``first`` on
    set to zero, fenced for the value products: a split's last tile runs past its keys, and
    their stale or never written page slots would reach the products as 0 * NaN."""
    _zero_rows_from(bufs[2].index(s), first)
    _zero_rows_from(bufs[3].index(s), first)
    if has_res:
        _zero_rows_from(bufs[5].index(s), first)
    fence_async_shared()


@gluon.jit
def _interleave(x, zero):
    """``[T, G]`` -> ``[T, 2G]`` with ``x[:, g]`` at column ``2 g`` and ``zero`` between."""
    return gl.reshape(gl.join(x, zero), [x.shape[0], 2 * x.shape[1]])


@gluon.jit
def _evens(x):
    """The even columns of ``[T, 2G]``: ``_interleave``'s inverse."""
    a, b = gl.split(gl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    return a


@gluon.jit
def _columns(a, layout: gl.constexpr):
    """A ``[G]`` factor as a ``[1, 2G]`` row of an interleaved accumulator in ``layout``."""
    a2 = gl.reshape(gl.join(a, a), [2 * a.shape[0]])
    return gl.expand_dims(gl.convert_layout(a2, gl.SliceLayout(0, layout)), 0)


@gluon.jit
def _fold_rows(f):
    """``[G, r, D/2]`` folds as the ``[G r, D/2]`` B operand, row ``2G (k // 2) + 2g + k %
    2``: the order in which the product's wgmma accumulator gives each thread all r columns
    of one g (lane ``g`` of its quad), so the rank contraction needs no layout conversion
    (``_contract``)."""
    G: gl.constexpr = f.type.shape[0]
    R: gl.constexpr = f.type.shape[1]
    HALF: gl.constexpr = f.type.shape[2]
    f = gl.permute(gl.reshape(f, [G, R // 2, 2, HALF]), (1, 0, 2, 3))
    return gl.reshape(f, [G * R, HALF])


@gluon.jit
def _contract(w, k_res, lp: gl.constexpr):
    """The residual scores ``[T, G]``, ``sum_k w[n, (g, k)] K_res[n, k]``, for folds in
    ``_fold_rows``' order: the sum over k is over each thread's own registers, and the
    result lands where ``_evens`` puts the base scores (``lp``). (Four partial sums, which
    cut that chain of r dependent multiply-adds to 7, measured no faster: KERNELS.md
    "Round 27".)"""
    T: gl.constexpr = w.type.shape[0]
    R: gl.constexpr = k_res.type.shape[1]
    G: gl.constexpr = w.type.shape[1] // R
    w3 = gl.reshape(gl.permute(gl.reshape(w, [T, R // 2, G, 2]), (0, 2, 1, 3)), [T, G, R])
    k_rows = k_res.load(gl.SliceLayout(1, w3.type.layout)).to(gl.float32)
    return gl.convert_layout(gl.sum(w3 * gl.expand_dims(k_rows, 1), axis=2), lp,
                             assert_trivial=True)


@gluon.jit
def _issue_scores(args, i, s_mma: gl.constexpr, p_mma: gl.constexpr):
    """Waits for tile ``i``'s slot and issues its score products, all in flight (wgmma
    async, for the caller to wait on): the base ``K q^T [T, 2G]`` and the folded residual
    ``cos Fc^T + sin Fs^T [T, G r]``. A row without an adapter has no cos|sin rows in its
    slots (stale bytes): ``_tile`` drops its residual scores by ``has_res``, so the products
    run unconditionally and no in-flight result crosses a branch."""
    _, bars, bufs, ops, scalars, _ = args
    ready = bars[0]
    k_lo, k_hi, _, _, _, _, cs_c, cs_s = bufs
    q_lo, q_hi, fc, fs, _, _ = ops
    NS: gl.constexpr = k_lo.type.shape[0]
    T: gl.constexpr = k_lo.type.shape[1]
    NQ: gl.constexpr = q_lo.type.shape[0]
    NF: gl.constexpr = fc.type.shape[0]
    s = i % NS
    mbarrier.wait(ready.index(s), (i // NS) & 1)
    sb = warpgroup_mma(k_lo.index(s), q_lo.permute((1, 0)),
                       gl.zeros([T, NQ], gl.float32, s_mma), use_acc=False,
                       is_async=True)
    sb = warpgroup_mma(k_hi.index(s), q_hi.permute((1, 0)), sb, is_async=True)
    w = warpgroup_mma(cs_c.index(s), fc.permute((1, 0)),
                      gl.zeros([T, NF], gl.float32, p_mma), use_acc=False,
                      is_async=True)
    w = warpgroup_mma(cs_s.index(s), fs.permute((1, 0)), w, is_async=True)
    return sb, w


@gluon.jit
def _max_over_warps(score, m_i, red):
    """The tile's max with the running ``m_i`` ``[G]`` in one barrier: each warp's own by
    shuffles into its row of ``red [warps, G]``, then every thread reads all the rows and
    takes their max itself (``gl.max`` over the warps has a second round trip, where a few
    threads reduce and write the result back). The next tile's store to ``red`` waits for
    these reads at the probabilities' barrier (``p_smem``) between them."""
    T: gl.constexpr = score.type.shape[0]
    G: gl.constexpr = score.type.shape[1]
    nw: gl.constexpr = gl.num_warps()
    s3 = gl.reshape(score, [nw, T // nw, G])
    red.store(gl.max(s3, axis=1))
    everyone: gl.constexpr = gl.BlockedLayout([nw, 1], [32 // G, G], [nw, 1], [1, 0])
    m_t = gl.max(red.load(everyone), axis=0)
    return gl.maximum(m_i, gl.convert_layout(m_t, m_i.type.layout))


@gluon.jit
def _tile(args, i, sb, w, state, lp: gl.constexpr):
    """Tile ``i`` from its finished score products: the masked scores, the online softmax
    and the value products (issued, not waited on). Returns the updated state. Only the
    tile's max crosses the consumer's four warps, in one barrier (``_max_over_warps``):
    ``l`` is each thread's ``[T, G]`` running sums of its own probabilities, rescaled as the
    accumulator is and reduced once after the loop (``_consume``; KERNELS.md "Round 26":
    a tile's barriers 8 -> 4)."""
    _, _, bufs, ops, scalars, _ = args
    _, _, v_lo, v_hi, kr, vr, _, _ = bufs
    p_smem = ops[4]
    _, _, _, start, stop, _, _, has_res = scalars
    m_i, l_i, acc_lo, acc_hi, acc_r = state
    NS: gl.constexpr = v_lo.type.shape[0]
    T: gl.constexpr = v_lo.type.shape[1]
    s_mma: gl.constexpr = acc_lo.type.layout
    r_mma: gl.constexpr = acc_r.type.layout
    s = i % NS
    if start + (i + 1) * T > stop:
        _zero_values_from(bufs, s, stop - start - i * T, has_res)
    # where, not a product: the stale slots of a row without an adapter may hold NaN.
    score = (gl.convert_layout(_evens(sb), lp)
             + gl.where(has_res, _contract(w, kr.index(s), lp), 0.0))
    keys = gl.arange(0, T, layout=gl.SliceLayout(1, lp))
    score = gl.where(gl.expand_dims(start + i * T + keys < stop, 1), score, float("-inf"))
    m_new = _max_over_warps(score, m_i, ops[5])
    p = gl.exp2(score - gl.expand_dims(m_new, 0))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * gl.expand_dims(alpha, 0) + p
    acc_lo = acc_lo * _columns(alpha, s_mma)
    acc_hi = acc_hi * _columns(alpha, s_mma)
    acc_r = acc_r * _columns(alpha, r_mma)
    p_smem.store(gl.permute(_interleave(p, gl.zeros_like(p)).to(gl.bfloat16), (1, 0)))
    fence_async_shared()
    acc_lo = warpgroup_mma(v_lo.index(s).permute((1, 0)), p_smem.permute((1, 0)), acc_lo,
                           is_async=True)
    acc_hi = warpgroup_mma(v_hi.index(s).permute((1, 0)), p_smem.permute((1, 0)), acc_hi,
                           is_async=True)
    if has_res:  # mma_v2 reads p back from where the value wgmma reads it: no conversion
        acc_r = mma_v2(vr.index(s).permute((1, 0)).load(gl.DotOperandLayout(0, r_mma, 2)),
                       p_smem.permute((1, 0)).load(gl.DotOperandLayout(1, r_mma, 2)), acc_r)
    return m_new, l_i, acc_lo, acc_hi, acc_r


@gluon.jit
def _release(args, i):
    """Tile ``i``'s slot back to the loader, its reads done (the caller waited on the
    value products)."""
    empty = args[1][1]
    # The slot's generic-proxy reads ordered before the loader's next TMA writes to it.
    fence_async_shared()
    mbarrier.arrive(empty.index(i % empty.type.shape[0]))


@gluon.jit
def _make_operands(operands, bufs, GROUP: gl.constexpr):
    """The queries, interleaved with zero rows to 2G (the N of the score wgmma), and the
    folded matrices (residual_score_qfold.py), both in the log2 domain, into ``q_lo, q_hi,
    fc, fs`` for the whole loop (a program with keys). ``operands``: the program's query row
    (its first head), the query head stride, its adapter's ``B_k`` row (its KV head's
    columns), the rank stride, the scale, whether it folds (a row with an adapter).
    ``GROUP``: the query heads of its GQA group (``G`` or fewer: the rest are padding, zero
    queries)."""
    q_row, stride_qh, b_row, stride_bk, scale_log2e, f_ok = operands
    q_lo, q_hi, fc, fs = bufs[0], bufs[1], bufs[2], bufs[3]
    GP2: gl.constexpr = q_lo.type.shape[0]
    HALF: gl.constexpr = q_lo.type.shape[1]
    G: gl.constexpr = GP2 // 2
    R: gl.constexpr = fc.type.shape[0] // G
    nw: gl.constexpr = gl.num_warps()
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [nw, 1], [1, 0])
    qr = gl.arange(0, GP2, layout=gl.SliceLayout(1, lq))
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, lq))
    q_ptr = q_row + (qr // 2)[:, None] * stride_qh + d[None, :]
    q_ok = (qr % 2 == 0)[:, None]
    if GROUP < G:
        q_ok = q_ok & (qr // 2 < GROUP)[:, None]
    q_lo.store((gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float32) * scale_log2e)
               .to(gl.bfloat16))
    q_hi.store((gl.load(q_ptr + HALF, mask=q_ok, other=0.0).to(gl.float32) * scale_log2e)
               .to(gl.bfloat16))
    # Fc[(g, k), i] = q_lo[g, i] B_lo[k, i] + q_hi[g, i] B_hi[k, i]; Fs the rotated pair.
    lf: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [nw, 1, 1], [2, 1, 0])
    g3 = gl.expand_dims(gl.expand_dims(
        gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, lf))), 1), 2)
    k3 = gl.expand_dims(gl.expand_dims(
        gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, lf))), 0), 2)
    i3 = gl.expand_dims(gl.expand_dims(
        gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, lf))), 0), 1)
    fq = q_row + g3 * stride_qh + i3
    fq_ok = f_ok
    if GROUP < G:
        fq_ok = fq_ok & (g3 < GROUP)
    fq_lo = gl.load(fq, mask=fq_ok, other=0.0).to(gl.float32) * scale_log2e
    fq_hi = gl.load(fq + HALF, mask=fq_ok, other=0.0).to(gl.float32) * scale_log2e
    fb = b_row + k3 * stride_bk + i3
    fb_lo = gl.load(fb, mask=f_ok, other=0.0).to(gl.float32)
    fb_hi = gl.load(fb + HALF, mask=f_ok, other=0.0).to(gl.float32)
    fc.store(_fold_rows(fq_lo * fb_lo + fq_hi * fb_hi).to(gl.bfloat16))
    fs.store(_fold_rows(fq_hi * fb_lo - fq_lo * fb_hi).to(gl.bfloat16))


@gluon.jit
def _consume(args, GROUP: gl.constexpr):
    """The consumer warp group: every tile of the program's keys. Returns its online-softmax
    state: ``m, l [G]`` (log2 domain), ``acc_lo, acc_hi [D/2, 2G]`` (``V^T p``, interleaved
    columns) and ``acc_r [r, 2G]`` (``V_res^T p``)."""
    _, _, bufs, ops, scalars, _ = args
    kr = bufs[4]
    fc = ops[2]
    n_tiles = scalars[6]
    T: gl.constexpr = kr.type.shape[1]
    R: gl.constexpr = kr.type.shape[2]
    HALF: gl.constexpr = bufs[0].type.shape[2]
    G: gl.constexpr = fc.type.shape[0] // R
    GP2: gl.constexpr = 2 * G
    nw: gl.constexpr = gl.num_warps()
    s_mma: gl.constexpr = wgmma_layout(GP2, nw)
    p_mma: gl.constexpr = wgmma_layout(G * R, nw)
    r_mma: gl.constexpr = mma2_layout(nw)
    # [T, G] scores and probabilities: the layout _evens gives the base scores' accumulator,
    # where _contract's residual scores land too.
    lp: gl.constexpr = _evens(gl.zeros([T, GP2], gl.float32, s_mma)).type.layout
    col: gl.constexpr = gl.SliceLayout(0, lp)  # [G]
    state = (gl.full([G], float("-inf"), gl.float32, col), gl.zeros([T, G], gl.float32, lp),
             gl.zeros([HALF, GP2], gl.float32, s_mma), gl.zeros([HALF, GP2], gl.float32, s_mma),
             gl.zeros([R, GP2], gl.float32, r_mma))
    if n_tiles > 0:  # an empty split needs no operands
        # Made here, after the fork, so the loader's first gathers run meanwhile. Not before
        # its first tile lands: the loader reads its arguments from shared memory at its
        # start, in bytes this partition's layout conversions may reuse (Triton 3.6;
        # docs/KERNELS.md "Round 20").
        mbarrier.wait(args[1][0].index(0), 0)
        _make_operands(args[5], ops, GROUP)
        fence_async_shared()
    for i in range(n_tiles):
        sb, w = _issue_scores(args, i, s_mma, p_mma)
        sb, w = warpgroup_mma_wait(0, deps=(sb, w))
        m_i, l_i, acc_lo, acc_hi, acc_r = _tile(args, i, sb, w, state, lp)
        acc_lo, acc_hi = warpgroup_mma_wait(0, deps=(acc_lo, acc_hi))
        state = (m_i, l_i, acc_lo, acc_hi, acc_r)
        _release(args, i)
    m_i, l_i, acc_lo, acc_hi, acc_r = state
    return m_i, gl.sum(l_i, axis=0), acc_lo, acc_hi, acc_r


@gluon.jit
def slot_ring(kd, krd, csd, STAGES_: gl.constexpr, T: gl.constexpr):
    """The loader's ring in shared memory: ``STAGES_`` slots of a ``T``-key tile, each the
    halves of ``K_base`` and ``V_base`` (``kd``'s boxes), ``K_res`` and ``V_res`` rows
    (``krd``'s) and the cos and sin rows (``csd``'s), with a ready and an empty mbarrier each.
    Returns ``(k_lo, k_hi, v_lo, v_hi, kr, vr, cs_c, cs_s), (ready, empty)``, ``_loader``'s
    order."""
    HALF: gl.constexpr = kd.block_type.shape[1]
    R: gl.constexpr = krd.block_type.shape[1]
    k_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, HALF], kd.layout)
    k_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, HALF], kd.layout)
    v_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, HALF], kd.layout)
    v_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, HALF], kd.layout)
    kr = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, R], krd.layout)
    vr = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, R], krd.layout)
    cs_c = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, HALF], csd.layout)
    cs_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, T, HALF], csd.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return (k_lo, k_hi, v_lo, v_hi, kr, vr, cs_c, cs_s), (ready, empty)


@gluon.jit
def _residual_decode_ws_kernel(
        kd, vd, krd, vrd, csd, Q, BK, BV, Adapter, BlockTables, ResTables, SeqLens,
        Out, PartOut, PartLse, scale_log2e,
        stride_qb, stride_qh, stride_bt, stride_rbt, stride_ba, stride_bk,
        stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        N_KV: gl.constexpr, GROUP: gl.constexpr, G: gl.constexpr, R: gl.constexpr,
        HEAD_DIM: gl.constexpr, T: gl.constexpr, STAGES_: gl.constexpr, DIRECT: gl.constexpr,
        num_warps: gl.constexpr):
    # GROUP query heads a KV head, padded to G (4 or 8: the score wgmma's N is 2G).
    HALF: gl.constexpr = HEAD_DIM // 2
    GP2: gl.constexpr = 2 * G
    pid = gl.program_id(0)
    split = gl.program_id(1)
    row = pid // N_KV
    head = pid % N_KV
    seq_len = gl.load(SeqLens + row)
    span = gl.maximum(seq_len, 0)
    key_split = gl.cdiv(gl.cdiv(span, gl.num_programs(1)), T) * T
    start = split * key_split
    stop = gl.minimum(start + key_split, seq_len)
    n_tiles = gl.cdiv(gl.maximum(stop - start, 0), T)
    adapter = gl.load(Adapter + row)
    has_res = adapter >= 0

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GP2, HALF], gl.bfloat16)
    q_lo = gl.allocate_shared_memory(gl.bfloat16, [GP2, HALF], q_layout)
    q_hi = gl.allocate_shared_memory(gl.bfloat16, [GP2, HALF], q_layout)
    f_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([G * R, HALF], gl.bfloat16)
    fc = gl.allocate_shared_memory(gl.bfloat16, [G * R, HALF], f_layout)
    fs = gl.allocate_shared_memory(gl.bfloat16, [G * R, HALF], f_layout)
    f_ok = has_res & (n_tiles > 0)
    operands = (Q + row * stride_qb + head * GROUP * stride_qh, stride_qh,
                BK + gl.maximum(adapter, 0) * stride_ba + head * HEAD_DIM, stride_bk,
                scale_log2e, f_ok)

    slots, bars = slot_ring(kd, krd, csd, STAGES_, T)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GP2, T], gl.bfloat16)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [GP2, T], p_layout)
    # Each warp's tile maxima (_max_over_warps).
    red = gl.allocate_shared_memory(gl.float32, [num_warps, G],
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    fence_async_shared()
    # One tuple for both partitions (a worker's arguments are the default's, by signature):
    # descriptors, barriers, slots, the operands' buffers, the program's integers, what
    # _make_operands reads.
    args = ((kd, vd, krd, vrd, csd), bars, slots, (q_lo, q_hi, fc, fs, p_smem, red),
            (BlockTables + row * stride_bt, ResTables + row * stride_rbt, head * HEAD_DIM,
             start, stop, seq_len, n_tiles, has_res), operands)
    m_i, l_i, acc_lo, acc_hi, acc_r = gl.warp_specialize(
        [(_consume, (args, GROUP)), (_loader, (args, ))], [1], [40])

    # out^T [D, G] = (acc + B_v^T acc_r) / l: the V residual's up-projection once, here.
    lo3: gl.constexpr = gl.BlockedLayout([1, R, 1], [16, 1, 2], [num_warps, 1, 1], [2, 1, 0])
    lo2: gl.constexpr = gl.SliceLayout(1, lo3)  # [HALF, G]
    dd = gl.arange(0, HALF, layout=gl.SliceLayout(1, gl.SliceLayout(2, lo3)))
    kk = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, lo3)))
    bv_ptr = (BV + gl.maximum(adapter, 0) * stride_ba + kk[None, :] * stride_bk
              + head * HEAD_DIM + dd[:, None])
    res = gl.expand_dims(gl.convert_layout(_evens(acc_r), gl.SliceLayout(0, lo3)), 0)
    bv_lo = gl.load(bv_ptr, mask=f_ok, other=0.0).to(gl.float32)
    bv_hi = gl.load(bv_ptr + HALF, mask=f_ok, other=0.0).to(gl.float32)
    l_safe = gl.convert_layout(gl.where(l_i > 0, l_i, 1.0), gl.SliceLayout(0, lo2))
    o_lo = (gl.convert_layout(_evens(acc_lo), lo2) + gl.sum(gl.expand_dims(bv_lo, 2) * res, 1))
    o_hi = (gl.convert_layout(_evens(acc_hi), lo2) + gl.sum(gl.expand_dims(bv_hi, 2) * res, 1))
    o_lo = o_lo / gl.expand_dims(l_safe, 0)
    o_hi = o_hi / gl.expand_dims(l_safe, 0)
    od = gl.arange(0, HALF, layout=gl.SliceLayout(1, lo2))
    og = gl.arange(0, G, layout=gl.SliceLayout(0, lo2))
    heads = head * GROUP + og
    o_ok = (og < GROUP)[None, :]  # the padding heads' columns are not stored
    if DIRECT:
        o_ptr = Out + row * stride_ob + heads[None, :] * stride_oh + od[:, None]
        gl.store(o_ptr, o_lo.to(Out.dtype.element_ty), mask=o_ok)
        gl.store(o_ptr + HALF, o_hi.to(Out.dtype.element_ty), mask=o_ok)
    else:
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        lg = gl.arange(0, G, layout=lse.type.layout)
        gl.store(PartLse + row * stride_lb + (head * GROUP + lg) * stride_lh + split, lse,
                 mask=lg < GROUP)
        if n_tiles > 0:
            p_ptr = (PartOut + row * stride_pb + heads[None, :] * stride_ph + split * stride_ps
                     + od[:, None])
            gl.store(p_ptr, o_lo, mask=o_ok)
            gl.store(p_ptr + HALF, o_hi, mask=o_ok)


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int) -> gl.NVMMASharedLayout:
    """A bf16 box's shared-memory layout (~11 us of host time to derive, per descriptor per
    launch on the eager prefill path otherwise; a pure function of the box)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def descriptors(k_base, v_base, k_res, v_res, table16):
    """TMA descriptors: one page's half head of K/V ``[P, D/2]`` over ``[pages * P, n_kv * D]``,
    one page of residual rows ``[P, r]``, a tile's cos or sin rows ``[TILE, D/2]``."""
    pages, page, n_kv, head_dim = k_base.shape
    half, rank = head_dim // 2, k_res.shape[2]

    def desc(t, rows, cols):
        flat = t.view(-1, t.shape[-1] if t.dim() == 3 else t.shape[2] * t.shape[3])
        return TensorDescriptor.from_tensor(flat, [rows, cols], _smem_layout(rows, cols))

    return (desc(k_base, page, half), desc(v_base, page, half), desc(k_res, page, rank),
            desc(v_res, page, rank),
            TensorDescriptor.from_tensor(table16, [TILE, half], _smem_layout(TILE, half)))


def build_sm90a(direct: bool, group: int = 4, rank: int = 16) -> tuple[str, int]:
    """The kernel's PTX for sm_90a and its shared memory in bytes (output written directly,
    or as partials), built without a GPU at ``sm90_build.WS_SHAPE`` with this GQA group and
    rank."""
    from forkserve.kernels.sm90_build import compile_ws_sm90

    return compile_ws_sm90(_residual_decode_ws_kernel,
                           dict(T=TILE, STAGES_=STAGES, DIRECT=direct, num_warps=4, GROUP=group,
                                G=padded_group(group), R=rank),
                           MAXNREG)


def residual_decode_ws(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                       k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                       res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                       inv_freq: torch.Tensor, scale: float | None = None,
                       max_seq_len: int = 0, num_splits: int | None = None) -> torch.Tensor:
    """ResidualAttention decode of ``q [batch, H, D]`` (the layout contract of
    docs/KERNELS.md), one warp-specialized launch plus the split merge; the shapes of
    ``supports`` only. ``max_seq_len``: a host bound on ``seq_lens`` (the table's rows and
    the split plan; graph-safe)."""
    if not supports(q, k_base, k_res):
        raise ValueError("residual_decode_ws: 16-key pages, head_dim 128, a GQA group of at "
                         "most 8, rank 16 (or 32 with a group of at most 4), bf16, contiguous "
                         "pools, on an sm_90 GPU")
    if b_k_all.stride() != b_v_all.stride():
        raise ValueError("residual_decode_ws: B_k and B_v stacked alike (one pair of strides)")
    batch, n_heads, head_dim = q.shape
    n_kv = k_base.shape[2]
    g, rank = n_heads // n_kv, k_res.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    bound = max(max_seq_len, 1)
    table16 = rope_table_in(cached_rope_table(inv_freq, bound), q.dtype).view(-1, head_dim)
    kd, vd, krd, vrd, csd = descriptors(k_base, v_base, k_res, v_res, table16)
    splits = dynamic_splits(batch * n_kv, bound, sm_count(q.device), TILE, num_splits,
                            programs_per_sm=PROGRAMS_PER_SM)
    out = torch.empty_like(q)
    part_out, part_lse = empty_partials(q, splits) if splits > 1 else (out, out[:, :, 0])
    direct = splits == 1
    _residual_decode_ws_kernel[(batch * n_kv, splits)](
        kd, vd, krd, vrd, csd, q, b_k_all, b_v_all, adapter_idx, block_tables, res_block_tables,
        seq_lens, out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), res_block_tables.stride(0),
        b_v_all.stride(0), b_v_all.stride(1), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if not direct else 0,
        part_lse.stride(0), part_lse.stride(1),
        N_KV=n_kv, GROUP=g, G=padded_group(g), R=rank, HEAD_DIM=head_dim, T=TILE, STAGES_=STAGES,
        DIRECT=direct, num_warps=4, maxnreg=MAXNREG)
    if direct:
        return out
    return merge_partials(part_out, part_lse, out, splits)
