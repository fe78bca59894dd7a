"""The FRESH prefill route: a cold prefill attended over the step's own K/V, no page read.

A sequence with no cached prefix (``q_len == seq_len``: it prefills from position 0) has
every key among this step's own tokens, whose K (with RoPE) and V the model has just
projected (``CausalLM._project``), and in the disaggregated form their residual rows
``x A_k, x A_v`` too. The paged routes write those to the pools and read them back: the
Triton kernel through the block tables, the packed routes (kernels/flash_prefill.py) by
gathering them into a packed buffer first, an O(keys) pass plus a fixed cost per call
(H200, Llama-3-8B shape: the SDPA route 0.310 ms at 4K against 0.256 for SDPA on K/V
gathered beforehand). This route attends the step's own rows directly: one FlashAttention-4
varlen call for every such sequence of the step where it is installed
(``FlashSupport.fresh_varlen``: 0.82-0.86x cuDNN's time from 4K on the H200), else one causal
SDPA call per sequence over its slice (``flash_prefill.sdpa_cold``, the SDPA route's call).
The K/V are still written to the pages (``write_kv``) for the steps after.

In the residual form a split sequence's keys are rebuilt from this step's tensors first, as
``attention.py`` rebuilds them from pages (RoPE is linear, rope.py):

    K = K_base + RoPE(K_res @ B_k[slot])   at positions 0 .. q_len - 1
    V = V_base + V_res @ B_v[slot]

one ``[q_len, r] x [r, Hkv * D]`` product per target (B pre-scaled: the LoRA scaling is folded
into the stacks, as for every residual route): on CUDA one Triton launch for both
(``kernels.rebuild_kv``, residual_rebuild.py: each K/V element read and written once, float32
math), elsewhere the eager form in the model dtype (``reference.rebuild_kv_ref``).
A sequence with slot -1 (a merged or base item inside a split batch) attends its K/V as
written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from forkserve.backend.torch.attention import AttentionMetadata
from forkserve.backend.torch.rope import Rope
from forkserve.kernels import FlashSupport, rebuild_kv
from forkserve.kernels.flash_op import flash_varlen
from forkserve.kernels.flash_prefill import sdpa_cold


@dataclass(frozen=True)
class FreshRows:
    """The sequences of a step on the FRESH route: their rows of the step's q/k/v/residuals
    (``rows``: a slice where they are one run, else an int64 index), their lengths and adapter
    slots (host), in batch order."""

    rows: slice | torch.Tensor
    query_lens: tuple[int, ...]
    slots: tuple[int, ...]
    # Made at the first layer that needs them, the same for every layer of the step: cos/signed
    # sin of positions 0 .. max(query_lens) - 1 per dtype, the varlen offsets ("cu").
    _made: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokens(self) -> int:
        return sum(self.query_lens)

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 offsets of ``query_lens`` on ``device``, made once per step (the varlen
        kernel's ``cu_seqlens``)."""
        if "cu" not in self._made:
            self._made["cu"] = offsets(self.query_lens, device)
        return self._made["cu"]

    def cos_sin(self, rope: Rope, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._made:
            positions = torch.arange(max(self.query_lens), device=device)
            self._made[dtype] = rope.cos_sin(positions, dtype)
        return self._made[dtype]


def offsets(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``[0, l0, l0 + l1, ...]`` on ``device``: a varlen kernel's ``cu_seqlens``."""
    return torch.tensor((0, *accumulate(lengths)), dtype=torch.int32, device=device)


def fresh_rows(meta: AttentionMetadata, seqs: list[int]) -> FreshRows:
    """``meta``'s sequences ``seqs`` (each with ``q_len == seq_len``), in order."""
    lens = meta.query_lens_host
    starts = (0, *accumulate(lens))
    bounds = [(starts[i], starts[i + 1]) for i in seqs]
    runs = all(bounds[j][1] == bounds[j + 1][0] for j in range(len(bounds) - 1))
    if runs:
        rows: slice | torch.Tensor = slice(bounds[0][0], bounds[-1][1])
    else:
        index = [r for lo, hi in bounds for r in range(lo, hi)]
        rows = torch.tensor(index, dtype=torch.int64).to(meta.seq_lens.device, non_blocking=True)
    return FreshRows(rows, tuple(lens[i] for i in seqs), tuple(meta.seq_slot_host[i] for i in seqs))


def take(x: torch.Tensor | None, rows: slice | torch.Tensor) -> torch.Tensor | None:
    if x is None:
        return None
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def fresh_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: tuple[int, ...],
                  scale: float, slots: tuple[int, ...] | None = None,
                  k_res: torch.Tensor | None = None, v_res: torch.Tensor | None = None,
                  b_k: torch.Tensor | None = None, b_v: torch.Tensor | None = None,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                  use_triton: bool | None = None, flash: FlashSupport | None = None,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Cold causal prefill of sequences back to back: ``q [N, Hq, D]``, ``k, v [N, Hkv, D]``
    (K with RoPE at positions 0 .. q_len - 1 of each), ``query_lens`` summing to N. The
    residual form: ``slots`` (-1: attend k/v as they are), ``k_res, v_res [N, r]`` and the
    pre-scaled ``b_k, b_v [slots, r, Hkv * D]`` (either None: that side is not rebuilt),
    ``cos_sin``: ``Rope.cos_sin`` of positions 0 .. max(query_lens) - 1. ``use_triton``: the
    rebuild's kernel (``kernels.rebuild_kv``: None picks it on CUDA). ``flash``: the library
    flash kernel for these inputs (``kernels.flash_support``); where it attends a cold prefill
    in one varlen call (``fresh_varlen``) every sequence goes in that call (``cu_seqlens``:
    the int32 offsets of ``query_lens`` on q's device, when the caller holds them), else one
    SDPA call each. Returns ``[N, Hq, D]``."""
    if flash is not None and flash.fresh_varlen:
        if slots is not None:
            at, ks, vs = 0, [], []
            for n, slot in zip(query_lens, slots, strict=True):
                part = slice(at, at + n)
                kp, vp = _rebuilt(k[part], v[part], slot, take(k_res, part), take(v_res, part),
                                  b_k, b_v, cos_sin, use_triton)
                ks.append(kp)
                vs.append(vp)
                at += n
            k, v = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))
        if cu_seqlens is None:
            cu_seqlens = offsets(query_lens, q.device)
        most = max(query_lens)
        return flash_varlen(q, k, v, cu_seqlens, cu_seqlens, most, most, scale, flash.kernel)
    if len(query_lens) == 1:
        return _one(q, k, v, scale, None if slots is None else slots[0], k_res, v_res, b_k, b_v,
                    cos_sin, use_triton)
    out = torch.empty_like(q)
    at = 0
    for i, n in enumerate(query_lens):
        part = slice(at, at + n)
        out[part] = _one(q[part], k[part], v[part], scale, None if slots is None else slots[i],
                         take(k_res, part), take(v_res, part), b_k, b_v, cos_sin, use_triton)
        at += n
    return out


def _rebuilt(k: torch.Tensor, v: torch.Tensor, slot: int | None, k_res: torch.Tensor | None,
             v_res: torch.Tensor | None, b_k: torch.Tensor | None, b_v: torch.Tensor | None,
             cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
             use_triton: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V as it attends: rebuilt from base + residual under adapter ``slot``,
    or as written (no slot, slot -1, or no B on either side)."""
    if slot is None or slot < 0 or (b_k is None and b_v is None):
        return k, v
    if b_k is not None and (k_res is None or cos_sin is None):
        raise ValueError("a rebuilt key needs its residual rows and RoPE's cos/sin")
    if b_v is not None and v_res is None:
        raise ValueError("a rebuilt value needs its residual rows")
    cos, sin = (None, None) if cos_sin is None else cos_sin
    return rebuild_kv(k, v, k_res, v_res, None if b_k is None else b_k[slot],
                      None if b_v is None else b_v[slot], cos, sin, use_triton=use_triton)


def _one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         slot: int | None, k_res: torch.Tensor | None, v_res: torch.Tensor | None,
         b_k: torch.Tensor | None, b_v: torch.Tensor | None,
         cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
         use_triton: bool | None) -> torch.Tensor:
    k, v = _rebuilt(k, v, slot, k_res, v_res, b_k, b_v, cos_sin, use_triton)
    return sdpa_cold(q, k, v, scale)
