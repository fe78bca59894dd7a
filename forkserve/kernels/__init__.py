"""L0 kernels: attention over paged KV (unified and disaggregated), multi-LoRA, RoPE.

Every public op takes ``use_triton``: None (default) picks the Triton kernel for CUDA
tensors and the eager reference otherwise; True forces Triton (on a CPU-only machine that
needs ``TRITON_INTERPRET=1`` set before triton is imported); False forces the reference.
Triton modules are imported on first use so the eager path works without Triton.

Layouts, shapes and the math are specified in reference.py and docs/KERNELS.md.
"""
from __future__ import annotations

import torch

from forkserve.kernels import reference
from forkserve.kernels.decode_policy import DEFAULT_DECODE_POLICY
from forkserve.kernels.flash_op import FlashSupport, flash_support
from forkserve.kernels.prefill_policy import (
    MEASURED_WS_PREFILL_SHAPES,
    PACKED_ROUTES,
    RESIDUAL_ROUTES,
    UNIFIED_ROUTES,
    CostPrefillPolicy,
    FixedPrefillPolicy,
    PrefillAttentionPolicy,
    PrefillCounts,
    PrefillKernels,
    PrefillRoute,
)
from forkserve.kernels.prefix_groups import PrefillGroups, prefill_groups, prefix_splits
from forkserve.kernels.rope import apply_rope, default_inv_freq, rope_cos_sin

__all__ = [
    "apply_rope", "default_inv_freq", "rope_cos_sin", "reference",
    "paged_decode", "paged_prefill", "residual_decode", "residual_prefill", "flash_support",
    "FlashSupport", "PrefillCounts", "PrefillKernels", "prefill_kernels", "PrefillRoute",
    "CostPrefillPolicy", "FixedPrefillPolicy",
    "PrefillAttentionPolicy", "shared_prefix_decode", "cascade_decode", "cascade_residual_decode",
    "cascade_tile_agents", "cascade_prefill", "PrefillGroups", "prefill_groups", "prefix_splits",
    "lora_shrink", "lora_expand", "write_kv_pages", "rebuild_kv",
]


# The residual decode keywords every variant takes (the engine's: a host bound, a split count).
ENGINE_DECODE_TUNING = frozenset({"max_seq_len", "num_splits"})
# How each packed route attends (flash_prefill's ``attention``).
_PACKED_ATTENTION = {PrefillRoute.FLASH: "varlen", PrefillRoute.SDPA: "sdpa"}
# What ``variant="auto"`` asks; the engine's KernelAttention holds its own policy object.
DEFAULT_PREFILL_POLICY: PrefillAttentionPolicy = CostPrefillPolicy()


def _triton(use_triton: bool | None, t: torch.Tensor) -> bool:
    return t.is_cuda if use_triton is None else use_triton


def _host_counts(counts: PrefillCounts | None, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor) -> PrefillCounts:
    """``counts``, or the lengths read back from the device (one sync) when the caller has none."""
    if counts is not None:
        return counts
    cu = cu_seqlens_q.tolist()
    return PrefillCounts(tuple(b - a for a, b in zip(cu, cu[1:], strict=False)),
                         tuple(seq_lens.tolist()))


def _host_bounds(counts: PrefillCounts | None) -> dict[str, int]:
    """The paged kernels' launch bounds from host counts (each spares them a read-back)."""
    return {} if counts is None else {"max_q_len": counts.max_query_len,
                                      "max_seq_len": max(counts.seq_lens, default=0)}


def prefill_kernels(q: torch.Tensor, k_cache: torch.Tensor, k_res: torch.Tensor | None = None,
                    flash: FlashSupport | None = None) -> PrefillKernels:
    """Which prefill kernels take these inputs (the policy's ``kernels``): the flash kernels
    ``flash`` found (looked up here when None), and the ws residual prefill where ``k_res``
    (the residual form) is given at a shape it takes and was measured at
    (``MEASURED_WS_PREFILL_SHAPES``)."""
    flash = flash_support(q, k_cache) if flash is None else flash
    ws = False
    if k_res is not None:
        from forkserve.kernels.residual_prefill_gluon import ws_prefill_shape
        ws = ws_prefill_shape(q, k_cache, k_res) in MEASURED_WS_PREFILL_SHAPES
    return PrefillKernels(flash.varlen, flash.paged, ws)


