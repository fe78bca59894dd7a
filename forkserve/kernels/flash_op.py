"""The library flash kernels the prefill routes call: which one takes a shape of inputs, and
the calls. FlashAttention-4 (``fa4_op.py``: varlen, and paged through the block tables) where
it is installed and measured (sm_90), else FlashAttention-2's varlen forward through torch
(``aten._flash_attention_forward``), else none. ``FORKSERVE_FA4=off`` in the environment
leaves FlashAttention-4 out (read at each shape's first probe).

``flash_support`` decides once per (device, dtype, heads, KV heads, head dim), by each
kernel's documented limits and then a trial call, and says why: the outcome is data
(``FlashSupport.kernel``: the routes and the policy read it, the benchmark records it), and a
real call that raises afterwards is an error, never a silent switch to another path. No
Triton here: the engine asks before choosing a route.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from forkserve.kernels import fa4_op

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


FA4 = "fa4"
FA2 = "fa2"


@dataclass(frozen=True)
class FlashSupport:
    """Which library kernel takes a shape of inputs, and why (not): ``kernel`` is ``FA4``
    (FlashAttention-4: varlen and paged), ``FA2`` (FlashAttention-2 varlen) or "" (none: the
    packed routes attend per sequence through SDPA)."""

    kernel: str
    reason: str

    @property
    def varlen(self) -> bool:
        """A varlen kernel attends packed K/V (the FLASH route, FRESH in one call)."""
        return bool(self.kernel)

    @property
    def paged(self) -> bool:
        """A kernel reads the paged cache through the block tables (the PAGED_FLASH route)."""
        return self.kernel == FA4

    @property
    def fresh_varlen(self) -> bool:
        """A cold prefill (FRESH) attends in one varlen call rather than one SDPA call per
        sequence: FA4 only. FA2's varlen runs a cold prefill at ~0.5x cuDNN's speed (H200,
        ``fa4_prefill.json``: ``sdpa_flash``), FA4's at 1.16-1.21x from 4K."""
        return self.kernel == FA4

    @property
    def attention(self) -> str:
        """What attends on the flash route: "fa4_varlen", "fa2_varlen" or "sdpa_per_sequence"."""
        return f"{self.kernel}_varlen" if self.kernel else "sdpa_per_sequence"


# (device, dtype, heads, KV heads, head dim) -> its probe; a handful per process, never evicted.
_SUPPORT: dict[tuple, FlashSupport] = {}


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, scale: float,
                 kernel: str = FA2) -> torch.Tensor:
    """Causal (bottom-right per sequence) varlen attention: q ``[total_q, H, D]``, k/v
    ``[total_k, Hkv, D]``, int32 ``cu_q`` / ``cu_k`` offsets, host maxima, by ``kernel``
    (``FlashSupport.kernel``). ``[total_q, H, D]``."""
    if kernel == FA4:
        return fa4_op.fa4_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    if kernel != FA2:
        raise ValueError(f"no varlen flash kernel {kernel!r}: flash_support found none")
    # The ten leading arguments positionally and scale by keyword: that much of the schema has
    # held across torch 2.x (2.13 here; releases appended keyword-only arguments after scale).
    # The probe's trial call checks the installed torch.
    op = torch.ops.aten._flash_attention_forward
    return op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def flash_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q: torch.Tensor,
                max_q: int, scale: float, kernel: str) -> torch.Tensor:
    """Causal (bottom-right) varlen prefill over the paged cache through the block tables
    (``fa4_op.fa4_paged``), where ``kernel`` (``FlashSupport.kernel``) reads pages."""
    if kernel != FA4:
        raise ValueError(f"the paged flash route needs FlashAttention-4, and flash_support "
                         f"found {kernel or 'no kernel'}")
    return fa4_op.fa4_paged(q, k_pool, v_pool, block_tables, seq_lens, cu_q, max_q, scale)


def _trial(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv: int,
           head_dim: int, kernel: str) -> None:
    """One small varlen call of ``kernel`` (raises where it refuses the inputs)."""
    q = torch.randn(3, n_heads, head_dim, device=device, dtype=dtype)
    kv = torch.randn(5, n_kv, head_dim, device=device, dtype=dtype)
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5], dtype=torch.int32, device=device)
    flash_varlen(q, kv, kv, cu_q, cu_k, 3, 5, 1.0 / math.sqrt(head_dim), kernel)


def _probe_fa4(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv: int,
               head_dim: int) -> FlashSupport:
    if os.environ.get("FORKSERVE_FA4", "").lower() in ("0", "off", "false", "no"):
        return FlashSupport("", "FlashAttention-4 turned off (FORKSERVE_FA4)")
    capability = torch.cuda.get_device_capability(device)
    if capability not in fa4_op.FA4_CAPABILITIES:
        return FlashSupport("", f"sm_{capability[0]}{capability[1]}: FlashAttention-4 is "
                                f"measured here on {fa4_op.FA4_CAPABILITIES} only")
    try:
        fa4_op.load()
    except Exception as exc:  # ImportError, or the CuTe DSL failing to load its libraries
        return FlashSupport("", f"flash_attn.cute not importable: {exc}"[:300])
    try:
        _trial(device, dtype, n_heads, n_kv, head_dim, FA4)
    except Exception as exc:  # its asserts (AssertionError) as much as RuntimeError
        return FlashSupport("", f"flash_attn.cute refused: {exc!r}"[:300])
    return FlashSupport(FA4, "flash_attn.cute (FlashAttention-4)")


def _probe(device: torch.device, dtype: torch.dtype, n_heads: int, n_kv: int,
           head_dim: int) -> FlashSupport:
    if device.type != "cuda":
        return FlashSupport("", f"{device.type} tensors: the flash kernels run on CUDA only")
    if dtype not in FLASH_DTYPES:
        return FlashSupport("", f"{dtype}: the flash kernels take float16 and bfloat16 only")
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return FlashSupport("", f"head dim {head_dim}: the flash kernels need a multiple of 8 "
                                f"up to {FLASH_MAX_HEAD_DIM}")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flash_support probes with a trial call: run one eager prefill "
                           "before CUDA graph capture")
    fa4 = _probe_fa4(device, dtype, n_heads, n_kv, head_dim)
    if fa4.kernel:
        return fa4
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return FlashSupport("", f"{fa4.reason}; torch {torch.__version__} has no "
                                "aten._flash_attention_forward")
    try:
        _trial(device, dtype, n_heads, n_kv, head_dim, FA2)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return FlashSupport("", f"{fa4.reason}; aten._flash_attention_forward refused: "
                                f"{exc}"[:300])
    return FlashSupport(FA2, f"aten._flash_attention_forward (torch {torch.__version__}); "
                             f"{fa4.reason}"[:300])


def flash_support(q: torch.Tensor, k_pool: torch.Tensor) -> FlashSupport:
    """The flash kernels' verdict for queries like ``q [T, H, D]`` over a pool like ``k_pool
    [..., Hkv, D]``; probed on first sight of the shape, memoised."""
    key = (q.device, q.dtype, q.shape[1], k_pool.shape[-2], q.shape[-1])
    if key not in _SUPPORT:
        _SUPPORT[key] = _probe(*key)
    return _SUPPORT[key]
