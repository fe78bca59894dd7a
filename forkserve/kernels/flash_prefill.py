"""The flash prefill route: pack the batch's K/V contiguously, then a varlen flash kernel.

Our Triton paged prefill ran 1.6-1.9x slower than torch SDPA's flash kernel on the same
K/V gathered contiguous (H200, Llama-3-8B shape: 1.89 vs 1.06 ms at 8K, 28.4 vs 15.1 at
32K), and ResidualAttention's fused prefill 2.3x slower again. The gather (and the residual
rebuild) is O(keys) against the O(keys x new tokens) attention, so for a prefill of many
tokens both forms pay it once per layer and attend at flash speed:

1. ``pack_kv`` (kv_pack.py) writes each sequence with new tokens back to back into
   ``[packed_keys, Hkv, D]`` K and V buffers (rebuilt from base + residual in the
   disaggregated form); sequences with no new token are left out;
2. the varlen flash kernel ``flash_op.flash_support`` found (FlashAttention-4 on the H200
   where installed, else FlashAttention-2 through ``torch.ops.aten._flash_attention_forward``)
   attends varlen over the packed rows: GQA natively, causal aligned bottom-right per
   sequence (query j of a chunk of q over s keys sees keys ``0 .. s - q + j``), which is
   chunked prefill over a cached prefix.

``attention="sdpa"`` (the ``SDPA`` route) attends the packed buffers per sequence with public
SDPA instead: ``is_causal`` for a cold prefill, so torch picks its preferred backend (cuDNN on
Hopper with torch >= 2.11, which the H200 baseline of 1.06 ms at 8K likely was), and
``causal_lower_right`` for a chunk. The varlen route falls back to the same per-sequence
attention where the flash op is missing or refuses the inputs (CPU, float32, a head dim it
lacks); ``flash_op.flash_support`` decides that.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from forkserve.kernels import fa4_op
from forkserve.kernels.flash_op import flash_support, flash_varlen
from forkserve.kernels.kv_pack import ResidualPools, pack_kv
from forkserve.kernels.prefill_policy import PrefillCounts

# Lengths per octave a cold SDPA call runs at: torch's SDPA on Hopper (cuDNN) builds a plan
# the first time it meets a shape, ~42 ms against 0.12-0.4 ms for the call itself (H200,
# `sdpa_shapes.json`), and a react run meets a new prompt length at nearly every cold
# prefill. Rounding up to 16 lengths per octave bounds the plans (~35 between 2K and 9K)
# for at most 1/16 more attention (the padded rows are past every real row: causal).
COLD_LENGTHS_PER_OCTAVE = 16


def cold_length(n: int) -> int:
    """The length a cold prefill of ``n`` (>= 1) tokens attends at: ``n`` rounded up to a
    multiple of 2^floor(log2 n) / COLD_LENGTHS_PER_OCTAVE, at least 64 (powers of two and
    their 1/16 steps stay as they are)."""
    granule = max(64, (1 << (n.bit_length() - 1)) // COLD_LENGTHS_PER_OCTAVE)
    return -(-n // granule) * granule


def cold_lengths(lo: int, hi: int) -> list[int]:
    """Every length a cold prefill of ``lo`` .. ``hi`` tokens attends at (``cold_length``)."""
    out, n = [], cold_length(max(1, lo))
    while n <= cold_length(hi):
        out.append(n)
        n = cold_length(n + 1)
    return out


def warm_cold_plans(lengths: list[int], q_heads: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype, device: torch.device, page_size: int = 16) -> int:
    """Build before serving what the cold prefills of ``lengths`` will run, not during the
    first prefill that meets each: where FlashAttention-4 attends them
    (``FlashSupport.fresh_varlen``), its kernels (``fa4_op.warm``); else one cold SDPA call
    at each length (zero inputs), for the backend's per-shape plans (cuDNN). Returns the
    calls made."""
    if not lengths:
        return 0
    q = torch.zeros(1, q_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(1, page_size, kv_heads, head_dim, dtype=dtype, device=device)
    support = flash_support(q, kv)
    if support.fresh_varlen:
        return fa4_op.warm(q_heads, kv_heads, head_dim, dtype, device, page_size, lengths[0])
    for n in lengths:
        q = torch.zeros(n, q_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
        sdpa_cold(q, kv, kv, 1.0)
    return len(lengths)


def sdpa_cold(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One cold prefill (``q [n, H, D]`` over ``k, v [n, Hkv, D]``, keys 0 .. n-1) as plain
    ``is_causal`` SDPA, so torch may pick any backend (cuDNN, flash); GQA native. Runs at
    ``cold_length(n)``, the rows past ``n`` zero (no real query sees them: causal) and
    dropped. Returns ``[n, H, D]`` (a view of SDPA's output)."""
    n = q.shape[0]
    pad = cold_length(n) - n
    if pad:  # one copy of q, k, v (~5% of the attention at 8K) against a new cuDNN plan
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)[:n]


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: PrefillCounts,
                  scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    q_at = k_at = 0
    for q_len, s_len in zip(counts.query_lens, counts.seq_lens, strict=True):
        if q_len == 0:  # packed buffers leave out sequences with no new token
            continue
        if q_len == s_len:
            out[q_at:q_at + q_len] = sdpa_cold(q[q_at:q_at + q_len], k[k_at:k_at + s_len],
                                               v[k_at:k_at + s_len], scale)
        else:
            o = F.scaled_dot_product_attention(
                q[q_at:q_at + q_len].transpose(0, 1)[None],
                k[k_at:k_at + s_len].transpose(0, 1)[None],
                v[k_at:k_at + s_len].transpose(0, 1)[None],
                attn_mask=causal_lower_right(q_len, s_len), scale=scale, enable_gqa=gqa)
            out[q_at:q_at + q_len] = o[0].transpose(0, 1)
        q_at, k_at = q_at + q_len, k_at + s_len
    return out


