"""Attention through forkserve.kernels (Triton on CUDA): the fast path behind the eager one.

Same pools, same metadata, same AttentionBackend protocol as attention.EagerAttention; the
decode kernels read pages in place instead of gathering them, and ResidualAttention
reconstructs disaggregated K/V in on-chip memory. A prefill batch takes the route its
``PrefillAttentionPolicy`` picks from the step's host counts (kernels/prefill_policy.py): the
Triton paged kernels, K/V packed per layer call (rebuilt in the residual form) and a library
flash kernel, or (unified form) FlashAttention-4 reading the pages itself (``PAGED_FLASH``);
before that, the sequences the policy's ``fresh_items`` names (no cached prefix, every row's
K/V this step's own) attend over the step's own K/V (``fresh_prefill.py``), and the groups of
chunks over one shared prefix that the policy's ``cascade_group`` names read it once per
group (``cascade_prefill.py``, unified form), the rest keeping the batch route. The library
kernel (``kernels.flash_support``) is looked up once per step and travels in its plan. A
prefill step's one-token sequences (decode rows riding in a mixed tick) go to the decode
kernels instead (``step_rows.py``). Off CUDA the kernels package runs its own eager
references unless ``use_triton=True`` (the CPU tests run the kernels under the interpreter).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import torch

from forkserve import kernels
from forkserve.backend.torch.attention import AttentionMetadata, write_kv
from forkserve.backend.torch.cascade_prefill import CascadePart, cascade_part
from forkserve.backend.torch.fresh_prefill import FreshRows, fresh_prefill, fresh_rows, take
from forkserve.backend.torch.kv_pool import LayerKV
from forkserve.backend.torch.rope import Rope
from forkserve.backend.torch.step_rows import StepRows, prefill_part, split_rows


class _PrefillPlan(NamedTuple):
    """What every layer call of one prefill step shares, worked out at its first layer."""

    meta: AttentionMetadata
    residual: bool
    rows: StepRows | None          # its decode rows cut out, or None
    fresh: FreshRows | None        # the sequences on the FRESH route, or None
    cascade: CascadePart | None    # the groups on the CASCADE route, or None
    routed_q: torch.Tensor | None  # rows of q of the sequences on ``route`` (None: every row)
    view: AttentionMetadata | None  # those sequences (None: none left)
    counts: kernels.PrefillCounts | None  # of those sequences
    route: kernels.PrefillRoute | None
    slots: torch.Tensor | None     # their adapter index as int32 (residual form)
    triton: bool                   # the kernels run (else the kernels package's references)
    flash: kernels.FlashSupport | None  # the library flash kernel for these inputs (Triton path)


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
        write_kv(kv, k, v, k_res, v_res, meta, self.use_triton)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # make_attention refuses yarn-scaled RoPE with this backend in the disaggregated layout.
        residual = kv.k_res is not None and meta.res_block_tables is not None and (
            b_k is not None or b_v is not None)
        if meta.decode_only:
            out = self._decode(q, kv, b_k, b_v, meta, rope, scale, residual)
        else:
            plan = self._plan(q, kv, meta, residual)
            if plan.rows is None and plan.fresh is None and plan.cascade is None:
                out = self._prefill(q, kv, b_k, b_v, plan, rope, scale, residual)
            else:
                out = self._parts(q, k, v, k_res, v_res, kv, b_k, b_v, plan, rope, scale,
                                  residual)
        return out.reshape(q.shape[0], -1)

    def _parts(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               k_res: torch.Tensor | None, v_res: torch.Tensor | None, kv: LayerKV,
               b_k: torch.Tensor | None, b_v: torch.Tensor | None, plan: _PrefillPlan,
               rope: Rope, scale: float, residual: bool) -> torch.Tensor:
        """A step cut in parts: FRESH sequences, CASCADE groups, those on the batch route,
        decode rows."""
        out = None
        fresh = plan.fresh
        if fresh is not None:
            self.prefill_routes[kernels.PrefillRoute.FRESH.value] += 1
            if k is None or v is None or k.shape[0] != q.shape[0]:
                raise ValueError("the FRESH route needs every row's own K/V")
            res = dict(k_res=take(k_res, fresh.rows), v_res=take(v_res, fresh.rows), b_k=b_k,
                       b_v=b_v, slots=fresh.slots,
                       cos_sin=fresh.cos_sin(rope, q.dtype, q.device)) if residual else {}
            o = fresh_prefill(take(q, fresh.rows), take(k, fresh.rows), take(v, fresh.rows),
                              fresh.query_lens, scale, **res, use_triton=self.use_triton,
                              flash=plan.flash, cu_seqlens=fresh.cu_seqlens(q.device))
            if fresh.tokens == q.shape[0]:
                out = o
            else:
                out = q.new_empty(q.shape)
                out[fresh.rows] = o
        if out is None:
            out = q.new_empty(q.shape)
        cascade = plan.cascade
        if cascade is not None:
            self.prefill_routes[kernels.PrefillRoute.CASCADE.value] += 1
            out[cascade.rows] = cascade.attend(q.index_select(0, cascade.rows), kv, scale,
                                               self.use_triton)
        if plan.view is not None:
            out[plan.routed_q] = self._prefill(q.index_select(0, plan.routed_q), kv, b_k, b_v,
                                               plan, rope, scale, residual)
        rows = plan.rows
        if rows is not None:
            self.prefill_routes["decode_rows"] += 1
            out[rows.decode_q] = self._decode(q.index_select(0, rows.decode_q), kv, b_k, b_v,
                                              rows.decode, rope, scale, residual)
        return out

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
        reuse it. The one place that picks FRESH sequences and CASCADE groups: FRESH where
        every row of the step wrote its own K/V (``base_writes`` None), the policy's
        ``fresh_items`` among the prefill sequences; in the residual form a split sequence
        only where every row also wrote its residual (``res_writes`` None: the rows this
        step holds are the ones in the pool). CASCADE, in the unified form, for the groups
        of the sequences left (the control plane's marks) that the policy's
        ``cascade_group`` names; the split form attends every chunk on its own route."""
        step = self._step
        if step is None or step.meta is not meta or step.residual is not residual:
            triton = q.is_cuda if self.use_triton is None else self.use_triton
            support = kernels.flash_support(q, kv.k) if triton else None
            rows = split_rows(meta)
            view = meta if rows is None else rows.prefill
            lens = meta.query_lens_host
            seqs = list(range(len(lens))) if rows is None else [
                i for i, n in enumerate(lens) if n != 1]
            counts = kernels.PrefillCounts(view.query_lens_host, view.seq_lens_host)
            fresh, routed_q = None, None if rows is None else rows.prefill_q
            rest = seqs
            if meta.base_writes is None:
                pick = self.prefill_policy.fresh_items(counts, residual)
                if residual and meta.res_writes is not None:
                    pick = tuple(p and view.seq_slot_host[j] < 0 for j, p in enumerate(pick))
                if any(pick):
                    fresh = fresh_rows(meta, [i for i, p in zip(seqs, pick, strict=True) if p])
                    rest = [i for i, p in zip(seqs, pick, strict=True) if not p and lens[i]]
            cascade = None if residual or not meta.shared_prefix_host else cascade_part(
                meta, rest, kv.k.shape[1], self.prefill_policy, (q.shape[1], kv.k.shape[2]))
            if cascade is not None:
                rest = [i for i in rest if i not in cascade.members]
            if fresh is not None or cascade is not None:
                view = None
                if rest:
                    routed_q, view = prefill_part(meta, rest)
                    counts = kernels.PrefillCounts(view.query_lens_host, view.seq_lens_host)
            route = slots = None
            if view is not None:
                found = kernels.prefill_kernels(q, kv.k, kv.k_res if residual else None,
                                                support) if support else kernels.PrefillKernels()
                route = self.prefill_policy.route(counts, residual, found)
                slots = view.seq_slot.to(torch.int32) if residual else None
            step = self._step = _PrefillPlan(meta, residual, rows, fresh, cascade, routed_q,
                                             view, counts if view is not None else None, route,
                                             slots, triton, support)
        return step

    def _prefill(self, q: torch.Tensor, kv: LayerKV, b_k: torch.Tensor | None,
                 b_v: torch.Tensor | None, plan: _PrefillPlan, rope: Rope, scale: float,
                 residual: bool) -> torch.Tensor:
        """The plan's routed sequences (``plan.view``), q holding only their rows."""
        view, counts, route, slots = plan.view, plan.counts, plan.route, plan.slots
        # Off the Triton path the kernels package runs its eager reference whatever the route.
        self.prefill_routes[route.value if plan.triton else "reference"] += 1
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
