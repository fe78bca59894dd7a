"""FlashAttention-2's varlen forward through torch (``aten._flash_attention_forward``): whether
it takes a shape of inputs, and the call.

``flash_support`` decides once per (device, dtype, heads, KV heads, head dim), by the op's
documented limits and then a trial call, and says why: the outcome is data (the flash route
and the benchmark record it), and a real call that raises afterwards is an error, never a
silent switch to another path. No Triton here: the engine asks before choosing a route.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class FlashSupport:
    """Whether FlashAttention-2's varlen op takes a shape of inputs, and why (not)."""

    varlen: bool
    reason: str

    @property
    def attention(self) -> str:
        """What attends on the flash route: "flash_varlen" or "sdpa_per_sequence"."""
        return "flash_varlen" if self.varlen else "sdpa_per_sequence"


# (device, dtype, heads, KV heads, head dim) -> its probe; a handful per process, never evicted.
_SUPPORT: dict[tuple, FlashSupport] = {}


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal (bottom-right per sequence) varlen attention: q ``[total_q, H, D]``, k/v
    ``[total_k, Hkv, D]``, int32 ``cu_q`` / ``cu_k`` offsets, host maxima. ``[total_q, H, D]``."""
    # The ten leading arguments positionally and scale by keyword: that much of the schema has
    # held across torch 2.x (2.13 here; releases appended keyword-only arguments after scale).
    # The probe's trial call checks the installed torch.
    op = torch.ops.aten._flash_attention_forward
    return op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def _probe(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv: int,
           head_dim: int) -> FlashSupport:
    if device.type != "cuda":
        return FlashSupport(False, f"{device.type} tensors: FlashAttention-2 runs on CUDA only")
    if dtype not in FLASH_DTYPES:
        return FlashSupport(False, f"{dtype}: FlashAttention-2 takes float16 and bfloat16 only")
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return FlashSupport(False, f"head dim {head_dim}: FlashAttention-2 needs a multiple of 8 "
                                   f"up to {FLASH_MAX_HEAD_DIM}")
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return FlashSupport(False, f"torch {torch.__version__} has no "
                                   "aten._flash_attention_forward")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flash_support probes with a trial call: run one eager prefill "
                           "before CUDA graph capture")
    q = torch.randn(3, n_heads, head_dim, device=device, dtype=dtype)
    kv = torch.randn(5, n_kv, head_dim, device=device, dtype=dtype)
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5], dtype=torch.int32, device=device)
    try:
        flash_varlen(q, kv, kv, cu_q, cu_k, 3, 5, 1.0 / math.sqrt(head_dim))
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return FlashSupport(False, f"aten._flash_attention_forward refused: {exc}"[:300])
    return FlashSupport(True, f"aten._flash_attention_forward (torch {torch.__version__})")


def flash_support(q: torch.Tensor, k_pool: torch.Tensor) -> FlashSupport:
    """The flash op's verdict for queries like ``q [T, H, D]`` over a pool like ``k_pool
    [..., Hkv, D]``; probed on first sight of the shape, memoised."""
    key = (q.device, q.dtype, q.shape[1], k_pool.shape[-2], q.shape[-1])
    if key not in _SUPPORT:
        _SUPPORT[key] = _probe(*key)
    return _SUPPORT[key]
