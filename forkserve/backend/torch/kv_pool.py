"""Paged KV pools for the three layouts, and the bytes each layout costs per agent.

Shared layout contract (forkserve/kernels plugs in behind it):
  unified / full_reuse:  k, v        [layers, pages + 1, P, n_kv_heads, head_dim], K with RoPE
  disaggregated:         k, v        base pages, same shape: RoPE(x W_k (+b)) and x W_v
                         k_res, v_res [layers, residual_pages + 1, P, r_max]: x A_k, x A_v, no RoPE
                         k_own, v_own [recompute layers, residual_pages + 1, P, n_kv_heads,
                                       head_dim]:
                           selective recompute (``config.recompute_layers``): in those layers a
                           split item's own merged K/V (K with RoPE), beside its residual page
                         writer       [1, pages + 1, P] int32:
                           offset correction (``config.base_correction``):
                           who wrote each base slot (``base_correction.py``); one row, so that
                           it is indexed by page id on dim 1 as K/V are (copied with them)
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

UNKNOWN_WRITER = -1  # a base slot never written, or written by an adapter no longer resident


def page_kinds(layout: KVLayout) -> tuple[PageKind, ...]:
    return (PageKind.BASE, PageKind.RESIDUAL) if layout.has_residual_pool else (PageKind.UNIFIED,)


WRITER_TAG = torch.int32


def kv_bytes_per_token(cfg: ModelConfig, layout: KVLayout, lora_rank: int,
                       dtype: torch.dtype, recompute_layers: int = 0,
                       writer_tags: bool = False) -> dict[PageKind, int]:
    """Bytes one token occupies in each page kind, over all layers, K and V (a residual page
    also holds full K/V in each of the ``recompute_layers``, a base page its writer tags)."""
    item = torch.empty((), dtype=dtype).element_size()
    full = 2 * cfg.num_layers * cfg.kv_size * item
    if layout.has_residual_pool:
        own = 2 * recompute_layers * cfg.kv_size * item
        tag = torch.empty((), dtype=WRITER_TAG).element_size() if writer_tags else 0
        return {PageKind.BASE: full + tag,
                PageKind.RESIDUAL: 2 * cfg.num_layers * lora_rank * item + own}
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
    layer: int = 0
    # [pages + 1, P]: each base slot's writer tag (offset correction)
    writer: torch.Tensor | None = None


class KVPool:
    def __init__(self, cfg: ModelConfig, layout: KVLayout, page_size: int, num_pages: int,
                 num_residual_pages: int, lora_rank: int, device: torch.device, dtype: torch.dtype,
                 recompute_layers: Sequence[int] = (), writer_tags: bool = False) -> None:
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
        # Selective recompute: layer -> its row of k_own / v_own (empty: every layer shared).
        self.own_layers = {n: i for i, n in enumerate(recompute_layers)}
        self.k_own: torch.Tensor | None = None
        self.v_own: torch.Tensor | None = None
        if self.own_layers:
            if not layout.has_residual_pool:
                raise ValueError("recompute layers live in residual pages: the layout has none")
            bad = [n for n in recompute_layers if not 0 <= n < cfg.num_layers]
            if bad:
                raise ValueError(f"recompute layers {bad} outside the model's {cfg.num_layers} "
                                 "layers")
            own_shape = (len(recompute_layers), num_residual_pages + 1, page_size, cfg.num_kv_heads,
                         cfg.head_dim)
            self.k_own = torch.zeros(own_shape, device=device, dtype=dtype)
            self.v_own = torch.zeros(own_shape, device=device, dtype=dtype)
        self.writer: torch.Tensor | None = None
        if writer_tags:
            if not layout.has_residual_pool:
                raise ValueError("writer tags mark shared base pages: the layout has none")
            self.writer = torch.full((1, num_pages + 1, page_size), UNKNOWN_WRITER, device=device,
                                     dtype=WRITER_TAG)

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
                       None if self.v_res is None else self.v_res[n], n,
                       None if self.writer is None else self.writer[0])

    def tag_writes(self, slot_mapping: torch.Tensor, token_slot: torch.Tensor) -> None:
        """A step's base writes: each written slot's writer is the token's adapter slot + 1
        (0: the base model, which covers an aLoRA's tokens before its activation point)."""
        if self.writer is not None:
            self.writer.view(-1).index_copy_(0, slot_mapping, (token_slot + 1).to(WRITER_TAG))

    def forget_writer(self, slot: int) -> None:
        """An adapter left its slot: its pages' tags must not name the next one to take it."""
        if self.writer is not None:
            self.writer.masked_fill_(self.writer == slot + 1, UNKNOWN_WRITER)

    def own_layer(self, n: int) -> LayerKV | None:
        """Layer ``n``'s own-K/V store, indexed by residual page id, if ``n`` is recomputed:
        split items attend over it as unified items attend over their pages."""
        i = self.own_layers.get(n)
        return None if i is None else LayerKV(self.k_own[i], self.v_own[i])

    def tensors_of(self, kind: PageKind) -> tuple[torch.Tensor, torch.Tensor]:
        if kind not in page_kinds(self.layout):
            raise ValueError(f"page kind {kind.value!r} is not stored by the {self.layout.value} "
                             "layout")
        if kind is PageKind.RESIDUAL:
            return self.k_res, self.v_res
        return self.k, self.v

    def _stored(self, kind: PageKind) -> tuple[torch.Tensor, ...]:
        """Every tensor indexed by ``kind``'s page ids (dim 1): what a page holds."""
        if kind is PageKind.RESIDUAL:
            extra = (self.k_own, self.v_own) if self.k_own is not None else ()
        else:
            extra = (self.writer,) if self.writer is not None else ()
        return (*self.tensors_of(kind), *extra)

    def bytes_per_page(self, kind: PageKind) -> int:
        """Measured from the allocation (scratch page excluded)."""
        return sum(t.nbytes // t.shape[1] for t in self._stored(kind))

    def copy(self, kind: PageKind, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        stored = self._stored(kind)
        device = stored[0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        # Gather first, then scatter: a chain (a->b, b->c) copies the old b, as sequential
        # copies would not.
        for t in stored:
            t[:, dst] = t[:, src]