def _route(variant: PrefillRoute | str, allowed: frozenset[PrefillRoute],
           counts: PrefillCounts | None, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
           q: torch.Tensor, k_cache: torch.Tensor, k_res: torch.Tensor | None = None, *,
           tuning: dict[str, object]) -> tuple[PrefillRoute, PrefillCounts | None]:
    """The route, and the host counts: the caller's, or those "auto" read back (so the route
    that needs them does not read them again). ``tuning`` is refused here, in one place,
    wherever no kernel of ours would take it: with "auto" (the policy may pick a route it
    does not tune: round 42, FA4's) and on "paged_flash" (FA4 is not ours to tune)."""
    if variant == "auto":
        if tuning:
            raise ValueError(f"tuning keywords ({', '.join(sorted(tuning))}) need a pinned "
                             f"variant, not 'auto'")
        counts = _host_counts(counts, seq_lens, cu_seqlens_q)
        residual = allowed is RESIDUAL_ROUTES
        found = prefill_kernels(q, k_cache, k_res if residual else None)
        return DEFAULT_PREFILL_POLICY.route(counts, residual, found), counts
    names = sorted(r.value for r in allowed)
    if variant not in names:
        raise ValueError(f"prefill variant must be 'auto' or one of {names}, got {variant!r}")
    route = PrefillRoute(variant)
    if tuning and route is PrefillRoute.PAGED_FLASH:
        raise ValueError(f"the paged_flash route takes no tuning keywords, got "
                         f"{', '.join(sorted(tuning))}")
    return route, counts


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                 *, use_triton: bool | None = None, **tuning) -> torch.Tensor:
    """Decode over the unified paged cache: q ``[batch, H, D]`` -> ``[batch, H, D]``.
    ``tuning``: Triton-only keywords (``max_seq_len``, ``num_splits``, ``block_n``, ...)."""
    if _triton(use_triton, q):
        from forkserve.kernels.decode_attention import paged_decode_triton
        return paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, **tuning)
    return reference.paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  scale: float | None = None, *, use_triton: bool | None = None,
                  variant: PrefillRoute | str = "auto", counts: PrefillCounts | None = None,
                  **tuning) -> torch.Tensor:
    """Varlen causal prefill over the unified paged cache: q ``[total_new, H, D]``.
    ``variant`` (Triton only): "paged" (the Triton kernel), "paged_flash" (FlashAttention-4
    through the block tables: flash_op.py), "flash" / "sdpa" (packed K/V, then the varlen
    flash kernel / SDPA per sequence: flash_prefill.py) or "auto"
    (``DEFAULT_PREFILL_POLICY``). ``counts``:
    the batch's lengths on the host, when the caller has them (else read back once where a
    route needs them). ``tuning``: keywords of a pinned variant's Triton kernel ("auto" and
    "paged_flash" take none: ``ValueError``, rather than keywords silently ignored)."""
    if not _triton(use_triton, q):
        return reference.paged_prefill_ref(q, k_cache, v_cache, block_tables, seq_lens,
                                           cu_seqlens_q, scale)
    route, counts = _route(variant, UNIFIED_ROUTES, counts, seq_lens, cu_seqlens_q, q, k_cache,
                           tuning=tuning)
    if route in PACKED_ROUTES:
        from forkserve.kernels.flash_prefill import flash_prefill
        return flash_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                             _host_counts(counts, seq_lens, cu_seqlens_q), scale,
                             attention=_PACKED_ATTENTION[route], **tuning)
    if route is PrefillRoute.PAGED_FLASH:
        from forkserve.kernels.flash_op import flash_paged
        counts = _host_counts(counts, seq_lens, cu_seqlens_q)
        return flash_paged(q, k_cache, v_cache, block_tables, seq_lens,
                           cu_seqlens_q.to(torch.int32), counts.max_query_len,
                           reference._scale(scale, q.shape[-1]), flash_support(q, k_cache).kernel)
    from forkserve.kernels.prefill_attention import paged_prefill_triton
    return paged_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                **_host_bounds(counts), **tuning)


