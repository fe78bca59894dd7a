"""Attention through forkserve.kernels (Triton on CUDA): the fast path behind the eager one.

Same pools, same metadata, same AttentionBackend protocol as attention.EagerAttention; the
decode kernels read pages in place instead of gathering them, and ResidualAttention
reconstructs disaggregated K/V in on-chip memory. A prefill batch takes the route its
``PrefillAttentionPolicy`` picks from the step's host counts (kernels/prefill_policy.py): the
Triton paged kernels, or K/V packed per layer call (rebuilt in the residual form) and
FlashAttention-2. Off CUDA the kernels package runs its own eager references unless
``use_triton=True`` (the CPU tests run the kernels under the interpreter).
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from forkserve import kernels
from forkserve.backend.torch.attention import AttentionMetadata, write_kv
from forkserve.backend.torch.kv_pool import LayerKV
from forkserve.backend.torch.rope import Rope


class KernelAttention:
    """``prefill_routes`` counts the prefill layer calls per route taken (what the benchmarks
    report as the path that ran); the policy itself holds no state."""

    def __init__(self, use_triton: bool | None = None,
                 prefill_policy: kernels.PrefillAttentionPolicy | None = None) -> None:
        self.use_triton = use_triton
        self.prefill_policy = prefill_policy or kernels.CostPrefillPolicy()
        self.prefill_routes: Counter[str] = Counter()
        self._zeros: dict[tuple, torch.Tensor] = {}
        # What every layer call of one prefill step shares, worked out at its first layer:
        # (meta, host counts, route, adapter index as int32, residual form).
        self._step: tuple | None = None

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
        page_size = kv.k.shape[1]
        # make_attention refuses yarn-scaled RoPE with this backend in the disaggregated layout.
        residual = kv.k_res is not None and meta.res_block_tables is not None and (
            b_k is not None or b_v is not None)
        if meta.decode_only:
            # A host-free bound (the padded table width) keeps decode capturable in a CUDA graph.
            tuning = {"max_seq_len": meta.block_tables.shape[1] * page_size} if q.is_cuda else {}
            if residual:
                ref = b_k if b_k is not None else b_v
                args = (q, kv.k, kv.v, kv.k_res, kv.v_res, meta.block_tables, meta.res_block_tables,
                        meta.seq_lens, self._or_zeros(b_k, ref), self._or_zeros(b_v, ref),
                        meta.seq_slot.to(torch.int32), rope.inv_freq)
                if meta.cascade is not None:
                    # split form: shared base pages, each row's own residual
                    c = meta.cascade
                    out = kernels.cascade_residual_decode(*args, c.tile_seqs, c.tile_lens,
                                                          c.kv_starts, scale,
                                                          use_triton=self.use_triton, **tuning)
                else:
                    out = kernels.residual_decode(*args, scale, use_triton=self.use_triton,
                                                  **tuning)
            elif meta.cascade is not None:
                c = meta.cascade
                out = kernels.cascade_decode(q, kv.k, kv.v, meta.block_tables, meta.seq_lens,
                                             c.tile_seqs, c.tile_lens, c.kv_starts, scale,
                                             use_triton=self.use_triton, **tuning)
            else:
                out = kernels.paged_decode(q, kv.k, kv.v, meta.block_tables, meta.seq_lens, scale,
                                           use_triton=self.use_triton, **tuning)
        else:
            out = self._prefill(q, kv, b_k, b_v, meta, rope, scale, residual)
        return out.reshape(q.shape[0], -1)

    def _prefill(self, q: torch.Tensor, kv: LayerKV, b_k: torch.Tensor | None,
                 b_v: torch.Tensor | None, meta: AttentionMetadata, rope: Rope, scale: float,
                 residual: bool) -> torch.Tensor:
        triton = q.is_cuda if self.use_triton is None else self.use_triton
        step = self._step
        # The same step's metadata object and form: its counts and route are the first layer's.
        if step is None or step[0] is not meta or step[4] is not residual:
            counts = kernels.PrefillCounts(meta.query_lens_host, meta.seq_lens_host)
            flash = triton and kernels.flash_support(q, kv.k).varlen
            route = self.prefill_policy.route(counts, residual, flash)
            slots = meta.seq_slot.to(torch.int32) if residual else None
            step = self._step = (meta, counts, route, slots, residual)
        _, counts, route, slots, _ = step
        # Off the Triton path the kernels package runs its eager reference whatever the route.
        self.prefill_routes[route.value if triton else "reference"] += 1
        if residual:
            ref = b_k if b_k is not None else b_v
            return kernels.residual_prefill(
                q, kv.k, kv.v, kv.k_res, kv.v_res, meta.block_tables, meta.res_block_tables,
                meta.seq_lens, meta.query_starts, self._or_zeros(b_k, ref),
                self._or_zeros(b_v, ref), slots, rope.inv_freq, scale,
                use_triton=self.use_triton, variant=route, counts=counts)
        return kernels.paged_prefill(q, kv.k, kv.v, meta.block_tables, meta.seq_lens,
                                     meta.query_starts, scale, use_triton=self.use_triton,
                                     variant=route, counts=counts)
