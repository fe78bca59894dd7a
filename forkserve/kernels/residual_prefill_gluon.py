"""ResidualAttention prefill in one warp-specialized launch (Gluon, Hopper; the ``ws`` route).

The Triton kernel (prefill_attention.py) rebuilds each key tile as ``K_base + RoPE(K_res
B_k)`` with ``tl.dot`` over pointer gathers; against FlashAttention-4 reading the unified
pages it ran 4.5x at 8 chunks of 64 tokens over 8K keys (kernel_bench_prefill.json, round
22), and the packed route that rebuilds the whole context before FA4 3.2x (the rebuild
alone writes every key). Here the decode kernel's loader (residual_decode_gluon.py: one
warp, one TMA box per page half of ``K_base, V_base``, the page's ``K_res, V_res`` rows and
the tile's cos|sin rows, a ring of slots) feeds consumer warp groups that hold the query rows
as the wgmma's M, a row a (token, query head of the KV head's GQA group): 64 (16 tokens at a
group of 4) on one warp group, or 128 on two in lockstep (``WsPrefillLaunch``). Per key
tile:

* the whole key rebuilt once for every row: ``U = K_res B_k`` as two wgmma (64 keys x 64
  columns, K = r), RoPE in registers (the halves of a column pair sit in one thread), plus
  the base tile, stored bf16 to a shared tile ``rot`` (the queries are not folded into
  ``B_k`` as the decode does: with 64+ query rows the folded product would cost r times the
  score product);
* the scores ``Q rot^T``, issued for tile ``i + 1`` before tile ``i``'s softmax so they run
  under it; the causal mask and the online softmax in the log2 domain;
* ``P V_base`` by wgmma with P from registers and ``P V_res`` (N = r) beside it, one wait a
  tile; ``B_v`` applied once after the loop.

Grid ``(batch * n_kv * m_blocks, splits)``, the m blocks of one (sequence, KV head)
adjacent so their key tiles meet in L2; a program's keys are its split of the keys its
block's last token sees, merged by ``split_kv.merge_partials`` when the dynamic plan cuts
them. Shapes: ``ws_prefill_shape`` (the decode kernel's ``ws_shape`` at a GQA group of 1, 2,
4 or 8 and rank 16: 16-key pages, head_dim 128, bf16, contiguous pools, sm_90); the default
routing takes the measured ones (``prefill_policy.MEASURED_WS_PREFILL_SHAPES``). Measured:
docs/KERNELS.md "Round 23" and on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from forkserve.kernels.residual_decode_gluon import (
    LOG2E,
    MAXNREG,
    STAGES,
    TILE,
    _loader,
    _release,
    _zero_values_from,
    descriptors,
    slot_ring,
    wgmma_layout,
    ws_shape,
)
from forkserve.kernels.rope import cached_rope_table, rope_table_in
from forkserve.kernels.split_kv import dynamic_splits, empty_partials, merge_partials, sm_count

if TYPE_CHECKING:
    from forkserve.kernels.residual_prefill_wide import WideLaunch

# The GQA groups the kernel is built for: a program's rows are whole tokens (a group that
# divides a warp group's 64 rows). Rank 16 only: a rank-32 slot is 4 KiB larger, and three
# no longer fit beside the operands (229 of 227 KiB).
GROUPS = (1, 2, 4, 8)
RANK = 16


def ws_prefill_shape(q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor
                     ) -> tuple[int, int] | None:
    """``(GQA group, rank)`` where ``residual_prefill_ws`` takes these tensors on this
    device, else None: the decode kernel's shapes (``residual_decode_gluon.ws_shape``) at a
    group of ``GROUPS`` and rank 16."""
    shape = ws_shape(q, k_base, k_res)
    return shape if shape is not None and shape[0] in GROUPS and shape[1] == RANK else None


def supports(q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor) -> bool:
    """Whether ``residual_prefill_ws`` takes these shapes on this device
    (``ws_prefill_shape``)."""
    return ws_prefill_shape(q, k_base, k_res) is not None


@dataclass(frozen=True)
class WsPrefillLaunch:
    """One launch configuration: ``rows`` query rows a program (64: one consumer warp group;
    128: two, in lockstep over one slot ring, so each key tile is loaded and rebuilt once for
    both), ``stages`` slots in the ring, and ``edge_masks``: the causal and split-end mask
    applied only to the tiles that cross them (every row of a program sees the keys before
    its first token's position), not to every tile; ``base_scores``: the base key's scores
    taken straight from the slot, ``rot`` holding only the residual's rotated key (four
    score products a tile, no base tile through registers); ``bf16_rope`` (with
    ``base_scores`` only): that rotated residual computed in packed bf16 pairs
    (``_rope_bf16x2``). Each cuts the consumer's instructions a tile (docs/KERNELS.md "Round
    24" and "Round 25"); the time follows them only in part (round 27: 0.69x the
    instructions, 0.96x the time). Round 25-26's ``pairs`` (two tiles a loop iteration) and
    ``late_pv`` (the value products a tile late) measured no faster and slower, and were
    removed in round 27."""

    rows: int = 128
    stages: int = STAGES
    edge_masks: bool = False
    base_scores: bool = False
    bf16_rope: bool = False

    def __post_init__(self) -> None:
        if self.bf16_rope and not self.base_scores:
            raise ValueError("WsPrefillLaunch: bf16_rope rounds the rotated residual alone, "
                             "so it needs base_scores")

    @property
    def name(self) -> str:
        """``ws_m<rows>_s<stages>`` and the options it takes, as the bench reports it."""
        options = ("edge", "base", "bf16")
        flags = (self.edge_masks, self.base_scores, self.bf16_rope)
        return f"ws_m{self.rows}_s{self.stages}" + "".join(
            f"_{o}" for o, on in zip(options, flags, strict=True) if on)

    @property
    def warps(self) -> int:
        return self.rows // 16

    def constexprs(self) -> dict:
        """The kernel's compile-time arguments for this launch and its options (``maxnreg``
        is the launch's, not a constexpr)."""
        return dict(M=self.rows, STAGES_=self.stages, EDGE_MASKS=self.edge_masks,
                    BASE_SCORES=self.base_scores, BF16_ROPE=self.bf16_rope,
                    num_warps=self.warps)

    @property
    def maxnreg(self) -> int:
        """Registers a thread starts with: every warp of the program (the loader's padded to
        a warp group by ``warp_specialize``) within the SM's 64K, up to 256; the partitions'
        ``setmaxnreg`` then move the loader's to the consumers."""
        return min(MAXNREG, 65536 // ((self.warps + 4) * 32) // 8 * 8)


# The 128-key kernel's launch (residual_prefill_wide.WideLaunch's fields) the default takes
# at a GQA group and a program's rows: where a GPU measured it faster than the ws launch
# below at every case of residual_prefill_bench, and lowest there over FA4's paged read at
# its worst case (`residual_prefill_bench.wide_verdict`). Round 31, an H100
# (residual_prefill_wide.json; docs/KERNELS.md "Round 31"): at 128 rows the two consumers
# in turns with every thread's release, 0.74-0.89x the ws launch's time; at 64 rows one
# consumer rebuilding whole key halves, 0.90x. Round 34, the H200
# (residual_prefill_wide_round34.json): at 128 rows the rebuild's reads before its waits
# and its writes held to the end of a half, 0.94-0.98x round 31's launch at every case,
# past the timing's spread (0.4%). Measured at GQA 4 only: other groups keep the ws
# launches.
MEASURED_WIDE_LAUNCHES: dict[tuple[int, int], tuple] = {
    (4, 128): (2, 184, 16, True, True, False, True, True, True),
    (4, 64): (1, 232, 64, True, False, False, True),
}


def default_launch(max_q_len: int, group: int = 4) -> WsPrefillLaunch | WideLaunch:
    """The launch for a batch whose longest chunk is ``max_q_len`` tokens at a GQA ``group``:
    64 query rows where the chunk's rows (tokens x group) fill no more, else 128; at a group
    of 4 the rows the fused Triton kernel takes (``prefill_attention.residual_launch``: 64
    for chunks of at most 16 tokens), measured for this kernel too (H200,
    residual_prefill_launches.json: 128 rows ran 8 x 64 over 8K in 0.28-0.29 ms against 0.39
    for 64, and 4 x 64 over 32K in 0.56 against 0.75; 32 x 16 over 8K, which fills only 64
    rows, 0.40 against 0.54), each with the options that measured fastest there in round 27
    (residual_prefill_v5.json, every case): 128 rows with ``edge_masks`` (7-8% faster than
    without; the launches that cut more instructions were no faster, KERNELS.md "Round
    27"), 64 rows with ``edge_masks``, ``base_scores`` and ``bf16_rope`` (5-10%). The
    128-key kernel's launch instead at the group and rows ``MEASURED_WIDE_LAUNCHES``
    holds."""
    rows = 64 if max_q_len * group <= 64 else 128
    if (group, rows) in MEASURED_WIDE_LAUNCHES:
        from forkserve.kernels.residual_prefill_wide import WideLaunch

        return WideLaunch(*MEASURED_WIDE_LAUNCHES[group, rows])
    if rows == 64:
        return WsPrefillLaunch(64, edge_masks=True, base_scores=True, bf16_rope=True)
    return WsPrefillLaunch(128, edge_masks=True)


@gluon.constexpr_function
def rebuild_layout(n, num_warps):
    """The accumulator of a key tile's rebuild ``[64, n]``: M = 64 keys on one warp group, a
    second one (8 warps) taking half the columns."""
    wn = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn],
                                     instr_shape=[16, n // wn, 16])


@gluon.jit
def _stage_operands(operands, bufs, G: gl.constexpr):
    """The program's queries into ``q_lo, q_hi`` (``stage_queries``) and its adapter's
    ``B_k, B_v`` columns of its KV head into ``bk_lo, bk_hi, bv_lo, bv_hi`` (``stage_b``)."""
    q_base, stride_qt, stride_qh, tok0, q_len, bk_row, bv_row, stride_br, scale_log2e, \
        has_res = operands
    stage_queries(bufs[0], bufs[1], (q_base, stride_qt, stride_qh, tok0, q_len, scale_log2e), G)
    stage_b(bufs[2], bufs[3], bk_row, stride_br, has_res)
    stage_b(bufs[4], bufs[5], bv_row, stride_br, has_res)


@gluon.jit
def stage_queries(q_lo, q_hi, queries, G: gl.constexpr):
    """Query rows ``[rows, D/2]`` halves scaled into the log2 domain (rows past the chunk
    zero): row ``j`` token ``tok0 + j // G`` and head ``j % G`` of the GQA group ``G``.
    ``queries``: the KV head's first query head's base pointer, the token and head strides,
    ``tok0``, the chunk's length, the scale times log2(e)."""
    q_base, stride_qt, stride_qh, tok0, q_len, scale_log2e = queries
    M: gl.constexpr = q_lo.type.shape[0]
    HALF: gl.constexpr = q_lo.type.shape[1]
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, lq))
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, lq))
    tok = tok0 + rows // G
    q_ptr = (q_base + tok[:, None].to(gl.int64) * stride_qt + (rows % G)[:, None] * stride_qh
             + d[None, :])
    q_ok = (tok < q_len)[:, None]
    q_lo.store((gl.load(q_ptr, mask=q_ok, other=0.0).to(gl.float32) * scale_log2e)
               .to(gl.bfloat16))
    q_hi.store((gl.load(q_ptr + HALF, mask=q_ok, other=0.0).to(gl.float32) * scale_log2e)
               .to(gl.bfloat16))


