"""The flash prefill route (packed K/V, rebuilt in the residual form, then FlashAttention-2 or
per-sequence SDPA) and the policy that picks prefill routes.

On CPU the pack kernel runs under the interpreter and the packed buffers are attended by the
SDPA fallback in float32 (the flash op is CUDA-only); both are checked against the plain
formulas (plain_oracle.py). On CUDA the same tests run FlashAttention-2 in bf16, and
``test_flash_matches_triton_on_gpu`` compares it with the Triton kernels on engine-like
batches.
"""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, ON_CUDA, REL_TOL, make_adapters, make_cache, rel_err

from forkserve.kernels import (
    CostPrefillPolicy,
    FixedPrefillPolicy,
    PrefillCounts,
    PrefillKernels,
    PrefillRoute,
    flash_support,
    paged_prefill,
    residual_prefill,
)
from forkserve.kernels.flash_prefill import cold_length, cold_lengths, sdpa_cold, warm_cold_plans
from forkserve.kernels.kv_pack import ResidualPools, pack_kv
from forkserve.kernels.rope import default_inv_freq

VARLEN, NO_FLASH = PrefillKernels(varlen=True), PrefillKernels()

# (seq_lens, q_lens, n_heads, n_kv): cold prefills, chunks after a cached prefix ending
# mid-page, a one-token chunk, an empty chunk (left out of the packed buffers), GQA 1/2/3/4.
CASES = [
    ([37, 100, 16, 70], [37, 30, 1, 21], 4, 2),
    ([64, 45], [0, 45], 8, 2),
    ([50, 81], [17, 40], 6, 2),
    ([33], [33], 2, 2),
]


def _batch(gen: torch.Generator, seq_lens: list[int], q_lens: list[int], n_heads: int, n_kv: int,
           head_dim: int = 32, rank: int = 12, n_adapters: int = 3):
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=rank)
    b_k, b_v = make_adapters(gen, n_adapters, rank, n_kv, head_dim)
    adapters = torch.tensor([(1, 0, -1, 2)[i % 4] for i in range(len(seq_lens))], dtype=torch.int32,
                            device=DEVICE)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), n_heads, head_dim, generator=gen).to(DEVICE, DTYPE)
    inv_freq = default_inv_freq(head_dim, base=500000.0, device=DEVICE)
    residual = ResidualPools(c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq)
    return c, q, cu.to(DEVICE), residual, PrefillCounts(tuple(q_lens), tuple(seq_lens))


def _residual_args(c, q, cu, r: ResidualPools) -> tuple:
    return (q, c.k, c.v, r.k_res, r.v_res, c.block_tables, r.res_block_tables, c.seq_lens, cu,
            r.b_k_all, r.b_v_all, r.adapter_idx, r.inv_freq)


def _oracle(c, q, cu, residual: ResidualPools | None) -> torch.Tensor:
    return plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu,
                         None if residual is None else tuple(residual))


@pytest.mark.parametrize("variant", ["flash", "sdpa"])
@pytest.mark.parametrize("seq_lens,q_lens,n_heads,n_kv", CASES)
def test_packed_paged_prefill(seq_lens, q_lens, n_heads, n_kv, variant) -> None:
    c, q, cu, _, counts = _batch(torch.Generator().manual_seed(sum(seq_lens)), seq_lens, q_lens,
                                 n_heads, n_kv)
    out = paged_prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu, use_triton=True,
                        variant=variant, counts=counts, block_t=16)
    assert rel_err(out, _oracle(c, q, cu, None)) < REL_TOL


