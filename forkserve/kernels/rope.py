"""Rotary position embedding (Llama rotate-half / neox style), eager; the Triton
device functions that follow the same contract are in rope_triton.py.

Contract shared by every kernel in this package:

* ``inv_freq`` is a float32 tensor of shape ``[head_dim // 2]``; it is passed in (never
  rebuilt here) so scaled RoPE variants (Llama-3.1, YaRN, linear) work unchanged.
* The angle of position ``p`` and frequency ``i`` is ``p * inv_freq[i]`` evaluated in
  float64 and cos/sin rounded to float32. A float32 angle would carry an error of
  ``ulp(p * inv_freq) / 2`` (~1e-3 rad at p = 32K), and the Triton kernels build the angle
  of a key block as ``start + j`` by angle addition, which is only equal to the eager
  value when both are exact; float64 makes them exact to float32 rounding.
* ``rope(x)[..., :D/2] = x_lo * cos - x_hi * sin`` and
  ``rope(x)[..., D/2:] = x_hi * cos + x_lo * sin`` (rotate-half, cos/sin repeated twice).
"""
from __future__ import annotations

import torch


def default_inv_freq(head_dim: int, base: float = 10000.0,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Plain Llama inverse frequencies, float32 ``[head_dim // 2]``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (base ** exponents)


def rope_cos_sin(positions: torch.Tensor,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape ``positions.shape + [head_dim // 2]`` (float32)."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., T, H, D]`` at ``positions`` (broadcastable to ``[..., T]``).

    Computed in float32 and returned in float32; the caller casts.
    """
    cos, sin = rope_cos_sin(positions, inv_freq)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads axis
    xf = x.to(torch.float32)
    half = xf.shape[-1] // 2
    lo, hi = xf[..., :half], xf[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


def rotate_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., heads, head_dim]`` rotated with cos and *signed* sin ``[..., head_dim]`` (the
    first half's sin negated, as ``backend/torch/rope.Rope.cos_sin`` makes them), broadcast
    over heads: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = roll(x, half)``
    times the sign, so one roll replaces a slice, a negation and a concatenation."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos.unsqueeze(-2), rolled, signed_sin.unsqueeze(-2))


def rope_table(inv_freq: torch.Tensor, n_positions: int) -> torch.Tensor:
    """cos/sin of positions ``0 .. n_positions-1``: float32 ``[n_positions, 2, D/2]``."""
    cos, sin = rope_cos_sin(torch.arange(n_positions, device=inv_freq.device), inv_freq)
    return torch.stack((cos, sin), dim=1).contiguous()


# (device, data_ptr, version) of an inv_freq tensor -> (that tensor, its table). Holding the
# tensor keeps its memory from being reused by another one with the same key; a handful of
# models at most, so entries are never evicted.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
MIN_TABLE_POSITIONS = 32768  # 16 MiB for head_dim 128: covers common contexts up front


def cached_rope_table(inv_freq: torch.Tensor, n_positions: int) -> torch.Tensor:
    """The table of ``inv_freq`` covering at least ``n_positions`` (grown by doubling).

    Building runs CUDA work, so it must happen outside CUDA graph capture: a graph runner
    calls this (or one eager step at its longest length) before capturing.
    """
    key = (str(inv_freq.device), inv_freq.data_ptr(), inv_freq._version, inv_freq.numel())
    entry = _TABLES.get(key)
    table = entry[1] if entry is not None else None
    if table is None or table.shape[0] < n_positions:
        if inv_freq.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"RoPE table for {n_positions} positions is not built; call "
                "forkserve.kernels.rope.cached_rope_table(inv_freq, max_positions) before "
                "CUDA graph capture")
        size = MIN_TABLE_POSITIONS
        while size < n_positions:
            size *= 2
        if entry is not None:  # grown: the old table's copies go with it
            for k in [k for k, (src, _) in _COPIES.items() if src is entry[1]]:
                del _COPIES[k]
        table = rope_table(inv_freq, size)
        _TABLES[key] = (inv_freq, table)
    return table


# (device, data_ptr, rows, dtype) of a float32 table -> (that table, its copy); a
# table's copies are dropped when cached_rope_table grows it.
_COPIES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table_in(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``table`` (``rope_table``'s float32) rounded to ``dtype``, made once per table. A score
    pass that rounds each cos/sin row to its queries' dtype before a dot reads this copy
    instead: the same operands, half the bytes. Like ``cached_rope_table``, the first call
    per table must come before CUDA graph capture."""
    if dtype == table.dtype:
        return table
    # No version in the key: an inference-mode table has no counter, and no table of this
    # module's is written after it is built. The entry holds its source, so a key can only
    # meet another tensor once that source has gone from the entry.
    key = (str(table.device), table.data_ptr(), table.shape[0], dtype)
    entry = _COPIES.get(key)
    if entry is None or entry[0] is not table:
        if table.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the {dtype} RoPE table is not built; run one step eagerly before CUDA "
                "graph capture")
        # Holding the source keeps its memory from serving a later table at the same key.
        entry = _COPIES[key] = (table, table.to(dtype))
    return entry[1]
