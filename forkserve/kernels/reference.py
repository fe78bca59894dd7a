"""Eager PyTorch references for every kernel in this package.

They define the semantics the Triton kernels must match, serve as the CPU path of the
engine (``use_triton=False``) and as the "eager reconstruct" baseline of the benchmark.
All attention math runs in float32 and returns the query's dtype.

Layout contract (see docs/KERNELS.md):

* Unified pools ``k_cache, v_cache``: ``[num_pages, P, n_kv_heads, head_dim]``, K roped.
* Disaggregated: base pools as above; residual pools ``k_res, v_res``:
  ``[num_res_pages, P, r]`` (x A_k, x A_v, no RoPE). ``B_k_all, B_v_all``:
  ``[num_adapters, r, n_kv_heads * head_dim]`` already scaled by alpha / r.
  ``adapter_idx`` int32 ``[batch]``; -1 means "no adapter": the residual is ignored.
* ``block_tables`` / ``res_block_tables`` int32 ``[batch, max_pages]``; ``seq_lens`` int32
  ``[batch]`` counts every key including the new tokens.
* Prefill is varlen: ``q [total_new, n_heads, D]``, ``cu_seqlens_q`` int32 ``[batch + 1]``;
  the new tokens of sequence b are its last ``q_len`` positions and attend causally.
"""
from __future__ import annotations

import math

import torch

from forkserve.kernels.rope import apply_rope, rotate_signed


