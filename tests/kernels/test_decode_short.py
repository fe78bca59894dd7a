"""Unified decode's dynamic split plan (decode_attention.paged_decode_triton, plan "dynamic"):
short sequences in a table much wider than their keys (a CUDA graph's bucket), mixed lengths
in one batch, empty splits that write only lse -inf, the one-split path without a merge, and
the plan's numbers for the H200 (132 SMs). Against the plain formulas (plain_oracle.py)."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, REL_TOL, make_cache, rel_err

from forkserve.kernels import split_kv
from forkserve.kernels.decode_attention import decode_partials, paged_decode_triton
from forkserve.kernels.split_kv import dynamic_splits, merge_partials

PAGE = 16


def _wide(block_tables: torch.Tensor, width: int) -> torch.Tensor:
    """The table padded to ``width`` pages with its padding entry (a NaN page), as a decode
    graph pads its rows to its bucket's width."""
    pad = block_tables[:, -1:].expand(-1, width - block_tables.shape[1])
    return torch.cat([block_tables, pad], dim=1).contiguous()


def _case(seed: int, seq_lens: list[int], n_heads: int = 4, n_kv: int = 2, head_dim: int = 32):
    gen = torch.Generator().manual_seed(seed)
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=8)
    q = torch.randn(len(seq_lens), n_heads, head_dim, generator=gen).to(DEVICE, DTYPE)
    return c, q, plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens)


@pytest.mark.parametrize("num_splits", [None, 1, 3, 40])
def test_short_sequences_in_a_wide_table(num_splits: int | None) -> None:
    # 37 and 5 keys in a 64-page table (1024 keys): the bound is the width, as in a graph.
    c, q, ref = _case(1, [37, 5])
    table = _wide(c.block_tables, 64)
    out = paged_decode_triton(q, c.k, c.v, table, c.seq_lens, max_seq_len=64 * PAGE,
                              num_splits=num_splits, block_n=16)
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.parametrize("num_splits", [None, 1, 2, 7])
def test_mixed_lengths(num_splits: int | None) -> None:
    # One key, a page boundary each side, two pages, and the table's full width.
    lens = [1, 16, 17, 32, 96]
    c, q, ref = _case(2, lens)
    table = _wide(c.block_tables, 6)
    out = paged_decode_triton(q, c.k, c.v, table, c.seq_lens, max_seq_len=6 * PAGE,
                              num_splits=num_splits, block_n=16)
    assert rel_err(out, ref) < REL_TOL


def test_no_bound_reads_no_lengths() -> None:
    # Without max_seq_len the bound is the table width (no seq_lens.max() read back).
    c, q, ref = _case(3, [50, 3, 20])
    lens = c.seq_lens.clone()
    lens.max = None  # type: ignore[method-assign]  # a host read of the lengths would fail
    out = paged_decode_triton(q, c.k, c.v, c.block_tables, lens, block_n=16)
    assert rel_err(out, ref) < REL_TOL


def test_static_plan_still_available() -> None:
    c, q, ref = _case(4, [37, 5])
    out = paged_decode_triton(q, c.k, c.v, _wide(c.block_tables, 8), c.seq_lens,
                              max_seq_len=8 * PAGE, block_n=16, plan="static")
    assert rel_err(out, ref) < REL_TOL
    with pytest.raises(ValueError, match="decode plan"):
        paged_decode_triton(q, c.k, c.v, c.block_tables, c.seq_lens, plan="bogus")


def test_one_split_skips_the_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_merge(*args, **kwargs):
        raise AssertionError("one split must not launch the merge")

    monkeypatch.setattr(split_kv, "merge_partials", no_merge)
    c, q, ref = _case(5, [70, 9])
    out = paged_decode_triton(q, c.k, c.v, c.block_tables, c.seq_lens, num_splits=1,
                              block_n=16)
    assert out.dtype == q.dtype and rel_err(out, ref) < REL_TOL


def test_empty_splits_write_only_their_lse() -> None:
    # 20 and 3 keys cut in 6 splits of 16-key tiles: sequence 0 fills splits 0-1, sequence 1
    # split 0; every other slot keeps its NaN output and gets lse -inf.
    c, q, ref = _case(6, [20, 3])
    splits = 6
    part_out = torch.full((2, 4, splits, 32), float("nan"), device=DEVICE)
    part_lse = torch.full((2, 4, splits), float("nan"), device=DEVICE)
    decode_partials(q, c.k, c.v, c.block_tables, c.seq_lens, part_out, part_lse,
                    scale=32 ** -0.5, kv_start=0, kv_limit=split_kv.NO_LIMIT, num_splits=splits,
                    split_len=0, split_offset=0, block_n=16, dyn_split=True)
    live = {0: 2, 1: 1}
    for b, n in live.items():
        assert torch.isfinite(part_lse[b, :, :n]).all()
        assert torch.isfinite(part_out[b, :, :n]).all()
        assert (part_lse[b, :, n:] == float("-inf")).all()
        assert torch.isnan(part_out[b, :, n:]).all()
    out = merge_partials(part_out, part_lse, torch.empty_like(q), splits)
    assert rel_err(out, ref) < REL_TOL


def test_dynamic_plan_numbers() -> None:
    # Llama-3-8B decode on the H200 (132 SMs, 8 KV heads, 64-key tiles).
    h200 = dict(sms=132, block_n=64)
    assert dynamic_splits(1 * 8, 640, **h200) == 10     # graph bucket of 520 keys: 40 pages
    assert dynamic_splits(1 * 8, 8256, **h200) == 64    # an 8K-wide table: DYN_MAX_SPLITS
    assert dynamic_splits(8 * 8, 640, **h200) == 8
    assert dynamic_splits(64 * 8, 640, **h200) == 1     # fills the SMs: one split, no merge
    assert dynamic_splits(64 * 8, 32768, **h200) == 1
    assert dynamic_splits(32 * 8, 8192, **h200) == 2
    assert dynamic_splits(1 * 8, 16, **h200) == 1       # one tile of keys at most
    assert dynamic_splits(8, 640, num_splits=3, **h200) == 3
    assert dynamic_splits(8, 640, programs_per_sm=1, **h200) == 10
    assert dynamic_splits(512, 640, programs_per_sm=8, **h200) == 2
