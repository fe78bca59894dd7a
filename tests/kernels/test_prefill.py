"""Varlen causal prefill (unified and ResidualAttention) against the plain formulas
(plain_oracle.py): the merged variant builds its pages with the eager reference's helpers,
so the reference cannot be its oracle."""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, REL_TOL, make_adapters, make_cache, rel_err

from forkserve.kernels import PrefillCounts, paged_prefill, residual_prefill
from forkserve.kernels.rope import default_inv_freq

# (seq_lens, q_lens, n_heads, n_kv): cold prefills (q_len == seq_len), prefills after a
# cached prefix that end mid-page, a single-token chunk, an empty chunk, GQA 1/2/3/4.
CASES = [
    ([37, 100, 16, 70], [37, 30, 1, 21], 4, 2),
    ([64, 45], [0, 45], 8, 2),
    ([50, 81], [17, 40], 6, 2),
    ([33], [33], 2, 2),
]


def _varlen_q(gen: torch.Generator, q_lens: list[int], n_heads: int, head_dim: int):
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), n_heads, head_dim, generator=gen).to(DEVICE, DTYPE)
    return q, cu.to(DEVICE)


@pytest.mark.parametrize("seq_lens,q_lens,n_heads,n_kv", CASES)
def test_paged_prefill(seq_lens: list[int], q_lens: list[int], n_heads: int, n_kv: int) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    c = make_cache(gen, seq_lens, n_kv, 32, rank=8)
    q, cu = _varlen_q(gen, q_lens, n_heads, 32)
    # Pinned: the tiles tune the Triton kernel, and "auto" takes FA4 where it is installed.
    out = paged_prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu, use_triton=True,
                        variant="paged", block_m=16, block_n=32)
    assert rel_err(out, plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu)) < REL_TOL


def test_tuning_keywords_need_a_pinned_variant() -> None:
    """Which route "auto" takes depends on the machine (FA4 where it is installed), so Triton
    tiles passed with it are refused on every machine, before any kernel runs, rather than
    tuning the Triton kernel here and silently nothing on an H200 with FA4 (round 42)."""
    gen = torch.Generator().manual_seed(0)
    c = make_cache(gen, [20], 2, 32, rank=4)
    b_k, b_v = make_adapters(gen, 1, 4, 2, 32)
    q, cu = _varlen_q(gen, [20], 4, 32)
    res = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens, cu,
           b_k, b_v, torch.zeros(1, dtype=torch.int32, device=DEVICE),
           default_inv_freq(32, device=DEVICE))
    pinned = "need a pinned variant, not 'auto'"
    with pytest.raises(ValueError, match=rf"\(block_m, block_n\) {pinned}"):
        paged_prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu, use_triton=True,
                      block_m=16, block_n=32)
    with pytest.raises(ValueError, match=rf"\(block_n\) {pinned}"):
        residual_prefill(*res, use_triton=True, block_n=32)


@pytest.mark.parametrize("seq_lens,q_lens,n_heads,n_kv", CASES)
@pytest.mark.parametrize("variant", ["fused_split_score", "fused", "merged"])
def test_residual_prefill(seq_lens: list[int], q_lens: list[int], n_heads: int, n_kv: int,
                          variant: str) -> None:
    gen = torch.Generator().manual_seed(sum(q_lens))
    head_dim, r_max = 32, 12
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=r_max)
    b_k, b_v = make_adapters(gen, 3, r_max, n_kv, head_dim)
    adapters = torch.tensor([(1, -1, 0, 2)[i % 4] for i in range(len(seq_lens))],
                            dtype=torch.int32, device=DEVICE)
    inv_freq = default_inv_freq(head_dim, device=DEVICE)
    q, cu = _varlen_q(gen, q_lens, n_heads, head_dim)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens, cu,
            b_k, b_v, adapters, inv_freq)
    tuning = {} if variant == "merged" else {"split_score": variant == "fused_split_score"}
    out = residual_prefill(*args, use_triton=True, variant=variant.removesuffix("_split_score"),
                           block_m=16, block_n=32, **tuning)
    ref = plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu,
                        (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.parametrize("variant", ["fused", "merged"])
def test_residual_prefill_chunk_past_4k(variant: str) -> None:
    """A 24-token chunk after a 4.1K cached prefix: RoPE of the rebuilt keys at positions
    up to ~4.1K, ragged against a short second sequence with another adapter."""
    gen = torch.Generator().manual_seed(4)
    head_dim, n_kv, n_heads, rank = 32, 1, 4, 16
    seq_lens, q_lens = [4096 + 27, 40], [24, 40]
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=rank)
    b_k, b_v = make_adapters(gen, 2, rank, n_kv, head_dim)
    adapters = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    inv_freq = default_inv_freq(head_dim, base=500000.0, device=DEVICE)
    q, cu = _varlen_q(gen, q_lens, n_heads, head_dim)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens, cu,
            b_k, b_v, adapters, inv_freq)
    out = residual_prefill(*args, use_triton=True, variant=variant, block_m=32, block_n=128)
    ref = plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu,
                        (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.parametrize("q_lens", [[16, 9, 1], [40, 3, 17]])
def test_residual_prefill_default_launch(q_lens: list[int]) -> None:
    """The launch the engine gets (no tiles named): chunks of at most 16 tokens take 64 query
    rows a program on 4 warps, longer ones 128 on 8 (``residual_launch``, H200-measured);
    both against the formulas, GQA 4."""
    from forkserve.kernels.prefill_attention import residual_launch
    assert residual_launch(max(q_lens)) == ((64, 4) if max(q_lens) <= 16 else (128, 8))
    assert residual_launch(None) == (128, 8)
    gen = torch.Generator().manual_seed(sum(q_lens))
    head_dim, r_max, seq_lens = 32, 12, [70, 33, 50]
    c = make_cache(gen, seq_lens, 2, head_dim, rank=r_max)
    b_k, b_v = make_adapters(gen, 3, r_max, 2, head_dim)
    adapters = torch.tensor([1, -1, 2], dtype=torch.int32, device=DEVICE)
    inv_freq = default_inv_freq(head_dim, device=DEVICE)
    q, cu = _varlen_q(gen, q_lens, 8, head_dim)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens, cu,
            b_k, b_v, adapters, inv_freq)
    # The host counts the engine passes carry the longest chunk the launch is chosen by.
    counts = PrefillCounts(tuple(q_lens), tuple(seq_lens))
    out = residual_prefill(*args, use_triton=True, variant="fused", counts=counts)
    ref = plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu,
                        (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))
    assert rel_err(out, ref) < REL_TOL
