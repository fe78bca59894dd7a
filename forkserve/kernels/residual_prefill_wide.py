"""ResidualAttention prefill over 128-key tiles, the key rebuilt by a warp group of its own
(Gluon, Hopper; the ``wide`` launch of the ``ws`` route, its default at GQA 4: measured
1.29x FlashAttention-4's paged read at 8 x 64 over 8K on an H100, where the ws kernel ran
1.74x; docs/KERNELS.md "Round 31, measured").

The ``ws`` kernel (residual_prefill_gluon.py) runs 64-key tiles on two consumer warp groups
in lockstep, each rebuilding its half of every key into a shared tile before its scores: on
the H200 it ran 1.82x FlashAttention-4 at 8 chunks of 64 tokens over 8K keys, its consumers
instruction-bound at 2.37x FA4's warp instructions (docs/KERNELS.md "Round 28": the
rebuild, the per-tile fixed costs of 64-key tiles, the lockstep). Here the roles are four
(``gl.warp_specialize``), each tile handed on by mbarriers (tests/kernels/test_wide_protocol.py
models the protocol):

* the **loader** (one warp) gathers each 128-key tile by TMA into one of two slots: its
  keys (``K_base`` halves, ``K_res`` rows) once both consumers have scored the tile that was
  there, its cos|sin rows into two 64-key buffers of their own once the rebuild of the tile
  before is done with each, its values (``V_base`` halves, ``V_res`` rows) once both
  consumers have that tile's value products. One warp: a TMA copy issued from a warp group
  waits on a barrier of the whole group each (50 a tile);
* the **rebuilding warp group** (the default partition) turns each landed key into the
  whole key **in place**, ``K_base + RoPE(K_res B_k)`` written over the slot's base key by
  64 keys and ``chunk`` column pairs at a time (a thread keeps 72 registers beside two
  consumers, 232 beside one), in float32 or packed bf16 pairs (``bf16_rope``); zeroes a
  split's last tile's stale value rows; and hands the tile to the consumers once its values
  have landed too. Rows without an adapter pass through;
* two **consumers** (one warp group each, 64 query rows each; or one, ``consumers=1``, for
  chunks whose rows fill 64) take every ready tile: the scores ``Q K^T`` as one N = 128
  product, the slot's keys released as soon as they land (the next key gather starts under
  this tile's softmax and value products), the online softmax, ``P V_base`` and ``P
  V_res``, the values released. Each consumer runs at its own pace over the same slots, so
  one's softmax may run under the other's products; each writes its own rows.

So a consumer's tile is FlashAttention's over twice the keys of the ``ws`` kernel's, with
nothing of the residual in it but the ``P V_res`` product; ``B_v`` is applied once after the
loop. Shared memory: two slots of 72 KiB, the cos|sin halves 32, Q 32 (16 with one
consumer), ``B_v`` 4, ``B_k``'s chunks 4 (~217 KiB, one program per SM).

Grid, split plan, shapes and host launch are the ``ws`` kernel's (``ws_prefill_shape``,
``run_prefill_kernel``), 64 or 128 query rows a program; a split's keys are whole 128-key
tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from forkserve.kernels.residual_decode_gluon import (
    _zero_values_from,
    wgmma_layout,
)
from forkserve.kernels.residual_prefill_gluon import (
    apply_b_v,
    check_inputs,
    host_bounds,
    mask_scores,
    online_softmax,
    program_keys,
    run_prefill_kernel,
    stage_b,
    stage_queries,
    store_rows,
    up_projection,
    value_products,
)

TILE = 128  # keys a tile: the score product's N
VALUE_SLOTS = gl.constexpr(2)  # 36 KiB each: a third does not fit beside three key slots
KEY_HALF = gl.constexpr(64)  # keys a cos|sin buffer (the table's TMA box) and a rebuild pass
ROW_GROUP = gl.constexpr(16)  # rows a warp holds of the up-projection's wgmma layout
WG_ROWS = gl.constexpr(64)  # query rows a consumer warp group: one wgmma M
LOADER_REGS = gl.constexpr(40)  # the loader warp's (as the ws kernels')


@dataclass(frozen=True)
class WideLaunch:
    """The launch: ``consumers``, the consumer warp groups (1 or 2: a program's query rows
    64 or 128; one for chunks whose rows fill 64, as the ws kernel's 64-row launch);
    ``consumer_regs``, the registers each consumer thread takes by ``setmaxnreg`` (the
    rebuilding warp group keeps what the consumers and the loader leave of the SM's 64K,
    Triton keeping a margin, at most 256); ``chunk``, the columns of each key half it
    rebuilds at a time (its registers: the up-projection of 64 keys by ``chunk`` pairs);
    ``bf16_rope``: that rebuild in packed bf16 pairs, the base key added there too
    (``_rope_plus_base_bf16x2``), not in float32; ``pingpong``: the consumers issue their
    score products in turns (FlashAttention-3's warp-group ping-pong, by a pair of
    mbarriers: one's softmax then runs under the other's products; two consumers only), not
    each as soon as its tile is ready; ``overlap``: a consumer issues the next tile's score
    products before this tile's softmax (one consumer only: two score tiles in registers);
    ``thread_arrive``: the arrivals that release a buffer (a slot's keys or values, a cos|sin
    half, a ping-pong turn) are made by every thread of the warp group on its own, the
    barrier counting threads (``_release``), not by one thread after a barrier of the group;
    ``early_loads``: the rebuild reads a chunk's cos|sin and base key columns from shared
    memory before it waits on the chunk's up-projection, so the reads' latency passes under
    the wait, not after it (round 31's profile: the rebuild set the pace, never waiting on a
    copy, and its packed multiply-adds stalled most on those reads; docs/KERNELS.md "Round
    32"); ``defer_stores``: the rebuild holds a half's rebuilt chunks in registers and
    writes them after the half's last chunk, so no chunk's reads wait on a barrier behind
    the chunk before's writes (Triton's, which tracks a buffer, not a view: 12 barriers a
    tile, not 18) at the cost of the held chunks' registers (a chunk narrower than a half
    only; docs/KERNELS.md "Round 33"); ``half_ahead``: the rebuild issues the next key
    half's first up-projection at the last chunk of this one, not at the next half's
    start, so its latency passes under this half's last rotation and writes (round 31's
    profile: the rebuild's second stall was its waits on the up-projection; docs/KERNELS.md
    "Round 34"); ``join``: the rebuild writes its held chunks ``join`` at a time, their
    columns set side by side in registers (``_joined``), one store a buffer, not chunk by
    chunk, so fewer of Triton's barriers between writes to one buffer remain (2: 8 a tile,
    4: a half at once, 6 a tile; 1: 12; round 35's profile: the rebuild sets the pace, and
    waits most at barriers); ``cs_global``: the rebuild reads each chunk's cos|sin rows from
    the table in global memory (L2: every program reads the same rows) into registers, a
    chunk ahead of its use, so the loader copies none and their 32 KiB of shared memory and
    barriers go (round 38's probe: neither the loader nor the rebuild sets the pace alone,
    and a third key slot has no room beside the cos|sin buffers; docs/KERNELS.md "Round
    38"); ``key_slots``: 2, or 3 (``cs_global`` only, in the room it makes: 225,928 bytes of
    232,448): the deep key ring, where the loader issues a tile's keys before the values of
    the tile before and the rebuild hands keys over alone, never waiting on values but the
    last tile's (which it zeroes), so it may run two tiles ahead of the consumers, not one
    (``_load_keys_ahead``, ``_rebuild``). Measured (round 39, docs/KERNELS.md): with no
    cos|sin traffic at all (a probe) the deep ring runs 0.92-0.94x the default launch; with
    ``cs_global``'s reads both run 1.2-1.7x it (an L2 read's latency at every chunk), so
    neither is adopted: the deep ring waits on a cheaper cos|sin source. ``angle_add``
    (``cs_global`` only) is that source: the rebuild makes each chunk's cos|sin from two
    small tables in shared memory, ``cos((b + i) f) = cos(b f) cos(i f) - sin(b f) sin(i
    f)`` in packed bf16 pairs (``_angle_cs``): ``i f`` the table's first 16 rows (a row
    within a warp's 16 of the up-projection's layout; 4 KiB, staged once), ``b f`` each
    warp's first row of a half (4 rows a half, 2 KiB for both), the next tile's read from
    global memory at a half's start and stored at its end, so no read waits on L2. Measured
    (round 40, docs/KERNELS.md): 1.02-1.22x the default launch, the cheapest source yet but
    not adopted; the addition doubles the rebuild's packed-pair math, and the rebuild then
    sets the pace."""

    consumers: int = 2
    consumer_regs: int = 200
    chunk: int = 16
    bf16_rope: bool = False
    pingpong: bool = False
    overlap: bool = False
    thread_arrive: bool = False
    early_loads: bool = False
    defer_stores: bool = False
    half_ahead: bool = False
    join: int = 1
    cs_global: bool = False
    key_slots: int = 2
    angle_add: bool = False

    def __post_init__(self) -> None:
        if self.consumers not in (1, 2) or (self.pingpong and self.consumers != 2):
            raise ValueError("WideLaunch: one consumer warp group or two; pingpong takes two")
        if self.overlap and self.consumers != 1:
            raise ValueError("WideLaunch: overlap holds two score tiles a consumer thread, "
                             "which only one consumer's registers have room for")
        if self.chunk not in (8, 16, 32, 64):
            raise ValueError("WideLaunch: chunk is a wgmma N that divides a key half's 64 "
                             "columns: 8, 16, 32 or 64")
        if self.join != 1 and not (self.defer_stores and self.join in (2, 4)
                                   and self.join * self.chunk <= 64):
            raise ValueError("WideLaunch: join writes the chunks defer_stores holds, 2 or 4 "
                             "at a time, within a key half's 64 columns")
        if self.defer_stores and self.chunk == 64:
            raise ValueError("WideLaunch: defer_stores holds a half's chunks until its last; "
                             "at chunk 64 a half is one chunk")
        if self.key_slots not in (2, 3) or (self.key_slots == 3 and not self.cs_global):
            raise ValueError("WideLaunch: key_slots is 2, or 3 with cs_global (a third key "
                             "slot fits only where the cos|sin buffers are gone)")
        if self.angle_add and not self.cs_global:
            raise ValueError("WideLaunch: angle_add makes the cos|sin cs_global would read, "
                             "in the room their buffers leave")

    @property
    def name(self) -> str:
        """``wide_m<rows>_r<regs>_c<chunk>`` and its options (``_bf16``, ``_pp``, ``_ov``,
        ``_ta``, ``_el``, ``_ds``, ``_ha``, ``_j<join>``, ``_cg``, ``_k3``, ``_aa``), as the bench
        reports it."""
        return (f"wide_m{self.rows}_r{self.consumer_regs}_c{self.chunk}"
                + ("_bf16" if self.bf16_rope else "") + ("_pp" if self.pingpong else "")
                + ("_ov" if self.overlap else "") + ("_ta" if self.thread_arrive else "")
                + ("_el" if self.early_loads else "") + ("_ds" if self.defer_stores else "")
                + ("_ha" if self.half_ahead else "") + (f"_j{self.join}" if self.join > 1 else "")
                + ("_cg" if self.cs_global else "") + ("_k3" if self.key_slots == 3 else "")
                + ("_aa" if self.angle_add else ""))

    @property
    def rows(self) -> int:
        """Query rows a program."""
        return 64 * self.consumers

    @property
    def maxnreg(self) -> int:
        """Registers a thread starts with: every warp group (the loader's warp padded to
        one) within the SM's 64K."""
        return 65536 // ((2 + self.consumers) * 128) // 8 * 8

    def constexprs(self) -> dict:
        """The kernel's compile-time arguments for this launch."""
        return dict(CONSUMERS=self.consumers, CONSUMER_REGS=self.consumer_regs,
                    CHUNK=self.chunk, BF16_ROPE=self.bf16_rope, PINGPONG=self.pingpong,
                    OVERLAP=self.overlap, THREAD_ARRIVE=self.thread_arrive,
                    EARLY_LOADS=self.early_loads, DEFER_STORES=self.defer_stores,
                    HALF_AHEAD=self.half_ahead, JOIN=self.join, CS_GLOBAL=self.cs_global,
                    KEY_SLOTS=self.key_slots, ANGLE_ADD=self.angle_add)


