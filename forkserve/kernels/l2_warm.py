"""Start a decode program's first key tiles on their way into L2 while the launch before it
still runs (two-pass decode's pass 2 under ``pdl``: ``residual_decode_triton(warm=...)``).

Under programmatic launch a pass-2 program starts while pass 1 (q-folded scores:
tensor-core work and short chains of dependent loads) still runs, and waits for it
(``griddepcontrol.wait``) before its first score read. HBM is mostly idle meanwhile: at batch
1 pass 1 moves well under a megabyte, where a decode call's K/V is 16-128 MiB. The K/V pages
were written before pass 1 began, so the program may touch them before the wait: it issues
``prefetch.global.L2::evict_last`` for every 128-byte line of its first ``TILES`` key tiles
(the page ids come from its block table row), and its loop then finds them in L2.

A prefetch changes no value and faults on no address (an out-of-range line is dropped), so
the outputs are bit for bit those without it; only the device can tell it ran. Keys past the
program's range issue nothing.
"""
from __future__ import annotations

import triton
import triton.language as tl

_PREFETCH_L2_ASM = tl.constexpr("""{
  prefetch.global.L2::evict_last [$1];
  mov.b32 $0, 0;
}""")


@triton.jit
def warm_l2(K, V, BlockTables, table_row, start, stop, head_off, stride_kp, stride_ks,
            PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
            TILES: tl.constexpr):
    """Prefetch into L2 the K and V rows (``HEAD_DIM`` elements at ``head_off`` in each key's
    slot) of keys ``start .. min(start + TILES * BLOCK_N, stop)``, their pages from the
    block table row at ``BlockTables + table_row``. K and V share their strides."""
    LINE: tl.constexpr = 128 // (K.dtype.element_ty.primitive_bitwidth // 8)
    line = tl.arange(0, HEAD_DIM // LINE) * LINE
    for t in tl.static_range(TILES):
        tile = start + t * BLOCK_N
        if tile < stop:
            offs = tile + tl.arange(0, BLOCK_N)
            # Keys past ``stop`` repeat the last one: no address outside the range.
            offs = tl.minimum(offs, stop - 1)
            page = tl.load(BlockTables + table_row + offs // PAGE_SIZE)
            row = (page.to(tl.int64) * stride_kp + (offs % PAGE_SIZE) * stride_ks
                   + head_off)[:, None] + line[None, :]
            for base in tl.static_range(2):
                pool = K if base == 0 else V
                tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l", [pool + row],
                                          dtype=tl.int32, is_pure=False, pack=1)
