"""Shared-prefix decode equals plain decode."""
from __future__ import annotations

import pytest
import torch

from forkserve.kernels import paged_decode, reference, shared_prefix_decode
from kernel_testlib import DEVICE, DTYPE, REL_TOL, make_cache, rel_err


@pytest.mark.parametrize("agents_per_program", [2, None])
@pytest.mark.parametrize("n_heads,n_kv", [(4, 2), (6, 2)])
def test_shared_prefix_equals_decode(agents_per_program: int | None, n_heads: int, n_kv: int) -> None:
    gen = torch.Generator().manual_seed(n_heads)
    prefix_pages, page = 5, 16
    # Five agents (not a multiple of the agent tile): suffixes of 0, 1, mid-page, several pages.
    suffix = [0, 1, 9, 40, 23]
    seq_lens = [prefix_pages * page + s for s in suffix]
    c = make_cache(gen, seq_lens, n_kv, 32, rank=8, shared_prefix_pages=prefix_pages)
    q = torch.randn(len(seq_lens), n_heads, 32, generator=gen).to(DEVICE, DTYPE)
    out = shared_prefix_decode(q, c.k, c.v, c.block_tables, c.seq_lens, prefix_pages,
                               use_triton=True, agents_per_program=agents_per_program,
                               num_splits=2, block_n=16)
    ref = reference.paged_decode_ref(q, c.k, c.v, c.block_tables, c.seq_lens)
    assert rel_err(out, ref) < REL_TOL
    plain = paged_decode(q, c.k, c.v, c.block_tables, c.seq_lens, use_triton=True)
    assert rel_err(out, plain) < REL_TOL
