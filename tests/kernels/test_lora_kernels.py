"""Multi-LoRA shrink / expand (SGMV) against the eager references."""
from __future__ import annotations

import torch
from kernel_testlib import DEVICE, DTYPE, REL_TOL, rel_err

from forkserve.kernels import lora_expand, lora_shrink, reference

# Runs of adapters, a no-adapter run, an adapter that reappears later, a 20-token run.
TOKEN_ADAPTERS = [0] * 3 + [2] * 20 + [-1] * 2 + [1] + [0] * 5 + [2]


def _inputs(seed: int, in_dim: int, out_dim: int, r_max: int):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(TOKEN_ADAPTERS, dtype=torch.int32, device=DEVICE)
    x = torch.randn(idx.numel(), in_dim, generator=gen).to(DEVICE, DTYPE)
    a_all = (torch.randn(3, in_dim, r_max, generator=gen) / in_dim ** 0.5).to(DEVICE, DTYPE)
    b_all = torch.randn(3, r_max, out_dim, generator=gen).to(DEVICE, DTYPE)
    # Adapter 1 has rank 4 < r_max: zero padding, as the contract says.
    a_all[1, :, 4:] = 0
    b_all[1, 4:] = 0
    return idx, x, a_all, b_all


def test_shrink_and_expand() -> None:
    idx, x, a_all, b_all = _inputs(0, in_dim=200, out_dim=96, r_max=12)
    y = lora_shrink(x, a_all, idx, use_triton=True)
    y_ref = reference.lora_shrink_ref(x, a_all, idx)
    assert rel_err(y, y_ref) < REL_TOL
    assert torch.all(y[idx < 0] == 0)
    base = torch.randn(idx.numel(), 96,
                       generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    out = lora_expand(y_ref, b_all, idx, base.clone(), use_triton=True)
    out_ref = reference.lora_expand_ref(y_ref, b_all, idx, base.clone())
    assert rel_err(out, out_ref) < REL_TOL
    assert torch.equal(out[idx < 0], base[idx < 0])


def test_shrink_writes_residual_pages() -> None:
    """Disaggregated layout: x A_k goes straight into scattered slots of a paged pool."""
    idx, x, a_all, _ = _inputs(2, in_dim=64, out_dim=32, r_max=16)
    n_pages, page = 6, 16
    pool = torch.full((n_pages, page, 16), float("nan"), device=DEVICE, dtype=DTYPE)
    slots = torch.randperm(n_pages * page, generator=torch.Generator().manual_seed(3))[:idx.numel()]
    slots = slots.to(DEVICE, torch.int32)
    slots[idx < 0] = -1  # no adapter: no residual row
    lora_shrink(x, a_all, idx, out=pool, out_slots=slots, use_triton=True)
    y_ref = reference.lora_shrink_ref(x, a_all, idx)
    keep = idx >= 0
    rows = pool.view(-1, 16)[slots[keep].long()]
    assert rel_err(rows, y_ref[keep]) < REL_TOL
    assert int(torch.isnan(pool).flatten(0, 1).all(-1).sum()) == n_pages * page - int(keep.sum())
