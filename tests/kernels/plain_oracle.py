"""Independent oracles: the attention math written out once more, in float64, sharing no
code with forkserve.kernels (not its RoPE or cos/sin table, not its page gather, not its
softmax), so neither a kernel nor the eager reference (the engine's CPU path, and what the
merged prefill builds its pages with) can pass a test by agreeing with itself.

* RoPE as a complex rotation: the pair (x[i], x[i + D/2]) is the number x[i] + j x[i + D/2],
  multiplied by exp(j * p * inv_freq[i]) — the rotate-half contract in another form.
* A sequence's K/V read position by position: page table[p // P], row p % P.
* Attention: scores per head, causal mask by absolute position, exp(s - max) / sum.
"""
from __future__ import annotations

import math

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [L, ..., D]`` (float64) at ``positions [L]``."""
    half = x.shape[-1] // 2
    angle = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64).cpu()[None, :]
    turn = torch.polar(torch.ones_like(angle), angle)
    turn = turn.reshape(turn.shape[0], *([1] * (x.dim() - 2)), half)
    z = torch.complex(x[..., :half], x[..., half:]) * turn
    return torch.cat((z.real, z.imag), dim=-1)


def rows(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows ``0 .. length-1`` of one sequence, ``[length, *pool.shape[2:]]`` float64 on CPU."""
    pool, table = pool.detach().cpu().to(torch.float64), table.cpu().long()
    pos = torch.arange(length)
    return pool[table[pos // pool.shape[1]], pos % pool.shape[1]]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q ``[T, H, D]`` at ``q_pos``; k, v ``[L, Hkv, D]``; query head h reads KV head
    h // (H / Hkv). Returns ``[T, H, D]``."""
    n_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], n_heads, v.shape[-1], dtype=torch.float64)
    future = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
    for h in range(n_heads):
        s = (q[:, h] @ k[:, h // group].T) * scale
        s = s.masked_fill(future, -math.inf)
        w = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        out[:, h] = (w / w.sum(dim=-1, keepdim=True)) @ v[:, h // group]
    return out


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
            residual: tuple | None = None, scale: float | None = None) -> torch.Tensor:
    """Varlen causal prefill, float64 ``[total_new, H, D]`` on q's device. ``residual``: (k_res,
    v_res, res_block_tables, b_k_all, b_v_all, adapter_idx, inv_freq) of the disaggregated
    layout: K = K_base + RoPE(K_res B_k), V = V_base + V_res B_v; adapter -1 reads the base."""
    qf = q.detach().cpu().to(torch.float64)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(qf)
    for b in range(seq_lens.numel()):
        s, e, length = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        if e == s:
            continue
        k, v = rows(k_cache, block_tables[b], length), rows(v_cache, block_tables[b], length)
        if residual is not None and int(residual[5][b]) >= 0:
            k_res, v_res, res_tables, b_k, b_v, adapter_idx, inv_freq = residual
            a, n_kv = int(adapter_idx[b]), k.shape[1]
            up_k = rows(k_res, res_tables[b], length) @ b_k[a].cpu().to(torch.float64)
            up_v = rows(v_res, res_tables[b], length) @ b_v[a].cpu().to(torch.float64)
            k = k + rope(up_k.reshape(length, n_kv, -1), torch.arange(length), inv_freq)
            v = v + up_v.reshape(length, n_kv, -1)
        out[s:e] = attend(qf[s:e], k, v, torch.arange(length - (e - s), length), scale)
    return out.to(q.device)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, residual: tuple | None = None,
           scale: float | None = None) -> torch.Tensor:
    """One new token per sequence: ``q [batch, H, D]``."""
    return prefill(q, k_cache, v_cache, block_tables, seq_lens, torch.arange(q.shape[0] + 1),
                   residual, scale)
