"""Cascade prefill (kernels/shared_prefix_prefill.py) equals plain varlen prefill: each group's
prefix attended once for its members' stacked rows, each member's suffix alone, merged."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, REL_TOL, make_cache, rel_err

from forkserve.kernels import cascade_prefill, paged_prefill, prefill_groups

PAGE = 16
# Group A (sequences 3, 0, 2) shares 3 pages but only 37 keys (its prefix ends mid-page: the
# page's tail is each member's suffix; the longest member is listed first, its pages fill
# the shared ones); group B (1, 4) two pages, page-aligned; sequence 5 in no group. Context
# tails past the prefix, then the chunk (a single token too).
GROUPS = (((3, 0, 2), 37, 3), ((1, 4), 32, 2))
CHUNKS = [(37, 0, 5), (32, 7, 17), (37, 4, 1), (37, 11, 9), (32, 0, 20), (0, 3, 6)]


def batch(gen: torch.Generator, n_heads: int, n_kv: int):
    seq_lens = [p + tail + n for p, tail, n in CHUNKS]
    c = make_cache(gen, seq_lens, n_kv, 32, rank=8)
    for members, _, pages in GROUPS:
        c.block_tables[list(members), :pages] = c.block_tables[members[0], :pages]
    q_lens = [n for *_, n in CHUNKS]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), n_heads, 32, generator=gen).to(DEVICE, DTYPE)
    groups = prefill_groups([(m, p) for m, p, _ in GROUPS], q_lens, seq_lens, c.block_tables)
    return c, q, cu.to(DEVICE), groups


@pytest.mark.parametrize("prefix_m,n_heads,n_kv", [(4, 4, 2), (None, 6, 2)])
def test_cascade_prefill_equals_plain_prefill(prefix_m: int | None, n_heads: int,
                                              n_kv: int) -> None:
    """Prefix tiles of 4 stacked tokens (a group spans several) and the default 128 rows
    (GQA 3: a padded group)."""
    gen = torch.Generator().manual_seed(n_heads)
    c, q, cu, groups = batch(gen, n_heads, n_kv)
    out = cascade_prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu, groups, use_triton=True,
                          block_m=8, block_n=16, prefix_tuning={"block_m": prefix_m,
                                                                "block_n": 16})
    assert rel_err(out, plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu)) < REL_TOL
    plain_kernel = paged_prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu, use_triton=True,
                                 variant="paged", block_m=8, block_n=16)
    assert rel_err(out, plain_kernel) < REL_TOL


def test_groups_refuse_a_chunk_that_starts_inside_the_prefix() -> None:
    tables = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError):
        prefill_groups([((0, 1), 32)], [5, 8], [40, 38], tables)
    with pytest.raises(ValueError):
        prefill_groups([((0, 1), 16), ((1,), 16)], [5, 8], [40, 38], tables)