@gluon.jit
def stage_b(b_lo, b_hi, b_row, stride_br, has_res):
    """One of the adapter's ``B`` (row ``b_row``, stride ``stride_br``) into its halves
    ``b_lo, b_hi [r, D/2]``; zero without an adapter."""
    HALF: gl.constexpr = b_lo.type.shape[1]
    R: gl.constexpr = b_lo.type.shape[0]
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, lq))
    k = gl.arange(0, R, layout=gl.SliceLayout(1, lq))
    b_off = k[:, None] * stride_br + d[None, :]
    b_lo.store(gl.load(b_row + b_off, mask=has_res, other=0.0))
    b_hi.store(gl.load(b_row + b_off + HALF, mask=has_res, other=0.0))


@gluon.jit
def _rope_bf16x2(u_lo, u_hi, cos, sin):
    """``u_lo cos - u_hi sin, u_hi cos + u_lo sin`` in packed bf16 pairs (HMUL2 / HFMA2: two
    columns an instruction, cos and sin used as they sit in shared memory, not widened to
    float32): the float32 halves rounded to bf16, then one product and one fused
    multiply-add each, so a value is rounded three times, not once."""
    return gl.inline_asm_elementwise(
        """{ .reg .b32 a, b, t;
        cvt.rn.bf16x2.f32 a, $3, $2;
        cvt.rn.bf16x2.f32 b, $5, $4;
        mul.rn.bf16x2 t, b, $7;
        neg.bf16x2 t, t;
        fma.rn.bf16x2 $0, a, $6, t;
        mul.rn.bf16x2 t, a, $7;
        fma.rn.bf16x2 $1, b, $6, t; }""",
        "=r,=r,r,r,r,r,r,r", [u_lo, u_hi, cos, sin], [gl.bfloat16, gl.bfloat16],
        is_pure=True, pack=2)