@pytest.mark.parametrize("seq_lens,q_lens,n_heads,n_kv", CASES)
def test_flash_residual_prefill(seq_lens, q_lens, n_heads, n_kv) -> None:
    c, q, cu, res, counts = _batch(torch.Generator().manual_seed(sum(q_lens)), seq_lens, q_lens,
                                   n_heads, n_kv)
    out = residual_prefill(*_residual_args(c, q, cu, res), use_triton=True, variant="flash",
                           counts=counts)
    ref = _oracle(c, q, cu, res)
    assert rel_err(out, ref) < REL_TOL
    # The residual matters on this input: the base alone is far off.
    assert rel_err(_oracle(c, q, cu, None), ref) > 10 * REL_TOL


def test_flash_residual_chunk_past_4k() -> None:
    """A chunk after a 4.1K cached prefix: the rebuild's RoPE rows at positions up to ~4.1K,
    ragged against a short sequence of another adapter; counts read back (none given)."""
    c, q, cu, res, _ = _batch(torch.Generator().manual_seed(4), [4096 + 27, 40], [24, 40], 4, 1,
                              rank=16, n_adapters=2)
    out = residual_prefill(*_residual_args(c, q, cu, res), use_triton=True, variant="flash")
    assert rel_err(out, _oracle(c, q, cu, res)) < REL_TOL


def test_pack_rebuilds_rows_in_place_of_pages() -> None:
    """pack_kv alone, each sequence at its own destination row (gaps between them, as in the
    merged route's page-aligned layout): every packed row is the plain formula's K/V of its
    position, the sequence with adapter -1 its base rows."""
    seq_lens = [37, 16, 5]
    c, _, _, res, _ = _batch(torch.Generator().manual_seed(9), seq_lens, [1, 1, 1], 4, 2)
    starts = [0, 48, 80]
    key_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    dst = torch.tensor(starts, dtype=torch.int64, device=DEVICE)
    k, v = pack_kv(c.k, c.v, c.block_tables, key_lens, dst, 96, max(seq_lens), res, block_t=16)
    for b, (n, at) in enumerate(zip(seq_lens, starts, strict=True)):
        a = int(res.adapter_idx[b])
        kb, vb = plain.rows(c.k, c.block_tables[b], n), plain.rows(c.v, c.block_tables[b], n)
        if a >= 0:
            up_k = plain.rows(res.k_res, res.res_block_tables[b], n) @ res.b_k_all[a].cpu().double()
            up_v = plain.rows(res.v_res, res.res_block_tables[b], n) @ res.b_v_all[a].cpu().double()
            kb = kb + plain.rope(up_k.reshape(n, 2, -1), torch.arange(n), res.inv_freq)
            vb = vb + up_v.reshape(n, 2, -1)
        assert rel_err(k[at:at + n].cpu(), kb) < REL_TOL
        assert rel_err(v[at:at + n].cpu(), vb) < REL_TOL


def test_flash_support_reports_why() -> None:
    q = torch.zeros(1, 4, 32, device=DEVICE, dtype=torch.float32)
    k = torch.zeros(1, 16, 2, 32, device=DEVICE, dtype=torch.float32)
    support = flash_support(q, k)
    assert not support.varlen and support.attention == "sdpa_per_sequence"
    assert ("float32" in support.reason) if ON_CUDA else ("CUDA" in support.reason)


def test_counts() -> None:
    counts = PrefillCounts((3, 0, 2), (10, 7, 2))
    brute = sum(1 for q, s in zip(counts.query_lens, counts.seq_lens, strict=True)
                for j in range(q) for key in range(s) if key <= s - q + j)
    assert counts.causal_pairs == brute == 3 * 7 + 6 + 3
    assert (counts.new_tokens, counts.context_tokens, counts.packed_keys) == (5, 19, 12)
    assert (counts.max_query_len, counts.max_packed_len) == (3, 10)
    with pytest.raises(ValueError, match="query lengths"):
        PrefillCounts((3,), (2,))
    with pytest.raises(ValueError, match="sequences"):
        PrefillCounts((1, 1), (2,))


