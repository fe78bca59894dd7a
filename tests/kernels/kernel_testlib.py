"""Builders for paged test caches: NaN-poisoned pools, scattered pages, ragged lengths."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# The interpreter holds bf16 as raw integers (see shared/notes/triton-on-cpu.md): fp32 there.
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
# Relative Frobenius error bounds: bf16 operands land ~1e-3..1e-2, fp32 far under 1e-4.
REL_TOL = 2e-2 if ON_CUDA else 1e-4


def replays_as_eager(run) -> bool:
    """Whether ``run()`` captured in a CUDA graph and replayed gives exactly its eager
    output (a kernel's launch arguments all device-resident or fixed at capture)."""
    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    return torch.equal(captured, eager)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def where_wrong(out: torch.Tensor, ref: torch.Tensor, cu_seqlens_q: torch.Tensor,
                seq_lens: torch.Tensor, adapters: torch.Tensor, group: int) -> str:
    """Where a varlen prefill's ``out [tokens, H, D]`` leaves ``ref``, as a failure message
    that says more than one error figure (a kernel first run on the GPU, whose failing case
    should point at its cause): per sequence, its adapter, the rows (token, head) off by
    more than ``REL_TOL`` or not finite, the first such token's key position and its place in
    a 64- and a 128-key tile, and the KV heads they fall in."""
    out64, ref64 = out.to(torch.float64).cpu(), ref.to(torch.float64).cpu()
    row_err = ((out64 - ref64).norm(dim=-1) / ref64.norm(dim=-1).clamp_min(1e-30))
    not_finite = ~torch.isfinite(out64).all(dim=-1)
    bad = not_finite | (row_err > REL_TOL)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    lines = [f"rel err {rel_err(out, ref):.3g}; rows off: {int(bad.sum())} of {bad.numel()} "
             f"({int(not_finite.sum())} not finite)"]
    for b, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        seq_bad = bad[lo:hi]
        if not seq_bad.any():
            continue
        tok, _ = seq_bad.nonzero()[0].tolist()
        pos = lens[b] - (hi - lo) + tok
        kv_heads = sorted({h // group for h in seq_bad.nonzero()[:, 1].tolist()})
        lines.append(f"seq {b} (adapter {int(adapters[b])}, {hi - lo} new of {lens[b]}): "
                     f"{int(seq_bad.sum())} rows off, worst {row_err[lo:hi].max():.3g}; "
                     f"first at token {tok} (key position {pos}: {pos % 64} in its 64-key "
                     f"tile, {pos % 128} in its 128), KV heads {kv_heads}")
    return "\n".join(lines)


@dataclass
class PagedCache:
    """One layer's paged caches for a batch; pages not owned by any sequence are NaN."""

    k: torch.Tensor
    v: torch.Tensor
    k_res: torch.Tensor
    v_res: torch.Tensor
    block_tables: torch.Tensor
    res_block_tables: torch.Tensor
    seq_lens: torch.Tensor


def _scatter_tables(gen: torch.Generator, seq_lens: list[int], page_size: int,
                    extra_pages: int) -> tuple[torch.Tensor, int]:
    """Block tables over a shuffled page pool; unused entries point at a NaN page."""
    need = [-(-n // page_size) for n in seq_lens]
    total = sum(need) + extra_pages
    perm = torch.randperm(total, generator=gen).tolist()
    width = max(need) + 1
    table = torch.full((len(seq_lens), width), perm[-1], dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    return table, total


def make_cache(gen: torch.Generator, seq_lens: list[int], n_kv: int, head_dim: int, rank: int,
               page_size: int = 16, dtype: torch.dtype = DTYPE,
               shared_prefix_pages: int = 0) -> PagedCache:
    """Random caches for ``seq_lens``; the first ``shared_prefix_pages`` table entries of
    every sequence are the same pages (a forked prefix)."""
    table, n_pages = _scatter_tables(gen, seq_lens, page_size, extra_pages=2)
    if shared_prefix_pages:
        table[:, :shared_prefix_pages] = table[0, :shared_prefix_pages]
    res_table, n_res = _scatter_tables(gen, seq_lens, page_size, extra_pages=2)

    def pool(n: int, *shape: int) -> torch.Tensor:
        x = torch.full((n, page_size, *shape), float("nan"), dtype=torch.float32)
        return x

    k, v = pool(n_pages, n_kv, head_dim), pool(n_pages, n_kv, head_dim)
    kr, vr = pool(n_res, rank), pool(n_res, rank)
    for b, n in enumerate(seq_lens):
        for i in range(-(-n // page_size)):
            rows = min(page_size, n - i * page_size)
            # Poison the tail of the last page too: reads past seq_len must be masked.
            p, rp = int(table[b, i]), int(res_table[b, i])
            if torch.isnan(k[p, :rows]).any():
                k[p, :rows] = torch.randn(rows, n_kv, head_dim, generator=gen)
                v[p, :rows] = torch.randn(rows, n_kv, head_dim, generator=gen)
            kr[rp, :rows] = torch.randn(rows, rank, generator=gen)
            vr[rp, :rows] = torch.randn(rows, rank, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    return PagedCache(k.to(**to), v.to(**to), kr.to(**to), vr.to(**to), table.to(DEVICE),
                      res_table.to(DEVICE),
                      torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def make_adapters(gen: torch.Generator, n_adapters: int, rank: int, n_kv: int, head_dim: int,
                  scale: float = 0.5,
                  dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked, already-scaled B_k, B_v ``[n_adapters, rank, n_kv * head_dim]``."""
    shape = (n_adapters, rank, n_kv * head_dim)
    b_k = torch.randn(*shape, generator=gen) * scale
    b_v = torch.randn(*shape, generator=gen) * scale
    return b_k.to(DEVICE, dtype), b_v.to(DEVICE, dtype)


def residual_inputs(seed: int, seq_lens: list[int], n_kv: int, head_dim: int = 32,
                    rank: int = 8, r_max: int = 12, b_scale: float = 0.5):
    """A paged cache with residual pools of rank ``r_max`` and three adapters: 0 and 2 of
    rank ``r_max``, 1 of rank ``rank`` (its padding rows of B zero, as the contract says);
    rows take adapters 0, 2, none, 1 in turn. Returns the generator (for queries drawn
    after), the cache, ``B_k, B_v``, the rows' adapter slots and RoPE's inverse
    frequencies."""
    from forkserve.kernels.rope import default_inv_freq

    gen = torch.Generator().manual_seed(seed)
    c = make_cache(gen, seq_lens, n_kv, head_dim, rank=r_max)
    b_k, b_v = make_adapters(gen, 3, r_max, n_kv, head_dim, scale=b_scale)
    b_k[1, rank:] = 0
    b_v[1, rank:] = 0
    adapters = torch.tensor([(0, 2, -1, 1)[i % 4] for i in range(len(seq_lens))],
                            dtype=torch.int32, device=DEVICE)
    return gen, c, b_k, b_v, adapters, default_inv_freq(head_dim, device=DEVICE)