def residual_decode(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                    k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                    res_block_tables: torch.Tensor, seq_lens: torch.Tensor, b_k_all: torch.Tensor,
                    b_v_all: torch.Tensor, adapter_idx: torch.Tensor, inv_freq: torch.Tensor,
                    scale: float | None = None, *, use_triton: bool | None = None,
                    **tuning) -> torch.Tensor:
    """ResidualAttention decode over the disaggregated cache. ``tuning`` (Triton): a
    ``variant`` and its launch's keywords (``residual_decode_triton``); a call naming no
    variant runs the one ``DEFAULT_DECODE_POLICY`` picks and takes only the keywords every
    variant takes (``ENGINE_DECODE_TUNING``: the engine's), as ``paged_prefill``'s "auto"."""
    args = (q, k_base, v_base, k_res, v_res, block_tables, res_block_tables, seq_lens,
            b_k_all, b_v_all, adapter_idx, inv_freq, scale)
    if _triton(use_triton, q):
        from forkserve.kernels.residual_decode_triton import residual_decode_triton
        if "variant" not in tuning:
            # Refused, not guessed: the policy's pick may not take a keyword (ws takes no pdl),
            # and before round 43 such calls silently ran the Triton default, not the pick.
            extra = set(tuning) - ENGINE_DECODE_TUNING
            if extra:
                raise ValueError(f"tuning keywords ({', '.join(sorted(extra))}) need a pinned "
                                 f"variant")
            tuning["variant"] = DEFAULT_DECODE_POLICY.variant(q, k_base, k_res)
        return residual_decode_triton(*args, **tuning)
    return reference.residual_decode_ref(*args)


def residual_prefill(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                     k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                     res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, b_k_all: torch.Tensor, b_v_all: torch.Tensor,
                     adapter_idx: torch.Tensor, inv_freq: torch.Tensor, scale: float | None = None,
                     *, use_triton: bool | None = None, variant: PrefillRoute | str = "auto",
                     counts: PrefillCounts | None = None, **tuning) -> torch.Tensor:
    """ResidualAttention varlen causal prefill over the disaggregated cache. ``variant``
    (Triton only; prefill_policy.py): "fused" rebuilds key tiles inside the paged kernel,
    "ws" inside one warp-specialized Gluon launch (sm_90),
    "merged" rebuilds every used page once (residual_merge.py) and runs the unified kernel,
    "flash" / "sdpa" rebuild into packed K/V for FlashAttention-2 varlen / SDPA per sequence
    (flash_prefill.py), "auto" asks
    ``DEFAULT_PREFILL_POLICY``. ``counts`` and ``tuning`` as for ``paged_prefill``."""
    args = (q, k_base, v_base, k_res, v_res, block_tables, res_block_tables, seq_lens,
            cu_seqlens_q, b_k_all, b_v_all, adapter_idx, inv_freq, scale)
    if not _triton(use_triton, q):
        return reference.residual_prefill_ref(*args)
    route, counts = _route(variant, RESIDUAL_ROUTES, counts, seq_lens, cu_seqlens_q, q, k_base,
                           k_res, tuning=tuning)
    if route is PrefillRoute.FUSED:
        from forkserve.kernels.prefill_attention import residual_prefill_triton
        return residual_prefill_triton(*args, **_host_bounds(counts), **tuning)
    if route is PrefillRoute.WS:
        from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws
        return residual_prefill_ws(*args, **_host_bounds(counts), **tuning)
    from forkserve.kernels.kv_pack import ResidualPools
    residual = ResidualPools(k_res, v_res, res_block_tables, b_k_all, b_v_all, adapter_idx,
                             inv_freq)
    counts = _host_counts(counts, seq_lens, cu_seqlens_q)
    if route in PACKED_ROUTES:
        from forkserve.kernels.flash_prefill import flash_prefill
        return flash_prefill(q, k_base, v_base, block_tables, seq_lens, cu_seqlens_q, counts, scale,
                             residual, attention=_PACKED_ATTENTION[route], **tuning)
    from forkserve.kernels.prefill_attention import paged_prefill_triton
    from forkserve.kernels.residual_merge import merged_pages
    k, v, tables = merged_pages(k_base, v_base, residual, block_tables, seq_lens, cu_seqlens_q,
                                counts)
    return paged_prefill_triton(q, k, v, tables, seq_lens, cu_seqlens_q, scale,
                                **_host_bounds(counts), **tuning)