def test_cost_policy_routes() -> None:
    policy = CostPrefillPolicy(flash_min_pairs_per_key=128, residual_flash_min_pairs_per_key=32,
                               min_gather_new_tokens=32, max_packed_keys=1 << 17,
                               merge_context_ratio=4)
    whole_8k = PrefillCounts((8192,), (8192,))
    chunks = PrefillCounts((512,) * 8, (8704,) * 8)            # 8 chunks of 512 over 8K cached
    short = PrefillCounts((48,), (8192,))                      # few queries over a long context
    decodes = PrefillCounts((1,) * 64, (8192,) * 64)           # decode-like rows dominate
    assert policy.route(whole_8k, False, VARLEN) is PrefillRoute.SDPA  # cold: SDPA picks one
    assert policy.route(chunks, False, VARLEN) is PrefillRoute.FLASH
    no_sdpa = CostPrefillPolicy(sdpa_for_cold=False)
    assert no_sdpa.route(whole_8k, True, VARLEN) is PrefillRoute.FLASH
    assert policy.route(short, False, VARLEN) is PrefillRoute.PAGED
    assert policy.route(short, True, VARLEN) is PrefillRoute.FLASH  # residual's lower threshold
    assert policy.route(decodes, True, VARLEN) is PrefillRoute.FUSED
    # Under the default minimum of new tokens the packed route's fixed cost loses (H200).
    cold_1k = PrefillCounts((1024,), (1024,))
    assert CostPrefillPolicy().route(cold_1k, False, VARLEN) is PrefillRoute.PAGED
    assert CostPrefillPolicy().route(cold_1k, True, VARLEN) is PrefillRoute.FUSED
    assert CostPrefillPolicy().route(short, True, VARLEN) is PrefillRoute.FUSED
    assert CostPrefillPolicy().route(chunks, True, VARLEN) is PrefillRoute.FLASH
    too_big = PrefillCounts((140000,), (140000,))
    assert policy.route(too_big, False, VARLEN) is PrefillRoute.PAGED  # the buffer cap
    # Without the flash op: the Triton kernels, merged when the context is <= 4x the new tokens.
    assert policy.route(whole_8k, False, NO_FLASH) is PrefillRoute.PAGED
    assert policy.route(whole_8k, True, NO_FLASH) is PrefillRoute.MERGED
    assert policy.route(short, True, NO_FLASH) is PrefillRoute.FUSED


def test_the_policy_takes_ws_where_the_triton_kernels_would_run() -> None:
    """Where the ws residual prefill takes the inputs it replaces MERGED and FUSED; the
    packed routes keep the long chunks their threshold gives them, the unified form is
    untouched."""
    policy = CostPrefillPolicy()
    ws = PrefillKernels(varlen=True, residual_ws=True)
    short = PrefillCounts((64,) * 8, (8256,) * 8)
    chunks = PrefillCounts((512,) * 8, (8704,) * 8)
    whole_8k = PrefillCounts((8192,), (8192,))
    assert policy.route(short, True, VARLEN) is PrefillRoute.FUSED
    assert policy.route(short, True, ws) is PrefillRoute.WS
    assert policy.route(chunks, True, ws) is PrefillRoute.FLASH
    assert policy.route(whole_8k, True, PrefillKernels(residual_ws=True)) is PrefillRoute.WS
    assert policy.route(short, False, ws) is PrefillRoute.PAGED


def test_fixed_policy_and_variants_refuse_wrong_routes() -> None:
    assert FixedPrefillPolicy(PrefillRoute.FLASH, PrefillRoute.MERGED).route(
        PrefillCounts((1,), (1,)), True) is PrefillRoute.MERGED
    with pytest.raises(ValueError, match="unified prefill route"):
        FixedPrefillPolicy(unified=PrefillRoute.FUSED)
    c, q, cu, _, _ = _batch(torch.Generator().manual_seed(1), [20], [20], 2, 2)
    with pytest.raises(ValueError, match="prefill variant"):
        paged_prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu, use_triton=True,
                      variant="merged")


