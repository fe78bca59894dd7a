"""FlashAttention-4 as the prefill's library kernel (kernels/fa4_op.py): which kernel
``flash_support`` picks and what that decision gives the routes (CPU), and, on an H200 with
``flash-attn-4`` installed, the ``PAGED_FLASH`` route and the one-call FRESH route against
the plain formulas and the Triton kernels (bf16).

The CUDA tests skip where the probe finds no FA4 (the package missing, another GPU): the
reason is the probe's own, printed with the skip.
"""
from __future__ import annotations

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, DTYPE, ON_CUDA, REL_TOL, make_cache, rel_err

from forkserve.backend.torch.fresh_prefill import fresh_prefill
from forkserve.backend.torch.rope import Rope, RopeConfig
from forkserve.kernels import (
    CostPrefillPolicy,
    FixedPrefillPolicy,
    FlashSupport,
    PrefillCounts,
    PrefillKernels,
    PrefillRoute,
    flash_support,
    paged_prefill,
)
from forkserve.kernels.flash_op import FA2, FA4, flash_paged, flash_varlen
from forkserve.kernels.flash_prefill import sdpa_cold


def _fa4_here() -> FlashSupport:
    q = torch.zeros(1, 8, 128, device=DEVICE, dtype=DTYPE)
    k = torch.zeros(1, 16, 2, 128, device=DEVICE, dtype=DTYPE)
    return flash_support(q, k)


needs_fa4 = pytest.mark.skipif(not ON_CUDA or _fa4_here().kernel != FA4,
                               reason=f"no FlashAttention-4 here: {_fa4_here().reason}")


def test_what_each_kernel_serves() -> None:
    fa4, fa2, none = FlashSupport(FA4, "x"), FlashSupport(FA2, "x"), FlashSupport("", "x")
    assert (fa4.varlen, fa4.paged, fa4.fresh_varlen, fa4.attention) == (
        True, True, True, "fa4_varlen")
    assert (fa2.varlen, fa2.paged, fa2.fresh_varlen, fa2.attention) == (
        True, False, False, "fa2_varlen")
    assert (none.varlen, none.paged, none.fresh_varlen, none.attention) == (
        False, False, False, "sdpa_per_sequence")


def test_cpu_probe_finds_no_kernel() -> None:
    q, k = torch.zeros(1, 8, 128), torch.zeros(1, 16, 2, 128)
    support = flash_support(q, k)
    assert support.kernel == "" and "CUDA" in support.reason


def test_fa4_can_be_turned_off(monkeypatch) -> None:
    from forkserve.kernels import flash_op
    monkeypatch.setenv("FORKSERVE_FA4", "off")
    assert flash_op._probe_fa4(torch.device("cpu"), DTYPE, 8, 2, 128).reason.endswith(
        "(FORKSERVE_FA4)")


def test_policy_takes_the_pages_only_where_fa4_reads_them() -> None:
    policy = CostPrefillPolicy()
    FA4_PAGED, VARLEN = PrefillKernels(varlen=True, paged=True), PrefillKernels(varlen=True)
    chunks = PrefillCounts((512,) * 8, (8704,) * 8)
    cold = PrefillCounts((8192,), (8192,))
    short = PrefillCounts((48,), (8192,))
    for counts in (chunks, cold, short):
        assert policy.route(counts, False, FA4_PAGED) is PrefillRoute.PAGED_FLASH
        assert policy.route(counts, False, VARLEN) is not PrefillRoute.PAGED_FLASH
        assert policy.route(counts, True, FA4_PAGED) is not PrefillRoute.PAGED_FLASH  # residual
    assert CostPrefillPolicy(paged_flash_min_new_tokens=64).route(
        short, False, FA4_PAGED) is PrefillRoute.PAGED  # under the threshold: Triton
    assert FixedPrefillPolicy(PrefillRoute.PAGED_FLASH).route(
        cold, False) is PrefillRoute.PAGED_FLASH
    with pytest.raises(ValueError, match="residual prefill route"):
        FixedPrefillPolicy(residual=PrefillRoute.PAGED_FLASH)


