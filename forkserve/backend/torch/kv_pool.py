"""Paged KV pools for the three layouts, and the bytes each layout costs per agent.

Shared layout contract (forkserve/kernels plugs in behind it):
  unified / full_reuse:  k, v        [layers, pages + 1, P, n_kv_heads, head_dim], K with RoPE
  disaggregated:         k, v        base pages, same shape: RoPE(x W_k (+b)) and x W_v
                         k_res, v_res [layers, residual_pages + 1, P, r_max]: x A_k, x A_v, no RoPE
Page ids are the control plane's; the one extra page at index `pages` is a scratch page
that padded rows of a CUDA-graph batch write into, so real pages are never touched by padding.
full_reuse stores exactly what unified stores; only the control plane's sharing differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from forkserve.backend.protocol import PageKind
from forkserve.backend.torch.model_config import ModelConfig
from forkserve.config import KVLayout


def page_kinds(layout: KVLayout) -> tuple[PageKind, ...]:
    return (PageKind.BASE, PageKind.RESIDUAL) if layout.has_residual_pool else (PageKind.UNIFIED,)


def kv_bytes_per_token(cfg: ModelConfig, layout: KVLayout, lora_rank: int,
                       dtype: torch.dtype) -> dict[PageKind, int]:
    """Bytes one token occupies in each page kind, over all layers, K and V."""
    item = torch.empty((), dtype=dtype).element_size()
    full = 2 * cfg.num_layers * cfg.kv_size * item
    if layout.has_residual_pool:
        return {PageKind.BASE: full, PageKind.RESIDUAL: 2 * cfg.num_layers * lora_rank * item}
    return {PageKind.UNIFIED: full}


def shared_context_kv_bytes(cfg: ModelConfig, layout: KVLayout, lora_rank: int, dtype: torch.dtype,
                            tokens: int, agents: int) -> int:
    """KV bytes for `agents` adapters that all hold the same `tokens`-token context.

    unified keeps one full copy per agent; disaggregated one shared base plus one rank-r
    residual per agent; full_reuse one shared merged copy. disaggregated / unified is
    seed 001's M_R = 1/N + r/n with n = n_kv_heads * head_dim.
    """
    per_token = kv_bytes_per_token(cfg, layout, lora_rank, dtype)
    if layout is KVLayout.UNIFIED:
        return agents * tokens * per_token[PageKind.UNIFIED]
    if layout is KVLayout.FULL_REUSE:
        return tokens * per_token[PageKind.UNIFIED]
    return tokens * per_token[PageKind.BASE] + agents * tokens * per_token[PageKind.RESIDUAL]


@dataclass(frozen=True)
class LayerKV:
    """One layer's views into the pools (what an attention backend reads and writes)."""

    k: torch.Tensor                     # [pages + 1, P, n_kv_heads, head_dim]
    v: torch.Tensor
    k_res: torch.Tensor | None = None   # [residual_pages + 1, P, r_max]
    v_res: torch.Tensor | None = None


class KVPool:
    def __init__(self, cfg: ModelConfig, layout: KVLayout, page_size: int, num_pages: int,
                 num_residual_pages: int, lora_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.layout, self.page_size = layout, page_size
        self.num_pages, self.num_residual_pages = num_pages, num_residual_pages
        self.lora_rank = lora_rank
        shape = (cfg.num_layers, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.k_res: torch.Tensor | None = None
        self.v_res: torch.Tensor | None = None
        if layout.has_residual_pool:
            res_shape = (cfg.num_layers, num_residual_pages + 1, page_size, lora_rank)
            self.k_res = torch.zeros(res_shape, device=device, dtype=dtype)
            self.v_res = torch.zeros(res_shape, device=device, dtype=dtype)

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def scratch_residual_page(self) -> int:
        return self.num_residual_pages

    def pages_of(self, kind: PageKind) -> int:
        return self.num_residual_pages if kind is PageKind.RESIDUAL else self.num_pages

    def layer(self, n: int) -> LayerKV:
        return LayerKV(self.k[n], self.v[n],
                       None if self.k_res is None else self.k_res[n],
                       None if self.v_res is None else self.v_res[n])

    def tensors_of(self, kind: PageKind) -> tuple[torch.Tensor, torch.Tensor]:
        if kind not in page_kinds(self.layout):
            raise ValueError(f"page kind {kind.value!r} is not stored by the {self.layout.value} layout")
        if kind is PageKind.RESIDUAL:
            return self.k_res, self.v_res
        return self.k, self.v

    def bytes_per_page(self, kind: PageKind) -> int:
        """Measured from the allocation (scratch page excluded)."""
        k, v = self.tensors_of(kind)
        return (k.nbytes + v.nbytes) // k.shape[1]

    def copy(self, kind: PageKind, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        k, v = self.tensors_of(kind)
        device = k.device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        # Gather first, then scatter: a chain (a->b, b->c) copies the old b, as sequential copies would not.
        for t in (k, v):
            t[:, dst] = t[:, src]