@pytest.mark.skipif(not ON_CUDA, reason="FlashAttention-2 needs the GPU")
def test_flash_matches_triton_on_gpu() -> None:
    """bf16 on the GPU: the flash route (FlashAttention-2, checked to be the varlen op) against
    the Triton kernels on an engine-like batch: several sequences, chunks over cached prefixes
    that end mid-page, a cold prefill, a one-token row, GQA 4, four adapters and -1."""
    gen = torch.Generator().manual_seed(15)
    seq_lens = [1000, 777, 300, 2049, 513]
    q_lens = [1000, 129, 1, 512, 200]
    c, q, cu, res, counts = _batch(gen, seq_lens, q_lens, 16, 4, head_dim=128, rank=16,
                                   n_adapters=4)
    res = res._replace(adapter_idx=torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32, device=DEVICE))
    assert flash_support(q, c.k).varlen, flash_support(q, c.k).reason
    unified = (q, c.k, c.v, c.block_tables, c.seq_lens, cu)
    triton = paged_prefill(*unified, variant="paged", counts=counts)
    for variant in ("flash", "sdpa"):
        assert rel_err(paged_prefill(*unified, variant=variant, counts=counts), triton) < REL_TOL
    args = _residual_args(c, q, cu, res)
    r_flash = residual_prefill(*args, variant="flash", counts=counts)
    for variant in ("fused", "merged", "sdpa"):
        assert rel_err(r_flash, residual_prefill(*args, variant=variant, counts=counts)) < REL_TOL
    assert rel_err(r_flash, _oracle(c, q, cu, res)) < REL_TOL
    # A batch of cold prefills only: the SDPA route's is_causal path (cuDNN where torch picks it).
    cold = PrefillCounts((1000,), (1000,))
    one = (q[:1000], c.k, c.v, c.block_tables[:1], c.seq_lens[:1], cu[:2])
    assert rel_err(paged_prefill(*one, variant="sdpa", counts=cold),
                   paged_prefill(*one, variant="flash", counts=cold)) < REL_TOL


def test_cold_length_bounds_the_shapes() -> None:
    """16 lengths per octave, at least 64: powers of two stay, the padding is under 1/16."""
    assert [cold_length(n) for n in (1, 64, 100, 1024, 2049, 4100, 8410)] == [
        64, 64, 128, 1024, 2176, 4352, 8704]
    lengths = range(2048, 9000, 7)
    assert len({cold_length(n) for n in lengths}) <= 16 * 3
    assert all(0 <= cold_length(n) - n < max(64, n / 16) for n in range(1, 5000))


@pytest.mark.parametrize("n", [37, 64, 129])
def test_sdpa_cold_padded_equals_unpadded(n) -> None:
    """Rows past n are zero and past every real row: the real rows attend as without them."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, 32, generator=gen).to(DEVICE, DTYPE) for h in (4, 2, 2))
    out = sdpa_cold(q, k, v, 0.2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=0.2, enable_gqa=True)[0].transpose(0, 1)
    assert out.shape == q.shape and rel_err(out, ref) < REL_TOL


def test_cold_lengths_cover_every_length_once() -> None:
    lengths = cold_lengths(1000, 2300)
    assert lengths == sorted(set(lengths)) and lengths[0] == 1024 and lengths[-1] == 2304
    assert {cold_length(n) for n in range(1000, 2301)} == set(lengths)
    # One SDPA call per length (cuDNN's plans), or FlashAttention-4's kernels compiled once
    # for every length (varlen and paged; short and long queries; batch 1 and 2).
    fa4 = flash_support(torch.zeros(1, 4, 32, dtype=DTYPE, device=DEVICE),
                        torch.zeros(1, 16, 2, 32, dtype=DTYPE, device=DEVICE)).fresh_varlen
    assert warm_cold_plans(cold_lengths(60, 130), 4, 2, 32, DTYPE,
                           torch.device(DEVICE)) == (8 if fa4 else 3)