@gluon.jit
def _rotated_residual(k_tiles, kr_tile, cs_tiles, bk_lo, bk_hi, u_l: gl.constexpr,
                     WITH_BASE: gl.constexpr, BF16_ROPE: gl.constexpr):
    """``RoPE(K_res B_k)`` of a tile of keys as halves ``[T, D/2]`` in ``u_l`` (plus the base
    tile ``k_tiles = (K_lo, K_hi)`` if ``WITH_BASE``): ``kr_tile`` its ``K_res`` rows,
    ``cs_tiles`` its cos and sin rows, the up-projection in flight while those come from
    shared memory. Float32, or bf16 with ``BF16_ROPE`` (``_rope_bf16x2``; the residual
    alone, never with the base tile)."""
    gl.static_assert(not (WITH_BASE and BF16_ROPE), "bf16 RoPE rounds the residual alone")
    u_lo, u_hi = up_projection(kr_tile, bk_lo, bk_hi, u_l)
    if WITH_BASE:
        k_a = k_tiles[0].load(u_l).to(gl.float32)
        k_b = k_tiles[1].load(u_l).to(gl.float32)
    cos, sin = _cos_sin(cs_tiles, u_l, BF16_ROPE)
    u_lo, u_hi = warpgroup_mma_wait(0, deps=(u_lo, u_hi))
    r_a, r_b = _rope(u_lo, u_hi, cos, sin, BF16_ROPE)
    if WITH_BASE:
        r_a = k_a + r_a
        r_b = k_b + r_b
    return r_a, r_b


@gluon.jit
def up_projection(kr_tile, bk_lo, bk_hi, u_l: gl.constexpr):
    """``K_res B_k`` of a tile's ``K_res`` rows, its halves in flight (the caller waits)."""
    T: gl.constexpr = kr_tile.type.shape[0]
    HALF: gl.constexpr = bk_lo.type.shape[1]
    zero = gl.zeros([T, HALF], gl.float32, u_l)
    u_lo = warpgroup_mma(kr_tile, bk_lo, zero, use_acc=False, is_async=True)
    u_hi = warpgroup_mma(kr_tile, bk_hi, zero, use_acc=False, is_async=True)
    return u_lo, u_hi


@gluon.jit
def _cos_sin(cs_tiles, u_l: gl.constexpr, BF16_ROPE: gl.constexpr):
    """A tile's cos and sin rows in ``u_l``: bf16 for ``_rope_bf16x2``, else float32."""
    cos = cs_tiles[0].load(u_l)
    sin = cs_tiles[1].load(u_l)
    if not BF16_ROPE:
        cos = cos.to(gl.float32)
        sin = sin.to(gl.float32)
    return cos, sin


