"""Paged attention over the three layouts: the eager PyTorch reference (and CPU) path.

An attention backend writes this step's K/V (and residuals) into the pools, then attends
each query over its sequence's pages. Disaggregated pages are reconstructed on read:

    K = K_base + RoPE(K_res @ B_k[adapter])   (RoPE at the cached tokens' absolute positions)
    V = V_base + V_res @ B_v[adapter]

Triton kernels (forkserve/kernels) implement the same `AttentionBackend` protocol over the
same pools and metadata; this file is what they are checked against. Offset correction
(``base_correction.py``, docs/QUALITY.md mode d) runs here only: a split item's base K/V
from another writer is corrected before its residual is added (the kernels do not read the
writer tags; the backend refuses them with a correction on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from forkserve import kernels
from forkserve.backend.protocol import SharedPrefix
from forkserve.backend.torch.base_correction import Correction, NoCorrection
from forkserve.backend.torch.cascade import CascadeTiles
from forkserve.backend.torch.kv_pool import LayerKV
from forkserve.backend.torch.rope import Rope, apply_rope


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a flattened batch of T tokens over B sequences reads and writes KV."""

    slot_mapping: torch.Tensor              # [T] int64: page * P + offset of each new token
    res_slot_mapping: torch.Tensor | None   # [T] int64 into the residual pool (split items present)
    block_tables: torch.Tensor              # [B, max_pages] int32, padded with the scratch page
    res_block_tables: torch.Tensor | None   # [B, max_res_pages] int32
    seq_lens: torch.Tensor                  # [B] int32: tokens in cache after this step
    query_starts: torch.Tensor              # [B + 1] int32: offsets of each sequence's tokens
    seq_slot: torch.Tensor                  # [B] int64: slot whose B_k/B_v rebuild K/V, -1 none
    query_lens_host: tuple[int, ...]        # host copies for the ragged (prefill) loop
    seq_lens_host: tuple[int, ...]
    seq_slot_host: tuple[int, ...]
    decode_only: bool                       # every sequence has exactly one new token
    # base_activations: rows of T whose activations also fill other adapters' residuals.
    extra_rows: torch.Tensor | None = None              # [E] int64 token rows (repeated per target)
    extra_token_slot: torch.Tensor | None = None        # [E] int64 the target adapter's slot
    extra_res_slot_mapping: torch.Tensor | None = None  # [E] int64 into the residual pool
    # Adaptive layout, a batch of split and merged items: [T, 1] bool, the merged items'
    # tokens (their k/v LoRA delta is added to K/V; the split items' goes to the residual).
    kv_merge_mask: torch.Tensor | None = None
    # Cascade attention: shared prefixes read once per tile, over the step's one-token
    # sequences in their order (every sequence of a decode batch; in a prefill step, the
    # decode rows its attention cuts out, step_rows.py). Eager attention ignores it (the
    # same result, each prefix read per sequence).
    cascade: CascadeTiles | None = None
    # Each sequence's ``SeqWork.shared_prefix`` (host; empty: none marked, or cascade off): a
    # prefill step's groups of chunks over one prefix (kernel_attention.py's ``_plan``).
    shared_prefix_host: tuple[SharedPrefix | None, ...] = ()
    # The rows of T that write base K/V (``res_writes``: residuals), as (rows [W] int64, their
    # slots [W] int64); None: every row writes at its slot_mapping (res_slot_mapping). A
    # batch where some item reads a side already present (write_base / write_residual False,
    # or no residual at all) names the others, rather than sending every such token's write
    # to one scratch slot (on a GPU, a contended scatter as large as the batch).
    base_writes: tuple[torch.Tensor, torch.Tensor] | None = None
    res_writes: tuple[torch.Tensor, torch.Tensor] | None = None


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_res: torch.Tensor | None, v_res: torch.Tensor | None, kv: LayerKV,
                b_k: torch.Tensor | None, b_v: torch.Tensor | None,
                meta: AttentionMetadata, rope: Rope) -> torch.Tensor:
        """q [T, Hq, D], k/v [W, Hkv, D] (K with RoPE) of the W rows that write base K/V
        (``meta.base_writes``; W = T where None; None where no row writes them: every key is
        read from the pages), k_res/v_res [T, r_max]; b_k/b_v [slots, r_max, Hkv * D]
        (pre-scaled). Returns [T, Hq * D]."""


def write_kv(kv: LayerKV, k: torch.Tensor | None, v: torch.Tensor | None,
             k_res: torch.Tensor | None, v_res: torch.Tensor | None,
             meta: AttentionMetadata, use_triton: bool | None = False) -> None:
    """This step's K/V and residuals into the layer's pools. K/V hold the rows of
    ``meta.base_writes`` only (every row where None; None where no row writes them); the
    residuals every row, of which ``meta.res_writes`` names those written. ``use_triton``:
    K and V in one Triton launch (``kernels.write_kv_pages``; None: on CUDA tensors) instead
    of two ``index_copy_``."""
    if k is not None and v is not None and k.shape[0]:
        slots = meta.slot_mapping if meta.base_writes is None else meta.base_writes[1]
        kernels.write_kv_pages(k, v, kv.k, kv.v, slots, use_triton=use_triton)
    writes = meta.res_writes
    if writes is not None and not writes[0].shape[0]:  # a host count: no write, no launch
        return
    for res, pool in ((k_res, kv.k_res), (v_res, kv.v_res)):
        if res is not None and pool is not None:
            rows = pool.view(-1, pool.shape[-1])
            if writes is None:
                rows.index_copy_(0, meta.res_slot_mapping, res)
            else:
                rows.index_copy_(0, writes[1], res.index_select(0, writes[0]))