def shared_prefix_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, prefix_pages: int,
                         scale: float | None = None, *, use_triton: bool | None = None,
                         **tuning) -> torch.Tensor:
    """Decode for agents that share their first ``prefix_pages`` pages (unified layout).
    Equals ``paged_decode``; the reference is plain decode."""
    if _triton(use_triton, q):
        from forkserve.kernels.shared_prefix import shared_prefix_decode_triton
        return shared_prefix_decode_triton(q, k_cache, v_cache, block_tables, seq_lens,
                                           prefix_pages, scale, **tuning)
    return reference.paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def cascade_tile_agents(group: int) -> int:
    """Sequences per cascade prefix tile for ``group`` query heads per KV head: their GQA
    groups stack into one 128-row query tile (a tensor-core sized product per key tile)."""
    return max(1, 128 // (1 << (group - 1).bit_length()))


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, tile_seqs: torch.Tensor,
                   tile_lens: torch.Tensor, kv_starts: torch.Tensor, scale: float | None = None, *,
                   use_triton: bool | None = None, **tuning) -> torch.Tensor:
    """Decode with cascade tiles (unified layout): the sequences ``tile_seqs [n_tiles, agents]``
    lists (-1 pads) read their first ``tile_lens`` keys once per tile; ``kv_starts [batch]``
    is where each sequence's own suffix starts. Equals ``paged_decode``, its reference."""
    if _triton(use_triton, q):
        from forkserve.kernels.shared_prefix import cascade_decode_triton
        return cascade_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, tile_seqs,
                                     tile_lens, kv_starts, scale, **tuning)
    return reference.paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def cascade_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, groups: PrefillGroups, scale: float | None = None,
                    *, use_triton: bool | None = None, counts: PrefillCounts | None = None,
                    **tuning) -> torch.Tensor:
    """Varlen causal prefill (unified layout) with each group's shared prefix attended once
    for all its members' rows (``groups``: ``prefill_groups``; shared_prefix_prefill.py). Equals
    ``paged_prefill``; the reference is plain prefill. ``counts``: host lengths (spare the
    suffix launch's read-back); ``tuning``: ``cascade_prefill_triton``'s keywords."""
    if not _triton(use_triton, q):
        return reference.paged_prefill_ref(q, k_cache, v_cache, block_tables, seq_lens,
                                           cu_seqlens_q, scale)
    from forkserve.kernels.shared_prefix_prefill import cascade_prefill_triton
    bound = {} if counts is None else {"max_q_len": counts.max_query_len}
    return cascade_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                  groups, scale, **bound, **tuning)