@gluon.jit
def _rope(u_lo, u_hi, cos, sin, BF16_ROPE: gl.constexpr):
    """The rotation of the up-projection's halves (``_rope_bf16x2`` in bf16 pairs)."""
    if BF16_ROPE:
        r_a, r_b = _rope_bf16x2(u_lo, u_hi, cos, sin)
    else:
        r_a = u_lo * cos - u_hi * sin
        r_b = u_hi * cos + u_lo * sin
    return r_a, r_b


@gluon.jit
def _landed(args, i):
    """Waits for tile ``i``'s slot and zeroes its V rows past the split (stale or never
    written page slots would reach the value products as 0 * NaN). Returns the slot."""
    _, bars, bufs, _, scalars, _ = args
    start, stop, has_res = scalars[3], scalars[4], scalars[7]
    NS: gl.constexpr = bufs[2].type.shape[0]
    T: gl.constexpr = bufs[2].type.shape[1]
    s = i % NS
    mbarrier.wait(bars[0].index(s), (i // NS) & 1)
    n0 = start + i * T
    if n0 + T > stop:
        _zero_values_from(bufs, s, stop - n0, has_res)
    return s


@gluon.jit
def _prepare(args, i, BASE_SCORES: gl.constexpr, BF16_ROPE: gl.constexpr):
    """Waits for tile ``i``'s slot and makes it ready for its products: the V rows past the
    split zeroed (stale or never written page slots would reach the value products as 0 *
    NaN), the whole key ``K_base + RoPE(K_res B_k)`` (the base tile alone without an
    adapter) written bf16 into ``rot``; with ``BASE_SCORES`` the rotated residual alone
    (nothing without an adapter: ``rot`` stays zero). Only synchronous products: nothing in
    flight crosses its branches."""
    _, _, bufs, ops, scalars, _ = args
    k_lo, k_hi = bufs[0], bufs[1]
    bk_lo, bk_hi, rot_lo, rot_hi = ops[2], ops[3], ops[6], ops[7]
    has_res = scalars[7]
    HALF: gl.constexpr = k_lo.type.shape[2]
    s = _landed(args, i)
    u_l: gl.constexpr = rebuild_layout(HALF, gl.num_warps())
    if has_res:
        k_a, k_b = _rotated_residual((k_lo.index(s), k_hi.index(s)), bufs[4].index(s),
                                    (bufs[6].index(s), bufs[7].index(s)), bk_lo, bk_hi, u_l,
                                    not BASE_SCORES, BF16_ROPE)
        rot_lo.store(k_a.to(gl.bfloat16))
        rot_hi.store(k_b.to(gl.bfloat16))
    elif not BASE_SCORES:
        rot_lo.store(k_lo.index(s).load(u_l))
        rot_hi.store(k_hi.index(s).load(u_l))
    fence_async_shared()


@gluon.jit
def _issue_scores(ops, bufs, s, acc_l: gl.constexpr, BASE_SCORES: gl.constexpr):
    """The scores ``Q K^T`` of the key tile in ``rot`` (plus, with ``BASE_SCORES``, of the
    base tile in slot ``s``), in flight (the caller waits)."""
    q_lo, q_hi, rot_lo, rot_hi = ops[0], ops[1], ops[6], ops[7]
    M: gl.constexpr = q_lo.type.shape[0]
    T: gl.constexpr = rot_lo.type.shape[0]
    zero = gl.zeros([M, T], gl.float32, acc_l)
    sc = warpgroup_mma(q_lo, rot_lo.permute((1, 0)), zero, use_acc=False, is_async=True)
    sc = warpgroup_mma(q_hi, rot_hi.permute((1, 0)), sc, is_async=True)
    if BASE_SCORES:
        sc = warpgroup_mma(q_lo, bufs[0].index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma(q_hi, bufs[1].index(s).permute((1, 0)), sc, is_async=True)
    return sc


@gluon.jit
def mask_scores(sc, n0, stop, pos, cols):
    """Scores of keys ``n0 + cols`` past ``stop`` or past a row's position ``pos`` set to
    -inf."""
    key = n0 + cols
    visible = (gl.expand_dims(key < stop, 0)
               & (gl.expand_dims(key, 0) <= gl.expand_dims(pos, 1)))
    return gl.where(visible, sc, float("-inf"))


@gluon.jit
def _row_max(x):
    """``max(x, axis=1)`` of a score tile as a tree inside each thread, not one in-order
    chain: a thread's columns of a row are ``8 n + 2 lane + pair`` (the wgmma accumulator),
    reduced over the pair, then n in two levels, then over the quad's lanes."""
    M: gl.constexpr = x.type.shape[0]
    T: gl.constexpr = x.type.shape[1]
    x5 = gl.reshape(x, [M, 2, T // 16, 4, 2])
    return gl.max(gl.max(gl.max(gl.max(x5, axis=4), axis=2), axis=1), axis=1)


@gluon.jit
def _row_sum(x):
    """``sum(x, axis=1)`` as ``_row_max``'s tree."""
    M: gl.constexpr = x.type.shape[0]
    T: gl.constexpr = x.type.shape[1]
    x5 = gl.reshape(x, [M, 2, T // 16, 4, 2])
    return gl.sum(gl.sum(gl.sum(gl.sum(x5, axis=4), axis=2), axis=1), axis=1)


@gluon.jit
def online_softmax(sc, state):
    """Tile's probabilities (bf16) from its masked scores, and the running state with them:
    ``m``, ``l`` (in the scores' row layout), and ``O``, ``P V_res`` rescaled to the new
    max."""
    m_i, l_i, o_lo, o_hi, acc_r = state
    r_l: gl.constexpr = acc_r.type.layout
    m_new = gl.maximum(m_i, gl.convert_layout(_row_max(sc), m_i.type.layout))
    # A row with no visible key yet keeps m = -inf: exp2 of (-inf) - (-inf) guarded.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sc - gl.expand_dims(m_safe, 1))
    l_i = l_i * alpha + gl.convert_layout(_row_sum(p), l_i.type.layout)
    # The scores' rows and O's sit alike in the threads whatever the tiles' N (the wgmma
    # accumulator): no data moves.
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_lo.type.layout))
    o_lo = o_lo * gl.expand_dims(alpha_o, 1)
    o_hi = o_hi * gl.expand_dims(alpha_o, 1)
    acc_r = acc_r * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, r_l)), 1)
    return p.to(gl.bfloat16), (m_new, l_i, o_lo, o_hi, acc_r)


@gluon.jit
def value_products(bufs, p16, s, state):
    """``P V_base`` and ``P V_res`` of slot ``s``'s tile added to the state's accumulators,
    in flight (the caller waits). Unconditional: without an adapter the slot's ``V_res``
    rows are stale bytes, and ``P V_res`` is then never read."""
    m_i, l_i, o_lo, o_hi, acc_r = state
    acc_l: gl.constexpr = o_lo.type.layout
    r_l: gl.constexpr = acc_r.type.layout
    pa = gl.convert_layout(p16, gl.DotOperandLayout(0, acc_l, 2))
    o_lo = warpgroup_mma(pa, bufs[2].index(s), o_lo, is_async=True)
    o_hi = warpgroup_mma(pa, bufs[3].index(s), o_hi, is_async=True)
    acc_r = warpgroup_mma(gl.convert_layout(p16, gl.DotOperandLayout(0, r_l, 2)),
                          bufs[5].index(s), acc_r, is_async=True)
    return m_i, l_i, o_lo, o_hi, acc_r


@gluon.jit
def _tile(args, i, sc, state, rows, EDGE_MASKS: gl.constexpr, BASE_SCORES: gl.constexpr,
          BF16_ROPE: gl.constexpr):
    """Tile ``i`` of the program's keys, whose scores ``sc`` have landed: tile ``i + 1``'s
    key rebuilt and its score products issued first, so they run under this tile's softmax
    (``rot`` is free then); the value products; the slot released. ``rows``: each score
    row's position, the score columns, the keys every row sees. Returns tile ``i + 1``'s
    scores and the updated state."""
    _, _, bufs, ops, scalars, _ = args
    start, stop, n_tiles = scalars[3], scalars[4], scalars[6]
    pos, cols, seen_by_all = rows
    NS: gl.constexpr = bufs[2].type.shape[0]
    T: gl.constexpr = bufs[2].type.shape[1]
    acc_l: gl.constexpr = state[2].type.layout
    if EDGE_MASKS:
        # Here, with nothing in flight, so the branch may hold the mask.
        if start + (i + 1) * T > seen_by_all:
            sc = mask_scores(sc, start + i * T, stop, pos, cols)
    if i + 1 < n_tiles:
        _prepare(args, i + 1, BASE_SCORES, BF16_ROPE)
    # Unconditional, so nothing in flight crosses a branch: after the last tile these
    # products score its key (and a released slot no tile refills) again, and their
    # result is dropped.
    sc_next = _issue_scores(ops, bufs, (i + 1) % NS, acc_l, BASE_SCORES)
    if not EDGE_MASKS:
        sc = mask_scores(sc, start + i * T, stop, pos, cols)
    p16, state = online_softmax(sc, state)
    m_i, l_i, o_lo, o_hi, acc_r = value_products(bufs, p16, i % NS, state)
    # One wait for the value products and the next tile's scores.
    o_lo, o_hi, acc_r, sc_next = warpgroup_mma_wait(0, deps=(o_lo, o_hi, acc_r, sc_next))
    _release(args, i)
    return sc_next, (m_i, l_i, o_lo, o_hi, acc_r)


@gluon.jit
def _consume(args, G: gl.constexpr, EDGE_MASKS: gl.constexpr, BASE_SCORES: gl.constexpr,
             BF16_ROPE: gl.constexpr):
    """The consumer warp group(s) at the GQA group ``G``: every tile of the program's keys
    (``_tile``). Returns ``m, l [rows]`` (log2 domain) and ``o_lo, o_hi [rows, D/2]``, ``P
    V_base + (P V_res) B_v`` unnormalised."""
    _, bars, bufs, ops, scalars, operands = args
    kr = bufs[4]
    q_lo, bv_lo, bv_hi = ops[0], ops[4], ops[5]
    stop, n_tiles, has_res = scalars[4], scalars[6], scalars[7]
    q_pos0 = operands[10]  # the position of the program's first token
    T: gl.constexpr = kr.type.shape[1]
    HALF: gl.constexpr = bufs[0].type.shape[2]
    R: gl.constexpr = kr.type.shape[2]
    M: gl.constexpr = q_lo.type.shape[0]
    nw: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = wgmma_layout(HALF, nw)  # [M, 64]: scores, and each half of O
    r_l: gl.constexpr = wgmma_layout(R, nw)  # [M, r]: P V_res
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    state = (gl.full([M], float("-inf"), gl.float32, row_l),
             gl.full([M], 0.0, gl.float32, row_l), gl.zeros([M, HALF], gl.float32, acc_l),
             gl.zeros([M, HALF], gl.float32, acc_l), gl.zeros([M, R], gl.float32, r_l))
    sc = gl.zeros([M, T], gl.float32, acc_l)
    if n_tiles > 0:  # an empty program makes no operands
        # After the loader's first tile lands: a worker reads its arguments from shared
        # memory at its start, in bytes this partition's layout conversions may reuse
        # (Triton 3.6; docs/KERNELS.md "Round 20").
        mbarrier.wait(bars[0].index(0), 0)
        _stage_operands(operands, ops, G)
        if BASE_SCORES:  # what a tile without an adapter adds to its base scores
            zero_rot = gl.zeros([T, HALF], gl.bfloat16, rebuild_layout(HALF, nw))
            ops[6].store(zero_rot)
            ops[7].store(zero_rot)
        fence_async_shared()
        _prepare(args, 0, BASE_SCORES, BF16_ROPE)
        sc = warpgroup_mma_wait(0, deps=(_issue_scores(ops, bufs, 0, acc_l, BASE_SCORES), ))
    rows = (q_pos0 + gl.arange(0, M, layout=row_l) // G,
            gl.arange(0, T, layout=gl.SliceLayout(0, acc_l)),
            gl.minimum(stop, q_pos0 + 1))  # the keys every row of the program sees
    for i in range(n_tiles):
        sc, state = _tile(args, i, sc, state, rows, EDGE_MASKS, BASE_SCORES, BF16_ROPE)
    m_i, l_i, o_lo, o_hi, acc_r = state
    if has_res & (n_tiles > 0):
        o_lo, o_hi = apply_b_v(o_lo, o_hi, acc_r, bv_lo, bv_hi)
    return m_i, l_i, o_lo, o_hi


@gluon.jit
def apply_b_v(o_lo, o_hi, acc_r, bv_lo, bv_hi):
    """``O + (P V_res) B_v``, once after the loop, ``P V_res`` in two bf16 parts so the sum
    keeps float32's precision."""
    acc_l: gl.constexpr = o_lo.type.layout
    r_hi = acc_r.to(gl.bfloat16)
    r_lo = (acc_r - r_hi.to(gl.float32)).to(gl.bfloat16)
    p_op: gl.constexpr = gl.DotOperandLayout(0, acc_l, 2)
    a_hi = gl.convert_layout(r_hi, p_op)
    a_lo = gl.convert_layout(r_lo, p_op)
    o_lo = warpgroup_mma(a_hi, bv_lo, o_lo)
    o_lo = warpgroup_mma(a_lo, bv_lo, o_lo)
    o_hi = warpgroup_mma(a_hi, bv_hi, o_hi)
    o_hi = warpgroup_mma(a_lo, bv_hi, o_hi)
    return o_lo, o_hi


@gluon.jit
def store_rows(o_lo, o_hi, m_i, l_i, rows, outs, G: gl.constexpr, DIRECT: gl.constexpr):
    """A program's rows ``rows`` (token ``tok0 + row // G``, head ``head0 + row % G``) out:
    ``O / l`` to ``Out`` (``DIRECT``), else the unnormalised ``O`` and the log2-domain
    log-sum-exp to its split's partials (``merge_partials``). ``outs``: the output tensors,
    their strides, the sequence's first new token and its chunk length, ``tok0``, ``head0``,
    the split and the program's tile count."""
    Out, PartOut, PartLse, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, \
        stride_lh, q_begin, q_len, tok0, head0, split, n_tiles = outs
    acc_l: gl.constexpr = o_lo.type.layout
    HALF: gl.constexpr = o_lo.type.shape[1]
    m_i = gl.convert_layout(m_i, rows.type.layout)
    l_i = gl.convert_layout(l_i, rows.type.layout)
    d = gl.arange(0, HALF, layout=gl.SliceLayout(0, acc_l))
    tok = tok0 + rows // G
    row_ok = gl.expand_dims(tok < q_len, 1)
    t_idx = gl.expand_dims((q_begin + tok).to(gl.int64), 1)
    h_idx = gl.expand_dims(head0 + rows % G, 1)
    l_safe = gl.expand_dims(gl.where(l_i > 0, l_i, 1.0), 1)
    o_lo = o_lo / l_safe
    o_hi = o_hi / l_safe
    if DIRECT:
        o_ptr = Out + t_idx * stride_ot + h_idx * stride_oh + gl.expand_dims(d, 0)
        gl.store(o_ptr, o_lo.to(Out.dtype.element_ty), mask=row_ok)
        gl.store(o_ptr + HALF, o_hi.to(Out.dtype.element_ty), mask=row_ok)
    else:
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(PartLse + (q_begin + tok).to(gl.int64) * stride_lt + (head0 + rows % G)
                 * stride_lh + split, lse, mask=tok < q_len)
        if n_tiles > 0:
            p_ptr = (PartOut + t_idx * stride_pt + h_idx * stride_ph + split * stride_ps
                     + gl.expand_dims(d, 0))
            gl.store(p_ptr, o_lo, mask=row_ok)
            gl.store(p_ptr + HALF, o_hi, mask=row_ok)


@gluon.jit
def program_keys(CuSeqlensQ, SeqLens, m_blocks, N_KV: gl.constexpr, TOKENS: gl.constexpr,
                 T: gl.constexpr):
    """This program's place in the grid ``(batch * n_kv * m_blocks, splits)`` and its keys:
    the sequence ``b``, KV head, split; the sequence's first new token ``q_begin``, chunk
    length, length and context (keys before the chunk); ``tok0``, the first of the
    ``TOKENS`` chunk tokens it holds; its split ``[start, stop)`` of the keys its last token
    sees (splits of whole ``T``-key tiles) and their tile count."""
    pid = gl.program_id(0)
    split = gl.program_id(1)
    mb = pid % m_blocks
    head = (pid // m_blocks) % N_KV
    b = pid // (m_blocks * N_KV)
    q_begin = gl.load(CuSeqlensQ + b)
    q_len = gl.load(CuSeqlensQ + b + 1) - q_begin
    seq_len = gl.load(SeqLens + b)
    ctx = seq_len - q_len  # keys before the first new token
    tok0 = mb * TOKENS
    # Causal: the block's last token sees keys [0, ctx + its index + 1).
    kv_end = gl.where(tok0 < q_len, ctx + gl.minimum(q_len, tok0 + TOKENS), 0)
    key_split = gl.cdiv(gl.cdiv(kv_end, gl.num_programs(1)), T) * T
    start = split * key_split
    stop = gl.minimum(start + key_split, kv_end)
    n_tiles = gl.cdiv(gl.maximum(stop - start, 0), T)
    return b, head, split, q_begin, q_len, seq_len, ctx, tok0, start, stop, n_tiles


@gluon.jit
def _residual_prefill_ws_kernel(
        kd, vd, krd, vrd, csd, Q, BK, BV, Adapter, BlockTables, ResTables, SeqLens, CuSeqlensQ,
        Out, PartOut, PartLse, scale_log2e, m_blocks,
        stride_qt, stride_qh, stride_bt, stride_rbt, stride_ba, stride_br,
        stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        N_KV: gl.constexpr, G: gl.constexpr, R: gl.constexpr, HEAD_DIM: gl.constexpr,
        T: gl.constexpr, M: gl.constexpr, STAGES_: gl.constexpr, EDGE_MASKS: gl.constexpr,
        BASE_SCORES: gl.constexpr, BF16_ROPE: gl.constexpr, DIRECT: gl.constexpr,
        num_warps: gl.constexpr):
    HALF: gl.constexpr = HEAD_DIM // 2
    b, head, split, q_begin, q_len, seq_len, ctx, tok0, start, stop, n_tiles = program_keys(
        CuSeqlensQ, SeqLens, m_blocks, N_KV, M // G, T)
    adapter = gl.load(Adapter + b)
    has_res = adapter >= 0

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HALF], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, HALF], gl.bfloat16)
    q_lo = gl.allocate_shared_memory(gl.bfloat16, [M, HALF], q_layout)
    q_hi = gl.allocate_shared_memory(gl.bfloat16, [M, HALF], q_layout)
    bk_lo = gl.allocate_shared_memory(gl.bfloat16, [R, HALF], b_layout)
    bk_hi = gl.allocate_shared_memory(gl.bfloat16, [R, HALF], b_layout)
    bv_lo = gl.allocate_shared_memory(gl.bfloat16, [R, HALF], b_layout)
    bv_hi = gl.allocate_shared_memory(gl.bfloat16, [R, HALF], b_layout)
    rot_lo = gl.allocate_shared_memory(gl.bfloat16, [T, HALF], kd.layout)
    rot_hi = gl.allocate_shared_memory(gl.bfloat16, [T, HALF], kd.layout)

    slots, bars = slot_ring(kd, krd, csd, STAGES_, T)
    fence_async_shared()
    a_row = gl.maximum(adapter, 0) * stride_ba + head * HEAD_DIM
    operands = (Q + q_begin.to(gl.int64) * stride_qt + head * G * stride_qh, stride_qt,
                stride_qh, tok0, q_len, BK + a_row, BV + a_row, stride_br, scale_log2e,
                has_res, ctx + tok0)
    # One tuple for both partitions, in the decode loader's order (its ``_loader`` serves
    # here unchanged): descriptors, barriers, slots, this kernel's own buffers, the
    # program's integers, what _stage_operands reads.
    args = ((kd, vd, krd, vrd, csd), bars, slots,
            (q_lo, q_hi, bk_lo, bk_hi, bv_lo, bv_hi, rot_lo, rot_hi),
            (BlockTables + b * stride_bt, ResTables + b * stride_rbt, head * HEAD_DIM,
             start, stop, seq_len, n_tiles, has_res), operands)
    m_i, l_i, o_lo, o_hi = gl.warp_specialize(
        [(_consume, (args, G, EDGE_MASKS, BASE_SCORES, BF16_ROPE)), (_loader, (args, ))],
        [1], [40])

    rows = gl.arange(0, M, layout=gl.SliceLayout(1, o_lo.type.layout))
    outs = (Out, PartOut, PartLse, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
            stride_lt, stride_lh, q_begin, q_len, tok0, head * G, split, n_tiles)
    store_rows(o_lo, o_hi, m_i, l_i, rows, outs, G, DIRECT)


def build_sm90a(launch: WsPrefillLaunch, direct: bool, group: int = 4) -> tuple[str, int]:
    """The kernel's PTX for sm_90a and its shared memory in bytes at ``launch`` (output
    written directly, or as partials), built without a GPU at ``sm90_build.WS_SHAPE`` with
    this GQA group."""
    from forkserve.kernels.sm90_build import compile_ws_sm90

    return compile_ws_sm90(_residual_prefill_ws_kernel,
                           dict(T=TILE, DIRECT=direct, G=group, **launch.constexprs()),
                           launch.maxnreg,
                           {"CuSeqlensQ": torch.empty(8, dtype=torch.int32)})


def residual_prefill_ws(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                        k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                        res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, b_k_all: torch.Tensor,
                        b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                        inv_freq: torch.Tensor, scale: float | None = None,
                        max_q_len: int | None = None, max_seq_len: int | None = None,
                        num_splits: int | None = None,
                        launch: WsPrefillLaunch | WideLaunch | None = None) -> torch.Tensor:
    """ResidualAttention varlen causal prefill of ``q [total_new, H, D]`` over the
    disaggregated cache (prefill_attention.py's contract: each sequence's new tokens are its
    last ``q_len`` positions, their rows already in the pools); the shapes of ``supports``
    only. ``max_q_len`` / ``max_seq_len`` spare a host sync each when the caller knows them.
    A ``WideLaunch`` runs residual_prefill_wide.py's kernel (128-key tiles)."""
    from forkserve.kernels.residual_prefill_wide import WideLaunch, run_wide

    check_inputs("residual_prefill_ws", q, k_base, k_res, b_k_all, b_v_all)
    max_q_len, max_seq_len = host_bounds(seq_lens, cu_seqlens_q, max_q_len, max_seq_len)
    launch = default_launch(max_q_len, q.shape[1] // k_base.shape[2]) if launch is None \
        else launch
    args = (q, k_base, v_base, k_res, v_res, block_tables, res_block_tables, seq_lens,
            cu_seqlens_q, b_k_all, b_v_all, adapter_idx, inv_freq)
    if isinstance(launch, WideLaunch):
        return run_wide(launch, args, scale, max_q_len, max_seq_len, num_splits)
    return run_prefill_kernel(_residual_prefill_ws_kernel, TILE, launch.rows,
                              dict(maxnreg=launch.maxnreg, **launch.constexprs()), args, scale,
                              max_q_len, max_seq_len, num_splits)


def check_inputs(name: str, q: torch.Tensor, k_base: torch.Tensor, k_res: torch.Tensor,
                 b_k_all: torch.Tensor, b_v_all: torch.Tensor) -> None:
    """``ValueError`` naming the entry point ``name`` where the ws prefill kernels do not
    take these tensors (``supports``; ``B_k`` and ``B_v`` share one pair of strides)."""
    if not supports(q, k_base, k_res):
        raise ValueError(f"{name}: 16-key pages, head_dim 128, a GQA group of 1, 2, 4 or 8, "
                         "rank 16, bf16 on an sm_90 GPU")
    if b_k_all.stride() != b_v_all.stride():
        raise ValueError(f"{name}: B_k and B_v stacked alike (one pair of strides)")


def host_bounds(seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int | None,
                max_seq_len: int | None) -> tuple[int, int]:
    """The batch's longest chunk and sequence, read back (a host sync each) where the caller
    did not pass them."""
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    return max_q_len, max_seq_len


def run_prefill_kernel(kernel, tile: int, rows: int, options: dict, args: tuple,
                       scale: float | None, max_q_len: int, max_seq_len: int,
                       num_splits: int | None, takes_table: bool = False) -> torch.Tensor:
    """One launch of a ws prefill kernel (``_residual_prefill_ws_kernel`` or the 128-key
    one), their arguments alike: the RoPE table and the TMA descriptors, a program a KV head
    and ``rows`` query rows, the dynamic split plan over ``tile``-key tiles, the output
    written directly at one split, else merged from the partials. ``args``:
    ``residual_prefill_ws``'s tensors, checked (``check_inputs``); ``options``: the
    kernel's launch options and constexprs; ``takes_table``: the kernel also reads the bf16
    table by pointer (``CS``, its rows ``cs_rows``), not only through its descriptor."""
    q, k_base, v_base, k_res, v_res, block_tables, res_block_tables, seq_lens, cu_seqlens_q, \
        b_k_all, b_v_all, adapter_idx, inv_freq = args
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv, rank = k_base.shape[2], k_res.shape[2]
    g = n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    bound = max(max_seq_len, 1)
    table16 = rope_table_in(cached_rope_table(inv_freq, bound), q.dtype).view(-1, head_dim)
    kd, vd, krd, vrd, csd = descriptors(k_base, v_base, k_res, v_res, table16)
    m_blocks = max(1, -(-max_q_len * g // rows))
    programs = seq_lens.numel() * n_kv * m_blocks
    splits = dynamic_splits(programs, bound, sm_count(q.device), tile, num_splits,
                            programs_per_sm=1)
    out = torch.empty_like(q)
    part_out, part_lse = empty_partials(q, splits) if splits > 1 else (out, out[:, :, 0])
    direct = splits == 1
    if takes_table:
        # The kernel clamps its reads by whole 64-row blocks (``residual_prefill_wide``).
        assert table16.shape[0] % 64 == 0, "the RoPE table grows by doubling from 32K rows"
        options = options | dict(CS=table16, cs_rows=table16.shape[0])
    kernel[(programs, splits)](
        kd, vd, krd, vrd, csd, q, b_k_all, b_v_all, adapter_idx, block_tables,
        res_block_tables, seq_lens, cu_seqlens_q, out, part_out, part_lse, scale * LOG2E,
        m_blocks, q.stride(0), q.stride(1), block_tables.stride(0), res_block_tables.stride(0),
        b_k_all.stride(0), b_k_all.stride(1), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if not direct else 0,
        part_lse.stride(0), part_lse.stride(1),
        N_KV=n_kv, G=g, R=rank, HEAD_DIM=head_dim, T=tile, DIRECT=direct, **options)
    if direct:
        return out
    return merge_partials(part_out, part_lse, out, splits)