@gluon.jit
def _ring(kd, krd, csd, KS: gl.constexpr, VS: gl.constexpr, T: gl.constexpr, C: gl.constexpr,
          THREAD_ARRIVE: gl.constexpr, CS_GLOBAL: gl.constexpr, ANGLE_ADD: gl.constexpr):
    """The slots and their barriers: ``KS`` key slots of a ``T``-key tile (``K_base`` halves,
    ``K_res`` rows) and ``VS`` value slots (``V_base`` halves, ``V_res`` rows), and, unless
    ``CS_GLOBAL``, two cos|sin buffers of ``KEY_HALF`` keys, one per half tile. Barriers: each
    slot's keys and values landed (TMA), its key handed over (the rebuilding warp group:
    with the tile's values in the two-slot ring, alone in the deep one), its keys and its
    values read (by each of the ``C`` consumers); every worker started (after which shared
    memory that held the workers' arguments may be reused); each consumer's turn to issue
    its score products (``pingpong``); then the two cos|sin buffers' (landed, read) where
    they are made, or the deep ring's last values (landed, zeroed: one phase a program). A
    release (``_release``) counts a warp group once, or each of its threads with
    ``THREAD_ARRIVE``. ``ANGLE_ADD``: the rebuild's own cos|sin tables after the slots,
    the relative rows and each half's base rows (``_angle_cs``), guarded by the rebuilding
    warp group's own barriers (it alone writes and reads them)."""
    HALF: gl.constexpr = kd.block_type.shape[1]
    R: gl.constexpr = krd.block_type.shape[1]
    bufs = (gl.allocate_shared_memory(gl.bfloat16, [KS, T, HALF], kd.layout),
            gl.allocate_shared_memory(gl.bfloat16, [KS, T, HALF], kd.layout),
            gl.allocate_shared_memory(gl.bfloat16, [VS, T, HALF], kd.layout),
            gl.allocate_shared_memory(gl.bfloat16, [VS, T, HALF], kd.layout),
            gl.allocate_shared_memory(gl.bfloat16, [KS, T, R], krd.layout),
            gl.allocate_shared_memory(gl.bfloat16, [VS, T, R], krd.layout))
    A: gl.constexpr = 128 if THREAD_ARRIVE else 1  # a warp group's arrivals at a release
    bars = (_barriers(KS, 1), _barriers(VS, 1), _barriers(KS, 1), _barriers(KS, C * A),
            _barriers(VS, C * A), _barriers(1, C + 1).index(0), _barriers(2, A))
    if not CS_GLOBAL:
        bufs = bufs + (
            gl.allocate_shared_memory(gl.bfloat16, [T // KEY_HALF, KEY_HALF, HALF], csd.layout),
            gl.allocate_shared_memory(gl.bfloat16, [T // KEY_HALF, KEY_HALF, HALF], csd.layout))
        bars = bars + (_barriers(T // KEY_HALF, 1), _barriers(T // KEY_HALF, A))
    elif ANGLE_ADD:
        bufs = bufs + _angle_tables(HALF, T)
    if KS == 3:
        bars = bars + (_barriers(1, 1).index(0), _barriers(1, 1).index(0))
    return bufs, bars


@gluon.jit
def _angle_tables(HALF: gl.constexpr, T: gl.constexpr):
    """``angle_add``'s tables, rows ``[cos | sin]`` as the RoPE table's: the relative rows
    ``[ROW_GROUP, 2 HALF]`` (positions 0 ..) and the base rows of a
    ``T``-key tile ``[T / ROW_GROUP, 2 HALF]``, half ``h``'s ``KEY_HALF / ROW_GROUP`` rows
    from row ``h KEY_HALF / ROW_GROUP`` (``_bases``; a warp's lanes read one row, a
    broadcast)."""
    W: gl.constexpr = 2 * HALF
    # 16-byte groups swizzled by row: the 8 rows a warp reads at once fall in distinct banks.
    return (gl.allocate_shared_memory(gl.bfloat16, [ROW_GROUP, W],
                                      gl.SwizzledSharedLayout(8, 1, 8, [1, 0])),
            gl.allocate_shared_memory(gl.bfloat16, [T // ROW_GROUP, W],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0])))


@gluon.constexpr_function
def _rows3_layout(n):
    """The up-projection's accumulator layout (``wgmma_layout(n, 4)``, ``[64, n]``) seen as
    ``[4, ROW_GROUP, n]``: a warp's rows, a row within them, a column. A thread holds
    columns ``2 (lane % 4) + {0, 1} + 8 j`` of rows ``lane / 4`` and ``+ 8``, registers in
    wgmma's accumulator order, so its reshape to ``[64, n]`` is that layout itself."""
    regs = ([[0, 0, 1], [0, ROW_GROUP.value // 2, 0]]
            + [[0, 0, 8 << k] for k in range((n // 8).bit_length() - 1)])
    return gl.DistributedLinearLayout(regs, [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0],
                                             [0, 4, 0]], [[1, 0, 0], [2, 0, 0]], [],
                                      [4, ROW_GROUP.value, n])


@gluon.jit
def _release(bar, THREAD_ARRIVE: gl.constexpr):
    """This warp group's arrival on ``bar``, which releases a buffer it only read, its reads
    complete (a wgmma waited on; loads whose values were used) or guards none (a turn).
    Gluon's arrive is one thread's after a barrier of the warp group, which the compiler
    adds again before the group's next wait or shared access; with ``THREAD_ARRIVE`` every
    thread arrives on its own instead: cp.async's arrive, which lands at once with none of
    the thread's copies pending, and orders nothing (a buffer that publishes writes, a
    rebuilt key, keeps Gluon's arrive)."""
    if THREAD_ARRIVE:
        async_copy.mbarrier_arrive(bar, increment_count=False)
    else:
        mbarrier.arrive(bar)


@gluon.jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers, each completing a phase after ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _page_rows(scalars, n0, live, P: gl.constexpr, T: gl.constexpr):
    """The first pool rows of the tile at key ``n0``'s pages (``K`` and ``V`` share them),
    base and residual (0 for a row without an adapter), as tuples of scalars; nothing read
    unless ``live`` (0s: a tile not loaded). Pages past the sequence's end (a split's last
    tile) are clamped to its last page: in bounds, and the consumers mask their keys (the
    rebuilding warp group zeroes their values)."""
    bt_row, rbt_row, seq_len, has_res = scalars[0], scalars[1], scalars[5], scalars[7]
    last_page = (seq_len - 1) // P
    rows = ()
    res_rows = ()
    for j in gl.static_range(T // P):
        pi = gl.minimum(n0 // P + j, last_page)
        rows = rows + (gl.load(bt_row + pi, mask=live, other=0) * P, )
        res_rows = res_rows + (gl.load(rbt_row + pi, mask=live & has_res, other=0) * P, )
    return rows, res_rows


@gluon.jit
def _load_pages(d, rd, lo, hi, res, bar, pages, kv_col, has_res):
    """One tile's ``K`` (or ``V``) by TMA on ``bar`` from its pages (``_page_rows``): the
    base halves ``lo, hi`` from ``d``, the residual rows ``res`` from ``rd`` for a row with
    an adapter."""
    rows, res_rows = pages
    HALF: gl.constexpr = lo.type.shape[1]
    T: gl.constexpr = lo.type.shape[0]
    P: gl.constexpr = d.block_type.shape[0]
    base_bytes: gl.constexpr = 2 * (T // P) * d.block_type.nbytes
    res_bytes: gl.constexpr = (T // P) * rd.block_type.nbytes
    # expect's byte count is a constant: one of the two, by predicate.
    mbarrier.expect(bar, base_bytes + res_bytes, pred=has_res)
    mbarrier.expect(bar, base_bytes, pred=not has_res)
    for j in gl.static_range(T // P):
        tma.async_copy_global_to_shared(d, [rows[j], kv_col], bar, lo.slice(j * P, P))
        tma.async_copy_global_to_shared(d, [rows[j], kv_col + HALF], bar, hi.slice(j * P, P))
    if has_res:  # one branch a tile, not one a page
        for j in gl.static_range(T // P):
            tma.async_copy_global_to_shared(rd, [res_rows[j], 0], bar, res.slice(j * P, P))


@gluon.jit
def _load(args, CS_GLOBAL: gl.constexpr, DEEP: gl.constexpr):
    """The loader partition (one warp: a TMA copy issued from a warp group waits on a
    barrier of the group each): for every tile of the program's keys, its keys into a slot
    once both consumers have the scores of the tile there before, its cos|sin halves (unless
    ``CS_GLOBAL``) once the rebuild of the tile before is done with each, its values once
    both consumers have the value products of the tile before in the slot. A tile's page
    rows are read from the block tables once for its keys and values, a tile ahead: their
    loads are in flight while the loader waits for the next slot. ``DEEP``: the deep key
    ring's order instead (``_load_keys_ahead``)."""
    if DEEP:
        _load_keys_ahead(args)
    else:
        _load_in_step(args, CS_GLOBAL)


@gluon.jit
def _load_in_step(args, CS_GLOBAL: gl.constexpr):
    """The two-slot ring's loader: a tile's keys, its cos|sin halves, then its values."""
    descs, bars, bufs, _, scalars, _, _ = args
    kd, vd, krd, vrd, csd = descs
    full_k, full_v, _, empty_k, empty_v, started = bars[:6]
    kv_col, start, n_tiles, has_res = scalars[2], scalars[3], scalars[6], scalars[7]
    NS: gl.constexpr = bufs[0].type.shape[0]
    T: gl.constexpr = bufs[0].type.shape[1]
    HALF: gl.constexpr = bufs[0].type.shape[2]
    P: gl.constexpr = kd.block_type.shape[0]
    mbarrier.arrive(started)
    pages = _page_rows(scalars, start, n_tiles > 0, P, T)
    for i in range(n_tiles):
        s = i % NS
        free = ((i // NS) & 1) ^ 1  # a fresh barrier passes a wait on phase 1
        n0 = start + i * T
        mbarrier.wait(empty_k.index(s), free)
        _load_pages(kd, krd, bufs[0].index(s), bufs[1].index(s), bufs[4].index(s),
                    full_k.index(s), pages, kv_col, has_res)
        if has_res and not CS_GLOBAL:
            cs_full, cs_free = bars[7], bars[8]
            # The table's rows past its end read as zeros (TMA fills out-of-bounds boxes).
            for h in gl.static_range(T // KEY_HALF):
                bar = cs_full.index(h)
                mbarrier.wait(cs_free.index(h), (i & 1) ^ 1)
                mbarrier.expect(bar, 2 * csd.block_type.nbytes)
                tma.async_copy_global_to_shared(csd, [n0 + h * KEY_HALF, 0], bar,
                                                bufs[6].index(h))
                tma.async_copy_global_to_shared(csd, [n0 + h * KEY_HALF, HALF], bar,
                                                bufs[7].index(h))
        mbarrier.wait(empty_v.index(s), free)
        _load_pages(vd, vrd, bufs[2].index(s), bufs[3].index(s), bufs[5].index(s),
                    full_v.index(s), pages, kv_col, has_res)
        pages = _page_rows(scalars, n0 + T, i + 1 < n_tiles, P, T)


@gluon.jit
def _load_keys_ahead(args):
    """The deep ring's loader: the first tile's keys, then for every tile the next one's
    keys (once both consumers have the scores of the tile three before in that key slot)
    before this one's values (once both have the value products of the tile two before),
    so a tile's keys wait on no value slot. The last tile's values land on a barrier of
    their own (``last_v``): the rebuild waits on no other tile's, and a wait on its slot's
    barrier could pass on a phase two tiles old."""
    descs, bars, bufs, _, scalars, _, _ = args
    kd, vd, krd, vrd, _ = descs
    full_k, full_v, _, empty_k, empty_v, started = bars[:6]
    last_v = bars[7]
    kv_col, start, n_tiles, has_res = scalars[2], scalars[3], scalars[6], scalars[7]
    KS: gl.constexpr = bufs[0].type.shape[0]
    VS: gl.constexpr = bufs[2].type.shape[0]
    T: gl.constexpr = bufs[0].type.shape[1]
    P: gl.constexpr = kd.block_type.shape[0]
    mbarrier.arrive(started)
    pages = _page_rows(scalars, start, n_tiles > 0, P, T)
    if n_tiles > 0:  # a fresh barrier passes a wait on phase 1
        mbarrier.wait(empty_k.index(0), 1)
        _load_pages(kd, krd, bufs[0].index(0), bufs[1].index(0), bufs[4].index(0),
                    full_k.index(0), pages, kv_col, has_res)
    for i in range(n_tiles):
        nxt = i + 1
        ahead = _page_rows(scalars, start + nxt * T, nxt < n_tiles, P, T)
        if nxt < n_tiles:
            k = nxt % KS
            mbarrier.wait(empty_k.index(k), ((nxt // KS) & 1) ^ 1)
            _load_pages(kd, krd, bufs[0].index(k), bufs[1].index(k), bufs[4].index(k),
                        full_k.index(k), ahead, kv_col, has_res)
        v = i % VS
        mbarrier.wait(empty_v.index(v), ((i // VS) & 1) ^ 1)
        if nxt < n_tiles:
            _load_pages(vd, vrd, bufs[2].index(v), bufs[3].index(v), bufs[5].index(v),
                        full_v.index(v), pages, kv_col, has_res)
        else:
            _load_pages(vd, vrd, bufs[2].index(v), bufs[3].index(v), bufs[5].index(v),
                        last_v, pages, kv_col, has_res)
        pages = ahead


@gluon.jit
def _rope_plus_base_bf16x2(u_lo, u_hi, cos, sin, k_a, k_b):
    """``k_a + u_lo cos - u_hi sin, k_b + u_hi cos + u_lo sin`` in packed bf16 pairs (two
    columns an instruction; the float32 up-projection rounded to bf16 once, then two fused
    multiply-adds each, the base key their first addend)."""
    return gl.inline_asm_elementwise(
        """{ .reg .b32 a, b, nb, t;
        cvt.rn.bf16x2.f32 a, $3, $2;
        cvt.rn.bf16x2.f32 b, $5, $4;
        neg.bf16x2 nb, b;
        fma.rn.bf16x2 t, a, $6, $8;
        fma.rn.bf16x2 $0, nb, $7, t;
        fma.rn.bf16x2 t, b, $6, $9;
        fma.rn.bf16x2 $1, a, $7, t; }""",
        "=r,=r,r,r,r,r,r,r,r,r", [u_lo, u_hi, cos, sin, k_a, k_b], [gl.bfloat16, gl.bfloat16],
        is_pure=True, pack=2)


@gluon.jit
def _key_chunk(bufs, s, h, c: gl.constexpr, C: gl.constexpr):
    """Chunk ``c``'s ``C`` columns of both base key halves, keys ``64 h ..`` of slot ``s``."""
    return (bufs[0].index(s).slice(h * KEY_HALF, KEY_HALF).slice(c * C, C, dim=1),
            bufs[1].index(s).slice(h * KEY_HALF, KEY_HALF).slice(c * C, C, dim=1))


@gluon.jit
def _chunk_reads(bufs, h, c: gl.constexpr, C: gl.constexpr, k_a, k_b, u_l: gl.constexpr, cs,
                 CS_GLOBAL: gl.constexpr, ANGLE_ADD: gl.constexpr):
    """Chunk ``c``'s reads in the up-projection's layout: its cos and sin columns (buffer
    ``h``; with ``CS_GLOBAL`` ``cs``, read from global memory a chunk before; with
    ``ANGLE_ADD`` made from the angle tables, ``_angle_cs``), then its base key columns
    ``k_a``, ``k_b``."""
    if ANGLE_ADD:
        cos, sin = _angle_cs(bufs, h, c, C, u_l)
    elif CS_GLOBAL:
        cos, sin = cs
    else:
        cos = bufs[6].index(h).slice(c * C, C, dim=1).load(u_l)
        sin = bufs[7].index(h).slice(c * C, C, dim=1).load(u_l)
    return cos, sin, k_a.load(u_l), k_b.load(u_l)


@gluon.jit
def _angle_cs(bufs, h, c: gl.constexpr, C: gl.constexpr, u_l: gl.constexpr):
    """Chunk ``c``'s cos and sin columns of key half ``h`` in the up-projection's layout
    ``u_l``, by angle addition (``angle_add``): a row ``16 w + i`` of the half is warp
    ``w``'s base row (``bufs[7]``) advanced by relative row ``i`` (``bufs[6]``). Each is
    read in the slice of ``_rows3_layout`` that drops what it does not vary with, so a
    thread reads each value it needs once (the base row's lanes by broadcast), and the sum
    comes out in ``u_l`` itself (the reshape moves no data)."""
    HALF: gl.constexpr = bufs[0].type.shape[2]
    l3: gl.constexpr = _rows3_layout(C)
    rel_l: gl.constexpr = gl.SliceLayout(0, l3)
    base_l: gl.constexpr = gl.SliceLayout(1, l3)
    base = _bases(bufs, h)
    c_b = gl.expand_dims(base.slice(c * C, C, dim=1).load(base_l), 1)
    s_b = gl.expand_dims(base.slice(HALF + c * C, C, dim=1).load(base_l), 1)
    c_r = gl.expand_dims(bufs[6].slice(c * C, C, dim=1).load(rel_l), 0)
    s_r = gl.expand_dims(bufs[6].slice(HALF + c * C, C, dim=1).load(rel_l), 0)
    c_b, c_r = gl.broadcast(c_b, c_r)
    s_b, s_r = gl.broadcast(s_b, s_r)
    cos, sin = _angle_add_bf16x2(c_b, s_b, c_r, s_r)
    M: gl.constexpr = 4 * ROW_GROUP
    return (gl.convert_layout(gl.reshape(cos, [M, C]), u_l),
            gl.convert_layout(gl.reshape(sin, [M, C]), u_l))


@gluon.jit
def _bases(bufs, h):
    """Key half ``h``'s base rows (``angle_add``)."""
    return bufs[7].slice(h * (KEY_HALF // ROW_GROUP), KEY_HALF // ROW_GROUP)


@gluon.jit
def _angle_add_bf16x2(c_b, s_b, c_r, s_r):
    """``cos(a + b), sin(a + b)`` from ``cos a, sin a, cos b, sin b`` in packed bf16 pairs:
    a multiply and a fused multiply-add each (one rounding of the product ``sin a sin b`` or
    ``sin a cos b``, one of the sum: within a bf16 ulp or two of the table's value)."""
    return gl.inline_asm_elementwise(
        """{ .reg .b32 t;
        mul.rn.bf16x2 t, $3, $5;
        neg.bf16x2 t, t;
        fma.rn.bf16x2 $0, $2, $4, t;
        mul.rn.bf16x2 t, $3, $4;
        fma.rn.bf16x2 $1, $2, $5, t; }""",
        "=r,=r,r,r,r,r", [c_b, s_b, c_r, s_r], [gl.bfloat16, gl.bfloat16], is_pure=True,
        pack=2)


@gluon.jit
def _base_rows(table, p0, W: gl.constexpr):
    """The base rows of the ``KEY_HALF`` keys at position ``p0``, a warp's first row each
    (``[KEY_HALF / ROW_GROUP, W]``, ``W`` the table's ``[cos | sin]`` width), from the table
    in global memory; clamped as ``_cs_rows``'s block (``p0`` past the table's last block
    only reads ahead of a program's last tile, never used)."""
    rows_ptr, n_rows = table
    lay: gl.constexpr = gl.BlockedLayout([1, W // 32], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, KEY_HALF // ROW_GROUP, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, lay))
    first = gl.minimum(p0, n_rows - KEY_HALF)
    return gl.load(rows_ptr + (first + rows[:, None] * ROW_GROUP) * W + cols[None, :])


@gluon.jit
def _stage_angle_tables(bufs, table, start):
    """``angle_add``'s tables at a program's start: the relative rows (the table's first
    ``ROW_GROUP``) and the base rows of both halves of its first tile."""
    rows_ptr = table[0]
    W: gl.constexpr = bufs[6].type.shape[1]
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [ROW_GROUP // 4, 128 // ROW_GROUP],
                                         [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, ROW_GROUP, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, W, layout=gl.SliceLayout(0, lay))
    bufs[6].store(gl.load(rows_ptr + rows[:, None] * W + cols[None, :]))
    HALVES: gl.constexpr = bufs[7].type.shape[0] * ROW_GROUP // KEY_HALF
    for h in gl.static_range(HALVES):
        _bases(bufs, h).store(_base_rows(table, start + h * KEY_HALF, W))


@gluon.jit
def _cs_rows(table, p0, c: gl.constexpr, C: gl.constexpr, HALF: gl.constexpr,
             u_l: gl.constexpr):
    """Columns ``c C ..`` of the cos and sin of positions ``p0 ..`` (``KEY_HALF`` of them)
    from ``table`` (its bf16 rows ``[cos | sin]`` and their count, ``cs_global``) in the
    up-projection's layout. The rows are clamped as a block, by one scalar: ``p0`` and the
    count are multiples of ``KEY_HALF`` (split starts are whole tiles; tables grow from
    32K by doubling, ``run_prefill_kernel`` checks), so a block that starts inside the
    table ends inside it; one past it is only ever the read-ahead past a program's last
    tile, never used. The offsets within the block are the same for every chunk (one
    address add an element)."""
    rows_ptr, n_rows = table
    rows = gl.arange(0, KEY_HALF, layout=gl.SliceLayout(1, u_l))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, u_l))
    block = rows_ptr + (gl.minimum(p0, n_rows - KEY_HALF) * (2 * HALF) + c * C)
    ptr = block + (rows[:, None] * (2 * HALF) + cols[None, :])
    return gl.load(ptr), gl.load(ptr + HALF)


@gluon.jit
def _chunk_landed(kr, bk, c: gl.constexpr, pending, u_l: gl.constexpr, kr_ahead,
                  AHEAD: gl.constexpr):
    """Chunk ``c``'s up-projection (``pending``, in flight) waited on, the next one's issued
    first where there is one: the next chunk's, or at the last chunk where ``AHEAD`` the
    first chunk's of the next half's residual rows ``kr_ahead``. Returns (the next in
    flight, ``u_lo``, ``u_hi``)."""
    N: gl.constexpr = bk.type.shape[0] // 2
    u_lo, u_hi = pending
    if c + 1 < N:
        pending = up_projection(kr, bk.index(c + 1), bk.index(N + c + 1), u_l)
        u_lo, u_hi = warpgroup_mma_wait(2, deps=(u_lo, u_hi))
    elif AHEAD:
        pending = up_projection(kr_ahead, bk.index(0), bk.index(N), u_l)
        u_lo, u_hi = warpgroup_mma_wait(2, deps=(u_lo, u_hi))
    else:
        u_lo, u_hi = warpgroup_mma_wait(0, deps=(u_lo, u_hi))
    return pending, u_lo, u_hi


@gluon.jit
def _rebuild_half(bufs, bk, s, h: gl.constexpr, u_next, cs, table, p0,
                  BF16_ROPE: gl.constexpr, EARLY_LOADS: gl.constexpr,
                  DEFER_STORES: gl.constexpr, HALF_AHEAD: gl.constexpr, JOIN: gl.constexpr,
                  CS_GLOBAL: gl.constexpr, ANGLE_ADD: gl.constexpr):
    """Keys ``64 h ..`` of slot ``s`` rebuilt in place, ``K_base + RoPE(K_res B_k)`` written
    bf16 over the base key, ``C`` column pairs at a time (``bk [2 D / C, r, C]``: ``B_k``
    staged in such chunks), so a thread holds ``C`` up-projected values (both halves) a
    chunk, not 64; the next chunk's up-projection in flight while this one is rotated (two
    chunks held). The half's cos|sin rows are in buffer ``h``. Each element is read and
    written by the same thread, yet Triton places a barrier of the warp group before the
    writes and another before the next chunk's reads: it tracks shared-memory hazards a
    buffer at a time, not a view (round 32: 18 barriers in a tile of the adopted launch's
    rebuild). ``EARLY_LOADS``: a chunk's reads before the wait on its up-projection;
    ``DEFER_STORES``: the half's rebuilt chunks held and written after its last chunk, so
    the barriers fall between the writes (write after write), not before each chunk's
    reads. ``HALF_AHEAD``: past the tile's first half, the half's first up-projection is
    ``u_next``, issued by the half before; the next half's first is returned in flight
    (the tile's last half returns its own, waited on: the caller drops it).
    ``JOIN``: the held chunks written ``JOIN`` at a time, one store a buffer.
    ``CS_GLOBAL``: the half's keys are positions ``p0 ..``; ``cs`` holds its first chunk's
    cos|sin, and each chunk reads the next one's from ``table`` before its own work (the
    last, the next half's first: 64 positions on, in this tile or the next), returned.
    ``ANGLE_ADD``: the cos|sin made by ``_angle_cs`` instead; the next tile's base rows of
    this half read from global memory at its start and written over this tile's after its
    last chunk. Returns (``u_next``, ``cs``)."""
    C: gl.constexpr = bk.type.shape[2]
    H: gl.constexpr = KEY_HALF
    HALF: gl.constexpr = bufs[0].type.shape[2]
    N: gl.constexpr = HALF // C
    T: gl.constexpr = bufs[0].type.shape[1]
    kr = bufs[4].index(s).slice(h * H, H)
    u_l: gl.constexpr = wgmma_layout(C, gl.num_warps())
    AHEAD: gl.constexpr = HALF_AHEAD and (h + 1) * H < T
    kr_ahead = kr  # no view made where nothing is issued ahead
    if AHEAD:
        kr_ahead = bufs[4].index(s).slice((h + 1) * H, H)
    if not HALF_AHEAD or h == 0:
        u_next = up_projection(kr, bk.index(0), bk.index(N), u_l)
    if ANGLE_ADD:  # in flight under the half's work
        bases_next = _base_rows(table, p0 + T, 2 * HALF)
    held = ()
    for c in gl.static_range(N):
        here = cs
        if CS_GLOBAL and not ANGLE_ADD:  # the next chunk's, in flight under this one's work
            cs = _cs_rows(table, p0 + (c + 1) // N * H, (c + 1) % N, C, HALF, u_l)
        # The views made where they are read: made before the wait, the launches measured in
        # round 31 gain one of Triton's barriers a tile (their SASS, round 32).
        if EARLY_LOADS:
            k_a, k_b = _key_chunk(bufs, s, h, c, C)
            cos, sin, base_a, base_b = _chunk_reads(bufs, h, c, C, k_a, k_b, u_l, here,
                                                    CS_GLOBAL, ANGLE_ADD)
            u_next, u_lo, u_hi = _chunk_landed(kr, bk, c, u_next, u_l, kr_ahead, AHEAD)
        else:
            u_next, u_lo, u_hi = _chunk_landed(kr, bk, c, u_next, u_l, kr_ahead, AHEAD)
            k_a, k_b = _key_chunk(bufs, s, h, c, C)
            cos, sin, base_a, base_b = _chunk_reads(bufs, h, c, C, k_a, k_b, u_l, here,
                                                    CS_GLOBAL, ANGLE_ADD)
        if BF16_ROPE:
            r_a, r_b = _rope_plus_base_bf16x2(u_lo, u_hi, cos, sin, base_a, base_b)
        else:
            c32, s32 = cos.to(gl.float32), sin.to(gl.float32)
            r_a = (base_a.to(gl.float32) + u_lo * c32 - u_hi * s32).to(gl.bfloat16)
            r_b = (base_b.to(gl.float32) + u_hi * c32 + u_lo * s32).to(gl.bfloat16)
        if DEFER_STORES:
            held = held + (r_a, r_b)
        else:
            k_a.store(r_a)
            k_b.store(r_b)
    if DEFER_STORES:
        for p in gl.static_range(N // JOIN):
            k_a, k_b = _key_chunk(bufs, s, h, p, JOIN * C)
            k_a.store(_joined(held, 2 * JOIN * p, JOIN))
            k_b.store(_joined(held, 2 * JOIN * p + 1, JOIN))
    if ANGLE_ADD:
        _bases(bufs, h).store(bases_next)
    return u_next, cs


@gluon.jit
def _joined(held, k: gl.constexpr, J: gl.constexpr):
    """The ``J`` (1, 2 or 4) held chunks ``held[k], held[k + 2], ..`` (low or high key
    columns, in turn) side by side, ``[64, J C]``."""
    if J == 1:
        return held[k]
    elif J == 2:
        return _cat_columns(held[k], held[k + 2])
    else:
        return _cat_columns(_cat_columns(held[k], held[k + 2]),
                            _cat_columns(held[k + 4], held[k + 6]))


@gluon.jit
def _cat_columns(a, b):
    """``[R, C]`` tensors ``a`` and ``b`` side by side, ``[R, 2 C]`` (``b``'s columns after
    ``a``'s): a join, a permute and a reshape in order, which move no data (each thread
    keeps its elements, their registers renamed), so the store after is the chunks' own
    ``stmatrix``, only issued together."""
    R: gl.constexpr = a.type.shape[0]
    C: gl.constexpr = a.type.shape[1]
    return gl.reshape(gl.permute(gl.join(a, b), (0, 2, 1)), [R, 2 * C])


@gluon.jit
def _stage_b_k_chunks(bk, bk_row, stride_br, has_res):
    """The adapter's ``B_k`` columns of the KV head in chunks ``bk [2 D / C, r, C]``: the
    low half's chunks, then the high half's (zero without an adapter)."""
    R: gl.constexpr = bk.type.shape[1]
    C: gl.constexpr = bk.type.shape[2]
    N: gl.constexpr = bk.type.shape[0]
    lq: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // C, C // 8], [gl.num_warps(), 1],
                                        [1, 0])
    k = gl.arange(0, R, layout=gl.SliceLayout(1, lq))
    d = gl.arange(0, C, layout=gl.SliceLayout(0, lq))
    off = k[:, None] * stride_br + d[None, :]
    for c in gl.static_range(N):
        bk.index(c).store(gl.load(bk_row + c * C + off, mask=has_res, other=0.0))


@gluon.jit
def _rebuild(args, BF16_ROPE: gl.constexpr, THREAD_ARRIVE: gl.constexpr,
             EARLY_LOADS: gl.constexpr, DEFER_STORES: gl.constexpr, HALF_AHEAD: gl.constexpr,
             JOIN: gl.constexpr, CS_GLOBAL: gl.constexpr, DEEP: gl.constexpr,
             ANGLE_ADD: gl.constexpr):
    """The rebuilding partition (the default, one warp group): stages ``B_k`` (its own, in
    chunks) and ``B_v`` (the consumers'), then hands every tile over in order: its key
    rebuilt in place (rows with an adapter: ``_rebuild_half`` by half tile, each cos|sin
    half freed as it is done, or read from global memory with ``CS_GLOBAL``), with a split's
    last tile's stale value rows zeroed. In the two-slot ring a tile goes over with its
    values; in the ``DEEP`` ring its key goes alone, and only the last tile's values are
    waited on (``last_v``), zeroed and handed over (``zeroed``). ``ANGLE_ADD``: the angle
    tables staged first (``_stage_angle_tables``)."""
    _, bars, bufs, ops, scalars, operands, _ = args
    full_k, full_v, ready, started = bars[0], bars[1], bars[2], bars[5]
    start, stop, n_tiles, has_res = scalars[3], scalars[4], scalars[6], scalars[7]
    KS: gl.constexpr = bufs[0].type.shape[0]
    VS: gl.constexpr = bufs[2].type.shape[0]
    T: gl.constexpr = bufs[0].type.shape[1]
    HALF: gl.constexpr = bufs[0].type.shape[2]
    table = operands[3]
    cs = 0  # the cos|sin of the next chunk to rebuild, read ahead (``CS_GLOBAL``)
    if CS_GLOBAL and not ANGLE_ADD:
        C: gl.constexpr = ops[4].type.shape[2]
        cs = _cs_rows(table, start, 0, C, HALF, wgmma_layout(C, gl.num_warps()))
    if n_tiles > 0:  # an empty program makes no operands
        bk_row, bv_row, stride_br = operands[2]
        _stage_b_k_chunks(ops[4], bk_row, stride_br, has_res)
        stage_b(ops[2], ops[3], bv_row, stride_br, has_res)
        if ANGLE_ADD:
            _stage_angle_tables(bufs, table, start)
        fence_async_shared()
        mbarrier.wait(started, 0)
    for i in range(n_tiles):
        s = i % KS
        n0 = start + i * T
        mbarrier.wait(full_k.index(s), (i // KS) & 1)
        if has_res:
            u_next = 0  # the first half issues its own first up-projection
            for h in gl.static_range(T // KEY_HALF):
                if not CS_GLOBAL:
                    mbarrier.wait(bars[7].index(h), i & 1)
                u_next, cs = _rebuild_half(bufs, ops[4], s, h, u_next, cs, table,
                                           n0 + h * KEY_HALF, BF16_ROPE, EARLY_LOADS,
                                           DEFER_STORES, HALF_AHEAD, JOIN, CS_GLOBAL,
                                           ANGLE_ADD)
                if not CS_GLOBAL:
                    # Every warp's generic reads of the half before the TMA writes of the next.
                    fence_async_shared()
                    _release(bars[8].index(h), THREAD_ARRIVE)
        if DEEP:
            fence_async_shared()
            mbarrier.arrive(ready.index(s))
            if i == n_tiles - 1:
                mbarrier.wait(bars[7], 0)
                if n0 + T > stop:
                    _zero_values_from(bufs, i % VS, stop - n0, has_res)
                mbarrier.arrive(bars[8])
        else:
            # Every tile's values waited on here, not only a split's last tile's (whose stale
            # rows it zeroes): a wait on a barrier two phases ahead would pass on the parity
            # of the earlier phase. The consumers then take the values as ready with the key.
            mbarrier.wait(full_v.index(s), (i // KS) & 1)
            if n0 + T > stop:
                _zero_values_from(bufs, s, stop - n0, has_res)
            fence_async_shared()
            mbarrier.arrive(ready.index(s))


@gluon.jit
def _scores(q_lo, q_hi, bufs, s, s_l: gl.constexpr):
    """``Q K^T`` of slot ``s``'s key, in flight (the caller waits)."""
    W: gl.constexpr = q_lo.type.shape[0]
    T: gl.constexpr = bufs[0].type.shape[1]
    sc = warpgroup_mma(q_lo, bufs[0].index(s).permute((1, 0)),
                       gl.zeros([W, T], gl.float32, s_l), use_acc=False, is_async=True)
    return warpgroup_mma(q_hi, bufs[1].index(s).permute((1, 0)), sc, is_async=True)


@gluon.jit
def _consume(args, WG: gl.constexpr, G: gl.constexpr, DIRECT: gl.constexpr,
             PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, THREAD_ARRIVE: gl.constexpr,
             DEEP: gl.constexpr):
    """Consumer warp group ``WG``: the program's query rows ``64 WG ..`` over every ready
    tile, then its rows out (``store_rows``). With ``PINGPONG`` its score products wait
    their turn: consumer 0's of tile ``i`` after consumer 1's of tile ``i - 1``, consumer
    1's after consumer 0's of tile ``i``. With ``OVERLAP`` tile ``i + 1``'s score products
    are issued before tile ``i``'s softmax and run under it (FA3's intra-warp-group overlap;
    the registers of two score tiles). In the ``DEEP`` ring a tile's key comes ready alone,
    and the consumer waits on its values before their products: the last tile's once the
    rebuild has zeroed their stale rows (``zeroed``), every other's as they land."""
    _, bars, bufs, ops, scalars, operands, outs = args
    full_v, ready, empty_k, empty_v, started, turn = bars[1], bars[2], bars[3], bars[4], \
        bars[5], bars[6]
    start, stop, n_tiles, has_res = scalars[3], scalars[4], scalars[6], scalars[7]
    queries, q_pos0 = operands[0], operands[1]
    KS: gl.constexpr = bufs[0].type.shape[0]
    VS: gl.constexpr = bufs[2].type.shape[0]
    T: gl.constexpr = bufs[0].type.shape[1]
    HALF: gl.constexpr = bufs[0].type.shape[2]
    R: gl.constexpr = bufs[4].type.shape[2]
    W: gl.constexpr = WG_ROWS
    q_lo = ops[0].slice(WG * W, W)
    q_hi = ops[1].slice(WG * W, W)
    s_l: gl.constexpr = wgmma_layout(T, 4)  # [64, 128]: the scores
    o_l: gl.constexpr = wgmma_layout(HALF, 4)  # [64, 64]: each half of O
    r_l: gl.constexpr = wgmma_layout(R, 4)  # [64, r]: P V_res
    mbarrier.arrive(started)
    state = (gl.full([W], float("-inf"), gl.float32, gl.SliceLayout(1, s_l)),
             gl.full([W], 0.0, gl.float32, gl.SliceLayout(1, s_l)),
             gl.zeros([W, HALF], gl.float32, o_l),
             gl.zeros([W, HALF], gl.float32, o_l), gl.zeros([W, R], gl.float32, r_l))
    first = WG * W // G  # this warp group's first token of the program's
    if OVERLAP:
        sc = gl.zeros([W, T], gl.float32, s_l)  # the scores carried from tile to tile
    if n_tiles > 0:
        # After the first tile is ready, so after both consumers started.
        mbarrier.wait(ready.index(0), 0)
        q_base, stride_qt, stride_qh, tok0, q_len, scale_log2e = queries
        stage_queries(q_lo, q_hi, (q_base, stride_qt, stride_qh, tok0 + first, q_len,
                                   scale_log2e), G)
        fence_async_shared()
        if OVERLAP:
            sc = warpgroup_mma_wait(0, deps=(_scores(q_lo, q_hi, bufs, 0, s_l), ))
    pos = q_pos0 + (WG * W + gl.arange(0, W, layout=gl.SliceLayout(1, s_l))) // G
    cols = gl.arange(0, T, layout=gl.SliceLayout(0, s_l))
    seen_by_all = gl.minimum(stop, q_pos0 + first + 1)  # the keys every row here sees
    for i in range(n_tiles):
        s = i % KS
        v = i % VS
        if not OVERLAP:
            mbarrier.wait(ready.index(s), (i // KS) & 1)
            if PINGPONG:  # consumer 0's first turn passes: a fresh barrier's wait on parity 1
                mbarrier.wait(turn.index(WG), (i & 1) ^ (1 - WG))
            sc = _scores(q_lo, q_hi, bufs, s, s_l)
            if PINGPONG:
                _release(turn.index(1 - WG), THREAD_ARRIVE)
            sc = warpgroup_mma_wait(0, deps=(sc, ))
        # Tile i's scores have landed. No proxy fence: a consumer reads a slot by wgmma
        # alone (the async proxy, as the TMA copies that refill it).
        _release(empty_k.index(s), THREAD_ARRIVE)
        if start + (i + 1) * T > seen_by_all:  # nothing in flight here
            sc = mask_scores(sc, start + i * T, stop, pos, cols)
        if OVERLAP:
            # Unconditional, so nothing in flight crosses a branch: after the last tile
            # they score a slot no tile refills, and their result is dropped.
            nxt = i + 1
            mbarrier.wait(ready.index(nxt % KS), (nxt // KS) & 1, pred=nxt < n_tiles)
            sc_next = _scores(q_lo, q_hi, bufs, nxt % KS, s_l)
        p16, state = online_softmax(sc, state)
        if DEEP:
            last = i == n_tiles - 1
            mbarrier.wait(full_v.index(v), (i // VS) & 1, pred=not last)
            mbarrier.wait(bars[8], 0, pred=last)
        m_i, l_i, o_lo, o_hi, acc_r = value_products(bufs, p16, v, state)
        if OVERLAP:
            o_lo, o_hi, acc_r, sc = warpgroup_mma_wait(0, deps=(o_lo, o_hi, acc_r, sc_next))
        else:
            o_lo, o_hi, acc_r = warpgroup_mma_wait(0, deps=(o_lo, o_hi, acc_r))
        state = (m_i, l_i, o_lo, o_hi, acc_r)
        _release(empty_v.index(v), THREAD_ARRIVE)
    m_i, l_i, o_lo, o_hi, acc_r = state
    if has_res & (n_tiles > 0):
        o_lo, o_hi = apply_b_v(o_lo, o_hi, acc_r, ops[2], ops[3])
    rows = WG * W + gl.arange(0, W, layout=gl.SliceLayout(1, o_l))
    store_rows(o_lo, o_hi, m_i, l_i, rows, outs, G, DIRECT)


@gluon.jit
def _residual_prefill_wide_kernel(
        kd, vd, krd, vrd, csd, Q, BK, BV, Adapter, BlockTables, ResTables, SeqLens, CuSeqlensQ,
        Out, PartOut, PartLse, scale_log2e, m_blocks,
        stride_qt, stride_qh, stride_bt, stride_rbt, stride_ba, stride_br,
        stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, CS, cs_rows,
        N_KV: gl.constexpr, G: gl.constexpr, R: gl.constexpr, HEAD_DIM: gl.constexpr,
        T: gl.constexpr, DIRECT: gl.constexpr, CONSUMERS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, CHUNK: gl.constexpr, BF16_ROPE: gl.constexpr,
        PINGPONG: gl.constexpr, OVERLAP: gl.constexpr, THREAD_ARRIVE: gl.constexpr,
        EARLY_LOADS: gl.constexpr, DEFER_STORES: gl.constexpr, HALF_AHEAD: gl.constexpr,
        JOIN: gl.constexpr, CS_GLOBAL: gl.constexpr, KEY_SLOTS: gl.constexpr,
        ANGLE_ADD: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = HEAD_DIM // 2
    DEEP: gl.constexpr = KEY_SLOTS == 3
    M: gl.constexpr = CONSUMERS * WG_ROWS
    b, head, split, q_begin, q_len, seq_len, ctx, tok0, start, stop, n_tiles = program_keys(
        CuSeqlensQ, SeqLens, m_blocks, N_KV, M // G, T)
    adapter = gl.load(Adapter + b)
    has_res = adapter >= 0

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HALF], gl.bfloat16)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, HALF], gl.bfloat16)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, CHUNK], gl.bfloat16)
    ops = (gl.allocate_shared_memory(gl.bfloat16, [M, HALF], q_layout),
           gl.allocate_shared_memory(gl.bfloat16, [M, HALF], q_layout),
           gl.allocate_shared_memory(gl.bfloat16, [R, HALF], b_layout),
           gl.allocate_shared_memory(gl.bfloat16, [R, HALF], b_layout),
           gl.allocate_shared_memory(gl.bfloat16, [HEAD_DIM // CHUNK, R, CHUNK], c_layout))
    bufs, bars = _ring(kd, krd, csd, KEY_SLOTS, VALUE_SLOTS, T, CONSUMERS, THREAD_ARRIVE,
                       CS_GLOBAL, ANGLE_ADD)
    fence_async_shared()
    a_row = gl.maximum(adapter, 0) * stride_ba + head * HEAD_DIM
    queries = (Q + q_begin.to(gl.int64) * stride_qt + head * G * stride_qh, stride_qt,
               stride_qh, tok0, q_len, scale_log2e)
    # One tuple for every partition: descriptors, barriers, slots, the program's own
    # buffers, its integers (``_load_pages``'s order), what the stagings and the rebuild
    # read, the outputs.
    args = ((kd, vd, krd, vrd, csd), bars, bufs, ops,
            (BlockTables + b * stride_bt, ResTables + b * stride_rbt, head * HEAD_DIM,
             start, stop, seq_len, n_tiles, has_res),
            (queries, ctx + tok0, (BK + a_row, BV + a_row, stride_br), (CS, cs_rows)),
            (Out, PartOut, PartLse, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
             stride_lt, stride_lh, q_begin, q_len, tok0, head * G, split, n_tiles))
    # The partitions' tuples written out in each call: a tuple held in a variable would
    # carry its constexprs as run-time values.
    if CONSUMERS == 2:
        gl.warp_specialize([(_rebuild, (args, BF16_ROPE, THREAD_ARRIVE, EARLY_LOADS,
                                        DEFER_STORES, HALF_AHEAD, JOIN, CS_GLOBAL, DEEP,
                                        ANGLE_ADD)),
                            (_load, (args, CS_GLOBAL, DEEP)),
                            (_consume, (args, 0, G, DIRECT, PINGPONG, False, THREAD_ARRIVE, DEEP)),
                            (_consume, (args, 1, G, DIRECT, PINGPONG, False, THREAD_ARRIVE, DEEP))],
                           [1, 4, 4], [LOADER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([(_rebuild, (args, BF16_ROPE, THREAD_ARRIVE, EARLY_LOADS,
                                        DEFER_STORES, HALF_AHEAD, JOIN, CS_GLOBAL, DEEP,
                                        ANGLE_ADD)),
                            (_load, (args, CS_GLOBAL, DEEP)),
                            (_consume, (args, 0, G, DIRECT, False, OVERLAP, THREAD_ARRIVE, DEEP))],
                           [1, 4], [LOADER_REGS, CONSUMER_REGS])


def build_sm90a(launch: WideLaunch, direct: bool, group: int = 4) -> tuple[str, int]:
    """The kernel's PTX for sm_90a and its shared memory in bytes at ``launch`` (output
    written directly, or as partials), built without a GPU at ``sm90_build.WS_SHAPE`` with
    this GQA group."""
    from forkserve.kernels.sm90_build import compile_ws_sm90

    return compile_ws_sm90(_residual_prefill_wide_kernel,
                           dict(T=TILE, DIRECT=direct, G=group, num_warps=4,
                                **launch.constexprs()),
                           launch.maxnreg, {"CuSeqlensQ": torch.empty(8, dtype=torch.int32),
                                            "CS": torch.empty(8, dtype=torch.bfloat16)},
                           aligned=("CS", "cs_rows"))


def residual_prefill_wide(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                          k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                          res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, b_k_all: torch.Tensor,
                          b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                          inv_freq: torch.Tensor, scale: float | None = None,
                          max_q_len: int | None = None, max_seq_len: int | None = None,
                          num_splits: int | None = None,
                          launch: WideLaunch | None = None) -> torch.Tensor:
    """``residual_prefill_ws``'s contract and shapes (``supports``) over 128-key tiles."""
    check_inputs("residual_prefill_wide", q, k_base, k_res, b_k_all, b_v_all)
    max_q_len, max_seq_len = host_bounds(seq_lens, cu_seqlens_q, max_q_len, max_seq_len)
    args = (q, k_base, v_base, k_res, v_res, block_tables, res_block_tables, seq_lens,
            cu_seqlens_q, b_k_all, b_v_all, adapter_idx, inv_freq)
    return run_wide(WideLaunch() if launch is None else launch, args, scale, max_q_len,
                    max_seq_len, num_splits)


def run_wide(launch: WideLaunch, args: tuple, scale: float | None, max_q_len: int,
             max_seq_len: int, num_splits: int | None) -> torch.Tensor:
    """The kernel at ``launch`` on ``args`` (``residual_prefill_wide``'s tensors in its
    order), already checked (``check_inputs``) and bounded (``host_bounds``): what
    ``residual_prefill_ws`` runs for a ``WideLaunch``, without checking them again."""
    return run_prefill_kernel(_residual_prefill_wide_kernel, TILE, launch.rows,
                              dict(num_warps=4, maxnreg=launch.maxnreg, **launch.constexprs()),
                              args, scale, max_q_len, max_seq_len, num_splits, takes_table=True)