class EagerAttention:
    """Pure-PyTorch paged attention: batched gather for decode (graph-capturable), a loop
    for prefill."""

    def __init__(self, correction: Correction | None = None) -> None:
        self.correction = correction or NoCorrection()

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_res: torch.Tensor | None, v_res: torch.Tensor | None, kv: LayerKV,
                b_k: torch.Tensor | None, b_v: torch.Tensor | None,
                meta: AttentionMetadata, rope: Rope) -> torch.Tensor:
        write_kv(kv, k, v, k_res, v_res, meta)
        if meta.decode_only:
            return self._decode(q, kv, b_k, b_v, meta, rope)
        return self._ragged(q, kv, b_k, b_v, meta, rope)

    def _decode(self, q: torch.Tensor, kv: LayerKV, b_k: torch.Tensor | None,
                b_v: torch.Tensor | None, meta: AttentionMetadata, rope: Rope) -> torch.Tensor:
        # Fixed shapes from block_tables alone (no host values), so CUDA graphs can replay it.
        batch, heads, dim = q.shape
        kv_heads = kv.k.shape[2]
        seq = meta.block_tables.shape[1] * kv.k.shape[1]
        pages = meta.block_tables.long()
        keys = kv.k[pages].view(batch, seq, kv_heads, dim)
        values = kv.v[pages].view(batch, seq, kv_heads, dim)
        if kv.writer is not None and meta.res_block_tables is not None:
            keys, values = self.correction.correct(keys, values, kv.writer[pages].view(batch, seq),
                                                   meta.seq_slot, kv.layer, rope)
        if kv.k_res is not None and meta.res_block_tables is not None:
            res_pages = meta.res_block_tables.long()
            has = (meta.seq_slot >= 0).view(batch, 1, 1, 1)
            slot = meta.seq_slot.clamp(min=0)
            if b_k is not None:
                delta = (kv.k_res[res_pages].view(batch, seq, -1) @ b_k[slot]).view(
                    batch, seq, kv_heads, dim)
                cos, sin = rope.cos_sin(torch.arange(seq, device=q.device), q.dtype)
                keys = torch.where(has, keys + apply_rope(delta, cos, sin), keys)
            if b_v is not None:
                delta = (kv.v_res[res_pages].view(batch, seq, -1) @ b_v[slot]).view(
                    batch, seq, kv_heads, dim)
                values = torch.where(has, values + delta, values)
        group = heads // kv_heads
        qg = q.view(batch, kv_heads, group, dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * (1.0 / math.sqrt(dim))
        valid = torch.arange(seq, device=q.device)[None, :] < meta.seq_lens[:, None]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))
        return out.reshape(batch, heads * dim)

    def _ragged(self, q: torch.Tensor, kv: LayerKV, b_k: torch.Tensor | None,
                b_v: torch.Tensor | None, meta: AttentionMetadata, rope: Rope) -> torch.Tensor:
        page_size, kv_heads, dim = kv.k.shape[1], kv.k.shape[2], kv.k.shape[3]
        heads = q.shape[1]
        outs = []
        start = 0
        lens = zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
        for i, (qlen, slen) in enumerate(lens):
            n_pages = -(-slen // page_size)
            pages = meta.block_tables[i, :n_pages].long()
            keys = kv.k[pages].reshape(-1, kv_heads, dim)[:slen]
            values = kv.v[pages].reshape(-1, kv_heads, dim)[:slen]
            slot = meta.seq_slot_host[i]
            if kv.writer is not None and slot >= 0:
                keys, values = self.correction.correct(
                    keys, values, kv.writer[pages].reshape(-1)[:slen], meta.seq_slot[i],
                    kv.layer, rope)
            if kv.k_res is not None and meta.res_block_tables is not None and slot >= 0:
                res_pages = meta.res_block_tables[i, :n_pages].long()
                if b_k is not None:
                    delta = (kv.k_res[res_pages].reshape(-1, kv.k_res.shape[-1])[:slen]
                             @ b_k[slot]).view(slen, kv_heads, dim)
                    cos, sin = rope.cos_sin(torch.arange(slen, device=q.device), q.dtype)
                    keys = keys + apply_rope(delta, cos, sin)
                if b_v is not None:
                    delta = kv.v_res[res_pages].reshape(-1, kv.v_res.shape[-1])[:slen] @ b_v[slot]
                    values = values + delta.view(slen, kv_heads, dim)
            qi = q[start:start + qlen].transpose(0, 1).unsqueeze(0)          # [1, Hq, qlen, D]
            ki = keys.transpose(0, 1).unsqueeze(0)                            # [1, Hkv, slen, D]
            vi = values.transpose(0, 1).unsqueeze(0)
            if qlen == slen:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True,
                                                   enable_gqa=heads != kv_heads)
            else:
                # Queries are the last qlen positions: query j sees keys 0 .. slen - qlen + j.
                causal = (torch.arange(slen, device=q.device)[None, :]
                          <= torch.arange(slen - qlen, slen, device=q.device)[:, None])
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal,
                                                   enable_gqa=heads != kv_heads)
            outs.append(o[0].transpose(0, 1).reshape(qlen, heads * dim))
            start += qlen
        return torch.cat(outs)