def flash_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  counts: PrefillCounts, scale: float | None = None,
                  residual: ResidualPools | None = None, attention: str = "varlen",
                  **pack_tuning) -> torch.Tensor:
    """Varlen causal prefill (``q [total_new, H, D]``) over the paged cache, unified or with
    ``residual``, through packed K/V. ``counts``: host copies of the batch's lengths (they
    size the buffers and the grid; nothing is read back). The packed K/V (``counts.packed_keys``
    rows each) are allocated here and dropped on return: per layer call, reused by the
    caching allocator. ``attention``: "varlen" (the flash kernel, where one takes the inputs)
    or "sdpa" (per sequence). ``pack_tuning``: ``pack_kv``'s ``block_t`` / ``num_warps``."""
    if attention not in ("varlen", "sdpa"):
        raise ValueError(f"attention must be 'varlen' or 'sdpa', got {attention!r}")
    if q.shape[0] != counts.new_tokens or seq_lens.numel() != len(counts.seq_lens):
        raise ValueError(f"counts describe {counts.new_tokens} new tokens of "
                         f"{len(counts.seq_lens)} sequences; got q of {q.shape[0]} rows and "
                         f"{seq_lens.numel()} sequence lengths")
    if counts.new_tokens == 0:
        return torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cu_q = cu_seqlens_q.to(torch.int32)
    key_lens = torch.where(cu_q[1:] > cu_q[:-1], seq_lens.to(torch.int32), 0).to(torch.int32)
    cu_k = torch.zeros_like(cu_q)
    cu_k[1:] = torch.cumsum(key_lens, 0)
    k, v = pack_kv(k_pool, v_pool, block_tables, key_lens, cu_k[:-1], counts.packed_keys,
                   counts.max_packed_len, residual, **pack_tuning)
    support = flash_support(q, k_pool)
    if attention == "varlen" and support.varlen:
        return flash_varlen(q, k, v, cu_q, cu_k, counts.max_query_len, counts.max_packed_len, scale,
                            support.kernel)
    return _per_sequence(q, k, v, counts, scale)
