"""The FRESH prefill route (backend/torch/fresh_prefill.py): a sequence with no cached prefix
attends the step's own K/V (rebuilt from this step's residual rows in the split form) and
gives what the paged routes give reading the same K/V back from the pages. One layer call
of ``KernelAttention`` over hand-built pools and metadata; tiny shapes, float32 on CPU."""
from __future__ import annotations

import math
from itertools import accumulate

import pytest
import torch
from torch_testlib import DEVICE, REL_TOL, rel_err

from forkserve.backend.torch.attention import AttentionMetadata, EagerAttention
from forkserve.backend.torch.kernel_attention import KernelAttention
from forkserve.backend.torch.kv_pool import LayerKV
from forkserve.backend.torch.rope import Rope, RopeConfig
from forkserve.kernels import CostPrefillPolicy, FixedPrefillPolicy, PrefillCounts, PrefillRoute

HQ, HKV, D, PAGE, SLOTS, PAGES = 4, 2, 32, 16, 3, 64
DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16


def build_step(items: list[tuple[int, int, int]], rank: int | None, seed: int = 0):
    """(cached prefix, new tokens, adapter slot) per sequence: pools holding each prefix, the
    step's q/k/v (and residual rows, rank ``rank``; None: unified), its metadata and B stacks
    of ``SLOTS`` adapters, rows of rank ``rank`` padded to ``rank + 3`` with zeros."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE, DTYPE)

    r_max = None if rank is None else rank + 3
    kv = LayerKV(k=rand(PAGES, PAGE, HKV, D), v=rand(PAGES, PAGE, HKV, D),
                 k_res=None if rank is None else rand(PAGES, PAGE, r_max),
                 v_res=None if rank is None else rand(PAGES, PAGE, r_max))
    free = iter(range(1, PAGES))  # page 0: scratch
    tables, res_tables, slots, res_slots = [], [], [], []
    for prefix, new, _ in items:
        n_pages = -(-(prefix + new) // PAGE)
        pages = [next(free) for _ in range(n_pages)]
        res_pages = [next(free) for _ in range(n_pages)]
        tables.append(pages)
        res_tables.append(res_pages)
        for at in range(prefix, prefix + new):
            slots.append(pages[at // PAGE] * PAGE + at % PAGE)
            res_slots.append(res_pages[at // PAGE] * PAGE + at % PAGE)
    width = max(len(t) for t in tables)
    pad = [t + [0] * (width - len(t)) for t in tables]
    res_pad = [t + [0] * (width - len(t)) for t in res_tables]
    qlens = [n for _, n, _ in items]
    t = sum(qlens)

    def ints(values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    split = rank is not None
    meta = AttentionMetadata(
        slot_mapping=ints(slots), res_slot_mapping=ints(res_slots) if split else None,
        block_tables=ints(pad, torch.int32),
        res_block_tables=ints(res_pad, torch.int32) if split else None,
        seq_lens=ints([p + n for p, n, _ in items], torch.int32),
        query_starts=ints([0, *accumulate(qlens)], torch.int32),
        seq_slot=ints([s for *_, s in items]), query_lens_host=tuple(qlens),
        seq_lens_host=tuple(p + n for p, n, _ in items),
        seq_slot_host=tuple(s for *_, s in items), decode_only=all(n == 1 for n in qlens))
    step = dict(q=rand(t, HQ, D), k=rand(t, HKV, D), v=rand(t, HKV, D),
                k_res=None, v_res=None, b_k=None, b_v=None)
    if split:
        res = rand(2, t, r_max)
        res[:, :, rank:] = 0  # the padded rank columns of x A are zero, and so are B's rows
        b = rand(2, SLOTS, r_max, HKV * D) * 0.3
        b[:, :, rank:] = 0
        step.update(k_res=res[0], v_res=res[1], b_k=b[0], b_v=b[1])
    return kv, meta, step


def attend(attention, kv: LayerKV, meta: AttentionMetadata, step: dict,
           rope: Rope) -> torch.Tensor:
    pools = LayerKV(*(None if x is None else x.clone()
                      for x in (kv.k, kv.v, kv.k_res, kv.v_res)))
    s = step
    return attention.forward(s["q"], s["k"], s["v"], s["k_res"], s["v_res"], pools, s["b_k"],
                             s["b_v"], meta, rope)


ROPE = Rope(RopeConfig(theta=10000.0), D, DEVICE)
FRESH = FixedPrefillPolicy(fresh=True)


PAGED = FixedPrefillPolicy()  # paged / fused, no FRESH


def check(items, rank, pinned: FixedPrefillPolicy = PAGED, routes=("fresh",)) -> None:
    """FRESH (``FixedPrefillPolicy(fresh=True)``) against the eager reference and against the
    kernels package's route pinned by ``pinned`` (its eager reference off CUDA), same inputs."""
    kv, meta, step = build_step(items, rank)
    fresh = KernelAttention(use_triton=False, prefill_policy=FRESH)
    out = attend(fresh, kv, meta, step, ROPE)
    for ref in (EagerAttention(), KernelAttention(use_triton=False, prefill_policy=pinned)):
        assert rel_err(out, attend(ref, kv, meta, step, ROPE)) < REL_TOL
    assert set(fresh.prefill_routes) == set(routes), fresh.prefill_routes


@pytest.mark.parametrize("rank", [None, 5])
def test_one_cold_prefill(rank):
    check([(0, 37, 1)], rank)


@pytest.mark.parametrize("rank", [None, 5])
def test_several_cold_prefills_with_different_adapters(rank):
    """Three cold prompts, two adapters and a sequence without one (slot -1: its K/V as
    written, no rebuild)."""
    check([(0, 21, 0), (0, 9, 2), (0, 30, -1), (0, 17, 0)], rank)