def gather_pages(pool: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Gather ``[batch, max_len, *pool.shape[2:]]`` token rows through the block tables.

    Rows past a sequence's length hold whatever the listed page holds; callers mask them.
    """
    page_size = pool.shape[1]
    n_pages = -(-max_len // page_size)
    pages = block_tables[:, :n_pages].long().clamp(0, pool.shape[0] - 1)
    rows = pool[pages]  # [batch, n_pages, P, ...]
    return rows.flatten(1, 2)[:, :max_len]


def lora_delta_k(k_res: torch.Tensor, b_k: torch.Tensor, positions: torch.Tensor,
                 inv_freq: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """RoPE(K_res @ B_k) at absolute ``positions``: ``[..., L, r] -> [..., L, Hkv, D]`` float32."""
    up = k_res.to(torch.float32) @ b_k.to(torch.float32)
    up = up.unflatten(-1, (n_kv_heads, -1))
    return apply_rope(up, positions, inv_freq)


def lora_delta_v(v_res: torch.Tensor, b_v: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """V_res @ B_v: ``[..., L, r] -> [..., L, Hkv, D]`` float32."""
    up = v_res.to(torch.float32) @ b_v.to(torch.float32)
    return up.unflatten(-1, (n_kv_heads, -1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            seq_len: int, scale: float) -> torch.Tensor:
    """Causal GQA attention of one sequence in float32.

    q ``[Tq, H, D]`` at positions ``q_pos``; k, v ``[seq_len, Hkv, D]``. Returns ``[Tq, H, D]``.
    """
    group = q.shape[1] // k.shape[1]
    k = k.to(torch.float32).repeat_interleave(group, dim=1)
    v = v.to(torch.float32).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), k) * scale
    k_pos = torch.arange(seq_len, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _seq_kv(b: int, seq_len: int, k_pool: torch.Tensor, v_pool: torch.Tensor,
            block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = gather_pages(k_pool, block_tables[b:b + 1], seq_len)[0]
    v = gather_pages(v_pool, block_tables[b:b + 1], seq_len)[0]
    return k, v


def _seq_residual_kv(b: int, seq_len: int, k: torch.Tensor, v: torch.Tensor,
                     k_res: torch.Tensor, v_res: torch.Tensor, res_block_tables: torch.Tensor,
                     b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter: int,
                     inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K = K_base + RoPE(K_res B_k), V = V_base + V_res B_v for one sequence (float32)."""
    k, v = k.to(torch.float32), v.to(torch.float32)
    if adapter < 0:
        return k, v
    n_kv = k.shape[1]
    kr = gather_pages(k_res, res_block_tables[b:b + 1], seq_len)[0]
    vr = gather_pages(v_res, res_block_tables[b:b + 1], seq_len)[0]
    pos = torch.arange(seq_len, device=k.device)
    k = k + lora_delta_k(kr, b_k_all[adapter], pos, inv_freq, n_kv)
    v = v + lora_delta_v(vr, b_v_all[adapter], n_kv)
    return k, v


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Varlen causal prefill over a unified paged cache. Returns ``[total_new, H, D]``."""
    scale = _scale(scale, q.shape[-1])
    out = torch.empty_like(q)
    for b in range(seq_lens.numel()):
        s, e, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        if e == s:
            continue
        k, v = _seq_kv(b, L, k_cache, v_cache, block_tables)
        q_pos = torch.arange(L - (e - s), L, device=q.device)
        out[s:e] = _attend(q[s:e], k, v, q_pos, L, scale).to(q.dtype)
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One new token per sequence (``q [batch, H, D]``) over a unified paged cache."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_ref(q, k_cache, v_cache, block_tables, seq_lens, cu, scale)


def residual_prefill_ref(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                         k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                         res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, b_k_all: torch.Tensor, b_v_all: torch.Tensor,
                         adapter_idx: torch.Tensor, inv_freq: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Varlen causal prefill over the disaggregated cache, reconstructing K/V eagerly."""
    scale = _scale(scale, q.shape[-1])
    out = torch.empty_like(q)
    for b in range(seq_lens.numel()):
        s, e, L = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        if e == s:
            continue
        k, v = _seq_kv(b, L, k_base, v_base, block_tables)
        k, v = _seq_residual_kv(b, L, k, v, k_res, v_res, res_block_tables, b_k_all, b_v_all,
                                int(adapter_idx[b]), inv_freq)
        q_pos = torch.arange(L - (e - s), L, device=q.device)
        out[s:e] = _attend(q[s:e], k, v, q_pos, L, scale).to(q.dtype)
    return out


def residual_decode_ref(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                        k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                        res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                        inv_freq: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Decode (``q [batch, H, D]``) over the disaggregated cache."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return residual_prefill_ref(q, k_base, v_base, k_res, v_res, block_tables, res_block_tables,
                                seq_lens, cu, b_k_all, b_v_all, adapter_idx, inv_freq, scale)


def lora_shrink_ref(x: torch.Tensor, a_all: torch.Tensor,
                    token_adapter: torch.Tensor) -> torch.Tensor:
    """``y[t] = x[t] @ A[idx[t]]`` (zeros where idx = -1). x ``[T, hidden]``, A
    ``[N, hidden, r]``."""
    y = torch.zeros(x.shape[0], a_all.shape[-1], dtype=torch.float32, device=x.device)
    for a in token_adapter.unique().tolist():
        if a < 0:
            continue
        rows = token_adapter == a
        y[rows] = x[rows].to(torch.float32) @ a_all[a].to(torch.float32)
    return y.to(x.dtype)


def lora_expand_ref(y: torch.Tensor, b_all: torch.Tensor, token_adapter: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """``out[t] += y[t] @ B[idx[t]]`` in place (no-op where idx = -1); returns ``out``."""
    for a in token_adapter.unique().tolist():
        if a < 0:
            continue
        rows = token_adapter == a
        delta = y[rows].to(torch.float32) @ b_all[a].to(torch.float32)
        out[rows] = (out[rows].to(torch.float32) + delta).to(out.dtype)
    return out


def write_kv_pages_ref(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """K/V rows ``[W, H, D]`` into the pools ``[pages, P, H, D]`` at flat slots ``[W]``."""
    heads, dim = k.shape[1], k.shape[2]
    k_pool.view(-1, heads, dim).index_copy_(0, slots, k)
    v_pool.view(-1, heads, dim).index_copy_(0, slots, v)


def rebuild_kv_ref(k: torch.Tensor, v: torch.Tensor, k_res: torch.Tensor | None,
                   v_res: torch.Tensor | None, b_k: torch.Tensor | None,
                   b_v: torch.Tensor | None, cos: torch.Tensor | None,
                   sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's K = k + RoPE(k_res @ b_k), V = v + v_res @ b_v over rows ``[n, Hkv, D]``
    at positions 0 .. n - 1, in the model dtype (the FRESH route's eager rebuild): ``b_k, b_v``
    one slot's ``[r, Hkv * D]`` (None: that side as given), ``cos, sin [>= n, D]`` cos and
    signed sin (``Rope.cos_sin``)."""
    n, heads, dim = k.shape
    if b_k is not None:
        k = k + rotate_signed((k_res @ b_k).view(n, heads, dim), cos[:n], sin[:n])
    if b_v is not None:
        v = torch.addmm(v.reshape(n, heads * dim), v_res, b_v).view(n, heads, dim)
    return k, v