def cascade_residual_decode(q: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
                            k_res: torch.Tensor, v_res: torch.Tensor, block_tables: torch.Tensor,
                            res_block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            b_k_all: torch.Tensor, b_v_all: torch.Tensor, adapter_idx: torch.Tensor,
                            inv_freq: torch.Tensor, tile_seqs: torch.Tensor,
                            tile_lens: torch.Tensor, kv_starts: torch.Tensor,
                            scale: float | None = None, *, use_triton: bool | None = None,
                            **tuning) -> torch.Tensor:
    """ResidualAttention decode with cascade tiles (the split form): a tile's sequences read
    its shared base prefix once, each with its own adapter's residual. Equals
    ``residual_decode``, its reference. ``tuning`` (Triton): ``variant`` "two_pass" (default),
    "msc" or "tiled_scores", ``score_tuning``, the launches' tiles
    (``cascade_residual_decode_triton``)."""
    args = (q, k_base, v_base, k_res, v_res, block_tables, res_block_tables, seq_lens,
            b_k_all, b_v_all, adapter_idx, inv_freq)
    if _triton(use_triton, q):
        from forkserve.kernels.shared_prefix import cascade_residual_decode_triton
        return cascade_residual_decode_triton(*args, tile_seqs, tile_lens, kv_starts, scale,
                                              **tuning)
    return reference.residual_decode_ref(*args, scale)


def lora_shrink(x: torch.Tensor, a_all: torch.Tensor, token_adapter: torch.Tensor,
                out: torch.Tensor | None = None, out_slots: torch.Tensor | None = None, *,
                use_triton: bool | None = None) -> torch.Tensor:
    """``y[t] = x[t] @ A[idx[t]]`` (zeros for idx = -1). With ``out_slots`` the rows go into
    the paged pool ``out`` at flat rows ``out_slots[t]`` (-1 = skip)."""
    if _triton(use_triton, x):
        from forkserve.kernels.lora import lora_shrink_triton
        return lora_shrink_triton(x, a_all, token_adapter, out=out, out_slots=out_slots)
    y = reference.lora_shrink_ref(x, a_all, token_adapter)
    if out_slots is None:
        return y if out is None else out.copy_(y)
    rows = out.view(-1, out.shape[-1])
    keep = out_slots >= 0
    rows[out_slots[keep].long()] = y[keep].to(out.dtype)
    return out


def lora_expand(y: torch.Tensor, b_all: torch.Tensor, token_adapter: torch.Tensor,
                out: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``out[t] += y[t] @ B[idx[t]]`` in place (no-op for idx = -1); returns ``out``."""
    if _triton(use_triton, y):
        from forkserve.kernels.lora import lora_expand_triton
        return lora_expand_triton(y, b_all, token_adapter, out)
    return reference.lora_expand_ref(y, b_all, token_adapter, out)


def write_kv_pages(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slots: torch.Tensor, *, use_triton: bool | None = None) -> None:
    """``k_pool.view(-1, H, D)[slots] = k`` and the same for v (rows ``[W, H, D]``, pools
    ``[pages, P, H, D]``, flat slots ``[W]``): one Triton launch for both."""
    if _triton(use_triton, k):
        from forkserve.kernels.glue import write_kv_triton
        write_kv_triton(k, v, k_pool, v_pool, slots)
    else:
        reference.write_kv_pages_ref(k, v, k_pool, v_pool, slots)


def rebuild_kv(k: torch.Tensor, v: torch.Tensor, k_res: torch.Tensor | None,
               v_res: torch.Tensor | None, b_k: torch.Tensor | None, b_v: torch.Tensor | None,
               cos: torch.Tensor | None, sin: torch.Tensor | None, *,
               use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's ``K = k + RoPE(k_res @ b_k)``, ``V = v + v_res @ b_v`` over ``[n, Hkv, D]``
    rows at positions 0 .. n - 1 (the FRESH route's split-form rebuild): ``b_k, b_v`` one
    slot's pre-scaled ``[r, Hkv * D]`` (None: that side returned as given), ``cos, sin``
    ``Rope.cos_sin`` rows (signed sin). Triton: one launch for both sides
    (residual_rebuild.py); a head dim it does not take (``rebuild_supported``: a power of two
    >= 32) runs the eager form even with ``use_triton=True``, so FRESH serves every model."""
    args = (k, v, k_res, v_res, b_k, b_v, cos, sin)
    if _triton(use_triton, k):
        from forkserve.kernels.residual_rebuild import rebuild_kv_triton, rebuild_supported
        if rebuild_supported(k.shape[-1]):
            return rebuild_kv_triton(*args)
    return reference.rebuild_kv_ref(*args)