@pytest.mark.parametrize("rank", [None, 5])
def test_mixed_step_keeps_the_prefix_sequences_on_their_route(rank):
    """Cold prompts beside a chunk over a cached prefix and decode rows: the prompts FRESH,
    the chunk its route, the one-token rows the decode kernels; rows interleaved."""
    check([(0, 12, 1), (20, 7, 0), (30, 1, 2), (0, 19, 0), (9, 1, 1)], rank,
          routes=("fresh", "reference", "decode_rows"))


def test_prefix_sequence_does_not_take_the_fresh_route():
    kv, meta, step = build_step([(16, 8, 0), (5, 11, 1)], None)
    attention = KernelAttention(use_triton=False, prefill_policy=FRESH)
    attend(attention, kv, meta, step, ROPE)
    assert "fresh" not in attention.prefill_routes
    counts = PrefillCounts((8, 11, 12, 1), (24, 16, 12, 1))
    small = CostPrefillPolicy(fresh_min_new_tokens=2, residual_fresh_min_new_tokens=2)
    assert small.fresh_items(counts, True) == (False, False, True, False)
    # The measured threshold: cold prompts under 1K keep their route, in either form.
    assert not any(CostPrefillPolicy().fresh_items(counts, False))
    cold = PrefillCounts((1000, 1024, 20000), (1000, 1024, 20000))
    assert CostPrefillPolicy().fresh_items(cold, False) == (False, True, True)
    assert CostPrefillPolicy().fresh_items(cold, True) == (False, True, True)
    assert not any(CostPrefillPolicy(fresh=False).fresh_items(counts, False))
    assert not any(FixedPrefillPolicy().fresh_items(counts, False))
    longest = CostPrefillPolicy(fresh_max_seqs=1, fresh_min_new_tokens=2).fresh_items(
        PrefillCounts((5, 9, 9), (5, 9, 9)), False)
    assert longest == (False, True, False)


def test_rows_that_read_written_pages_keep_the_paged_route():
    """A step where some row writes no K/V (``base_writes``: it reads pages already there)
    holds no own K/V for every row: no FRESH route, whatever the policy."""
    kv, meta, step = build_step([(0, 10, 0), (0, 6, 1)], None)
    rows = torch.arange(10, device=DEVICE)
    meta = meta.__class__(**{**meta.__dict__, "base_writes": (rows, meta.slot_mapping[:10])})
    step = {**step, "k": step["k"][:10], "v": step["v"][:10]}
    attention = KernelAttention(use_triton=False, prefill_policy=FRESH)
    attend(attention, kv, meta, step, ROPE)
    assert set(attention.prefill_routes) == {"reference"}


def test_split_rows_without_their_residual_write_keep_the_paged_route():
    """A split step where some row writes no residual (``res_writes``): its split sequences
    keep the residual route (the pool may hold other rows than the step's), the sequence
    without an adapter (slot -1) still takes FRESH."""
    kv, meta, step = build_step([(0, 10, 1), (0, 6, -1)], 5)
    rows = torch.arange(10, device=DEVICE)
    meta = meta.__class__(**{**meta.__dict__,
                             "res_writes": (rows, meta.res_slot_mapping[:10])})
    attention = KernelAttention(use_triton=False, prefill_policy=FRESH)
    out = attend(attention, kv, meta, step, ROPE)
    assert attention.prefill_routes == {"fresh": 1, "reference": 1}
    assert rel_err(out, attend(EagerAttention(), kv, meta, step, ROPE)) < REL_TOL


@pytest.mark.parametrize("residual", [False, True])
def test_fresh_matches_the_triton_routes(residual):
    """Against the kernels themselves (under the interpreter off CUDA): the paged kernel, the
    fused residual kernel and the packed SDPA route, over the pages the step wrote."""
    items = [(0, 20, 1), (0, 13, 0)]
    kv, meta, step = build_step(items, 4 if residual else None)
    out = attend(KernelAttention(use_triton=False, prefill_policy=FRESH), kv, meta, step, ROPE)
    routes = ((PrefillRoute.PAGED, PrefillRoute.FUSED), (PrefillRoute.SDPA, PrefillRoute.SDPA))
    for unified, res in routes:
        pinned = KernelAttention(use_triton=True, prefill_policy=FixedPrefillPolicy(unified, res))
        assert rel_err(out, attend(pinned, kv, meta, step, ROPE)) < REL_TOL
        assert set(pinned.prefill_routes) == {(res if residual else unified).value}
    # FRESH itself with the kernels: the split form's rebuild as one Triton launch
    # (kernels/residual_rebuild.py) and the page write (glue.py)
    kernel_fresh = KernelAttention(use_triton=True, prefill_policy=FRESH)
    assert rel_err(out, attend(kernel_fresh, kv, meta, step, ROPE)) < REL_TOL
    assert set(kernel_fresh.prefill_routes) == {"fresh"}


def test_cost_policy_takes_fresh_for_cold_prompts():
    kv, meta, step = build_step([(0, 33, 2), (0, 3, 1)], 5)
    attention = KernelAttention(use_triton=False, prefill_policy=CostPrefillPolicy(
        fresh_min_new_tokens=2, residual_fresh_min_new_tokens=2))
    out = attend(attention, kv, meta, step, ROPE)
    assert set(attention.prefill_routes) == {"fresh"}
    assert rel_err(out, attend(EagerAttention(), kv, meta, step, ROPE)) < REL_TOL
    assert math.isfinite(float(out.sum()))
