"""Cascade prefill (kernels/shared_prefix_prefill.py) equals plain varlen prefill: each group's
prefix attended once for its members' stacked rows, each member's suffix alone, merged."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, REL_TOL, make_cache, rel_err

from forkserve.kernels import cascade_prefill, paged_prefill, prefill_groups, prefix_groups

PAGE = 16
# Group A (sequences 3, 0, 2) shares 3 pages but only 37 keys (its prefix ends mid-page: the
# page's tail is each member's suffix; the longest member is listed first, its pages fill
# the shared ones); group B (1, 4) two pages, page-aligned; sequence 5 in no group. Context
# tails past the prefix, then the chunk (a single token too).
GROUPS = (((3, 0, 2), 37, 3), ((1, 4), 32, 2))
CHUNKS = [(37, 0, 5), (32, 7, 17), (37, 4, 1), (37, 11, 9), (32, 0, 20), (0, 3, 6)]


def batch(gen: torch.Generator, n_heads: int, n_kv: int, splits: int = 1):
    seq_lens = [p + tail + n for p, tail, n in CHUNKS]
    c = make_cache(gen, seq_lens, n_kv, 32, rank=8)
    for members, _, pages in GROUPS:
        c.block_tables[list(members), :pages] = c.block_tables[members[0], :pages]
    q_lens = [n for *_, n in CHUNKS]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), n_heads, 32, generator=gen).to(DEVICE, DTYPE)
    groups = prefill_groups([(m, p) for m, p, _ in GROUPS], q_lens, seq_lens, c.block_tables,
                            splits)
    return c, q, cu.to(DEVICE), groups


@pytest.mark.parametrize("prefix_m,n_heads,n_kv,splits", [(4, 4, 2, 1), (None, 6, 2, 3)])
def test_cascade_prefill_equals_plain_prefill(prefix_m: int | None, n_heads: int, n_kv: int,
                                              splits: int, monkeypatch) -> None:
    """Prefix tiles of 4 stacked tokens (a group spans several), one split; the default 128
    rows (GQA 3: a padded group), the prefixes in three splits on 16 keys (37: an empty
    split, 0-16, 16-37)."""
    monkeypatch.setattr(prefix_groups, "SPLIT_ALIGN", 16)
    gen = torch.Generator().manual_seed(n_heads)
    c, q, cu, groups = batch(gen, n_heads, n_kv, splits)
    assert groups.splits == splits
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


def test_prefix_splits_fill_the_device_without_short_splits() -> None:
    """Llama-3-8B heads (GQA 4: 32-token tiles of 128 rows, 8 KV heads): 8 chunks of 32 over
    8K are 64 programs, split 5 ways (264); 32 chunks of 128 are 1024, not split; two of 16
    over 4K would want 33 splits, capped at 4 (PREFIX_MIN_SPLIT_KEYS); 1.5K: none."""
    splits = prefix_groups.prefix_splits
    assert splits([(tuple(range(8)), 8192)], [32] * 8, 32, 8) == 5
    assert splits([(tuple(range(32)), 8192)], [128] * 32, 32, 8) == 1
    assert splits([((0, 1), 4096)], [16, 16], 32, 8) == 4
    assert splits([(tuple(range(8)), 1536)], [32] * 8, 32, 8) == 1
    bounds = prefix_groups._bounds(8192 + 37, 3)
    assert bounds[0] == 0 and bounds[-1] == 8192 + 37
    assert all(b % prefix_groups.SPLIT_ALIGN == 0 for b in bounds[:-1])