def test_routes_refuse_a_kernel_the_probe_did_not_find() -> None:
    q = torch.zeros(3, 4, 32)
    kv = torch.zeros(3, 2, 32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs FlashAttention-4"):
        flash_paged(q, kv[None], kv[None], torch.zeros(1, 1, dtype=torch.int32),
                    torch.tensor([3]), cu, 3, 1.0, FA2)
    with pytest.raises(ValueError, match="no varlen flash kernel"):
        flash_varlen(q, kv, kv, cu, cu, 3, 3, 1.0, "")


def test_paged_flash_refuses_tuning_keywords() -> None:
    """FA4 is not our kernel to tune: a Triton keyword pinned on its route is refused before
    any kernel runs, rather than silently ignored."""
    q = torch.zeros(2, 4, 32)
    pool = torch.zeros(1, 16, 2, 32)
    with pytest.raises(ValueError, match="takes no tuning keywords, got block_n, num_splits"):
        paged_prefill(q, pool, pool, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]),
                      torch.tensor([0, 2], dtype=torch.int32), use_triton=True,
                      variant="paged_flash", num_splits=0, block_n=64)


@needs_fa4
def test_paged_flash_matches_the_formulas() -> None:
    """Chunks over cached prefixes ending mid-page, a cold prefill, a one-token row, a
    sequence with no new token, GQA 4, head dim 128; unowned pages and the tails of last
    pages NaN (make_cache), so a read past a sequence's keys shows."""
    gen = torch.Generator().manual_seed(4)
    seq_lens, q_lens = [1000, 777, 300, 2049, 64, 513], [1000, 129, 1, 512, 0, 200]
    c = make_cache(gen, seq_lens, 4, 128, rank=16)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    cu = cu.to(DEVICE)
    q = torch.randn(sum(q_lens), 16, 128, generator=gen).to(DEVICE, DTYPE)
    counts = PrefillCounts(tuple(q_lens), tuple(seq_lens))
    args = (q, c.k, c.v, c.block_tables, c.seq_lens, cu)
    out = paged_prefill(*args, variant="paged_flash", counts=counts)
    assert rel_err(out, plain.prefill(*args)) < REL_TOL
    assert rel_err(out, paged_prefill(*args, variant="paged", counts=counts)) < REL_TOL
    assert paged_prefill(*args, counts=counts).equal(out)  # "auto" takes it


@needs_fa4
def test_fresh_in_one_varlen_call_matches_sdpa() -> None:
    """Three cold prefills back to back, unified and residual form (adapters 0, -1, 1): one
    FA4 varlen call against one SDPA call per sequence."""
    gen = torch.Generator().manual_seed(5)
    lens, n_kv, d, r = (700, 33, 1200), 4, 128, 16
    n = sum(lens)
    q = torch.randn(n, 16, d, generator=gen).to(DEVICE, DTYPE)
    k, v = (torch.randn(n, n_kv, d, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    fa4 = _fa4_here()
    scale = d ** -0.5
    one_call = fresh_prefill(q, k, v, lens, scale, flash=fa4)
    assert rel_err(one_call, fresh_prefill(q, k, v, lens, scale)) < REL_TOL
    assert rel_err(one_call[:700], sdpa_cold(q[:700], k[:700], v[:700], scale)) < REL_TOL
    k_res, v_res = (torch.randn(n, r, generator=gen).to(DEVICE, DTYPE) for _ in range(2))
    b_k, b_v = (0.5 * torch.randn(2, r, n_kv * d, generator=gen).to(DEVICE, DTYPE)
                for _ in range(2))
    cos_sin = Rope(RopeConfig(theta=500000.0), d, DEVICE).cos_sin(
        torch.arange(max(lens), device=DEVICE), DTYPE)
    res = dict(slots=(0, -1, 1), k_res=k_res, v_res=v_res, b_k=b_k, b_v=b_v, cos_sin=cos_sin)
    residual = fresh_prefill(q, k, v, lens, scale, **res, flash=fa4)
    assert rel_err(residual, fresh_prefill(q, k, v, lens, scale, **res)) < REL_TOL
    assert rel_err(residual[700:733], one_call[700:733]) < REL_TOL  # slot -1: as written
    assert rel_err(residual[:700], one_call[:700]) > REL_TOL        # slot 0: rebuilt
