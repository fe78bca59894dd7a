"""Attention through forkserve.kernels (Triton on CUDA): the fast path behind the eager one.

Same pools, same metadata, same AttentionBackend protocol as attention.EagerAttention; the
decode kernels read pages in place instead of gathering them, and ResidualAttention
reconstructs disaggregated K/V in on-chip memory. A prefill batch takes the route its
``PrefillAttentionPolicy`` picks from the step's host counts (kernels/prefill_policy.py): the
Triton paged kernels, or K/V packed per layer call (rebuilt in the residual form) and
FlashAttention-2. A prefill step's one-token sequences (decode rows riding in a mixed tick)
go to the decode kernels instead (``step_rows.py``). Off CUDA the kernels package runs its own
eager references unless ``use_triton=True`` (the CPU tests run the kernels under the
interpreter).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import torch

from forkserve import kernels
from forkserve.backend.torch.attention import AttentionMetadata, write_kv
from forkserve.backend.torch.kv_pool import LayerKV
from forkserve.backend.torch.rope import Rope
from forkserve.backend.torch.step_rows import StepRows, split_rows


class _PrefillPlan(NamedTuple):
    """What every layer call of one prefill step shares, worked out at its first layer."""

    meta: AttentionMetadata
    residual: bool
    rows: StepRows | None          # its decode rows cut out, or None
    counts: kernels.PrefillCounts  # of the sequences that prefill
    route: kernels.PrefillRoute
    slots: torch.Tensor | None     # their adapter index as int32 (residual form)
    triton: bool                   # the kernels run (else the kernels package's references)


class KernelAttention:
    """``prefill_routes`` counts the prefill layer calls per route taken (what the benchmarks
    report as the path that ran; ``decode_rows``: calls whose one-token sequences took the
    decode kernels); the policy itself holds no state."""

    def __init__(self, use_triton: bool | None = None,
                 prefill_policy: kernels.PrefillAttentionPolicy | None = None) -> None:
        self.use_triton = use_triton
        self.prefill_policy = prefill_policy or kernels.CostPrefillPolicy()
        self.prefill_routes: Counter[str] = Counter()
        self._zeros: dict[tuple, torch.Tensor] = {}
        self._step: _PrefillPlan | None = None

    def _or_zeros(self, b: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """A zero B stack for a projection no adapter targets (the kernel always reads both)."""
        if b is not None:
            return b
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._zeros:
            self._zeros[key] = torch.zeros_like(like)
        return self._zeros[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_res: torch.Tensor | None, v_res: torch.Tensor | None, kv: LayerKV,
                b_k: torch.Tensor | None, b_v: torch.Tensor | None,
                meta: AttentionMetadata, rope: Rope) -> torch.Tensor:
        write_kv(kv, k, v, k_res, v_res, meta)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # make_attention refuses yarn-scaled RoPE with this backend in the disaggregated layout.
        residual = kv.k_res is not None and meta.res_block_tables is not None and (
            b_k is not None or b_v is not None)
        if meta.decode_only:
            out = self._decode(q, kv, b_k, b_v, meta, rope, scale, residual)
        else:
            rows = self._plan(q, kv, meta, residual).rows
            if rows is None:
                out = self._prefill(q, kv, b_k, b_v, meta, rope, scale, residual)
            else:
                self.prefill_routes["decode_rows"] += 1
                out = q.new_empty(q.shape)
                out[rows.prefill_q] = self._prefill(q.index_select(0, rows.prefill_q), kv, b_k,
                                                    b_v, meta, rope, scale, residual)
                out[rows.decode_q] = self._decode(q.index_select(0, rows.decode_q), kv, b_k, b_v,
                                                  rows.decode, rope, scale, residual)
        return out.reshape(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, kv: LayerKV, b_k: torch.Tensor | None,
                b_v: torch.Tensor | None, meta: AttentionMetadata, rope: Rope, scale: float,
                residual: bool) -> torch.Tensor:
        page_size = kv.k.shape[1]
        # A host-free bound (the padded table width) keeps decode capturable in a CUDA graph.
        # Unified decode's dynamic plan only caps its split count by it (each program splits
        # its own sequence's keys on the device), so a wide bucket costs empty programs, not
        # long splits; the residual and cascade plans still cut splits from it.
        tuning = {"max_seq_len": meta.block_tables.shape[1] * page_size} if q.is_cuda else {}
        if residual:
            ref = b_k if b_k is not None else b_v
            args = (q, kv.k, kv.v, kv.k_res, kv.v_res, meta.block_tables, meta.res_block_tables,
                    meta.seq_lens, self._or_zeros(b_k, ref), self._or_zeros(b_v, ref),
                    meta.seq_slot.to(torch.int32), rope.inv_freq)
            if meta.cascade is not None:
                # split form: shared base pages, each row's own residual
                c = meta.cascade
                return kernels.cascade_residual_decode(*args, c.tile_seqs, c.tile_lens,
                                                       c.kv_starts, scale,
                                                       use_triton=self.use_triton, **tuning)
            return kernels.residual_decode(*args, scale, use_triton=self.use_triton, **tuning)
        if meta.cascade is not None:
            c = meta.cascade
            return kernels.cascade_decode(q, kv.k, kv.v, meta.block_tables, meta.seq_lens,
                                          c.tile_seqs, c.tile_lens, c.kv_starts, scale,
                                          use_triton=self.use_triton, **tuning)
        return kernels.paged_decode(q, kv.k, kv.v, meta.block_tables, meta.seq_lens, scale,
                                    use_triton=self.use_triton, **tuning)

    def _plan(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
              residual: bool) -> _PrefillPlan:
        """The step's plan, made at its first layer call: the same metadata object and form
        reuse it."""
        step = self._step
        if step is None or step.meta is not meta or step.residual is not residual:
            triton = q.is_cuda if self.use_triton is None else self.use_triton
            rows = split_rows(meta)
            view = meta if rows is None else rows.prefill
            counts = kernels.PrefillCounts(view.query_lens_host, view.seq_lens_host)
            flash = triton and kernels.flash_support(q, kv.k).varlen
            route = self.prefill_policy.route(counts, residual, flash)
            slots = view.seq_slot.to(torch.int32) if residual else None
            step = self._step = _PrefillPlan(meta, residual, rows, counts, route, slots, triton)
        return step

    def _prefill(self, q: torch.Tensor, kv: LayerKV, b_k: torch.Tensor | None,
                 b_v: torch.Tensor | None, meta: AttentionMetadata, rope: Rope, scale: float,
                 residual: bool) -> torch.Tensor:
        """The sequences of ``meta`` with more than one new token (all of them where the
        step has no decode rows), q holding only their rows."""
        _, _, rows, counts, route, slots, triton = self._plan(q, kv, meta, residual)
        view = meta if rows is None else rows.prefill
        # Off the Triton path the kernels package runs its eager reference whatever the route.
        self.prefill_routes[route.value if triton else "reference"] += 1
        if residual:
            ref = b_k if b_k is not None else b_v
            return kernels.residual_prefill(
                q, kv.k, kv.v, kv.k_res, kv.v_res, view.block_tables, view.res_block_tables,
                view.seq_lens, view.query_starts, self._or_zeros(b_k, ref),
                self._or_zeros(b_v, ref), slots, rope.inv_freq, scale,
                use_triton=self.use_triton, variant=route, counts=counts)
        return kernels.paged_prefill(q, kv.k, kv.v, view.block_tables, view.seq_lens,
                                     view.query_starts, scale, use_triton=self.use_triton,
                                     variant=route, counts=counts)
