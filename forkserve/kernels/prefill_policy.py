"""Which prefill attention runs a varlen batch: the one place that decides it.

Routes (``PrefillRoute``):

* ``PAGED``: the Triton kernel over the unified paged cache (prefill_attention.py);
* ``FUSED``: the same kernel in the residual form, rebuilding each key tile per query block;
* ``WS``: the residual form in one warp-specialized Gluon launch (residual_prefill_gluon.py:
  TMA page gathers, each key tile rebuilt once per 64 or 128 query rows by wgmma); sm_90 and the
  shapes of ``residual_prefill_gluon.supports`` only;
* ``MERGED``: the residual form rebuilt once into temporary pages, then ``PAGED``'s kernel;
* ``FLASH``: each sequence's K/V gathered (and, in the residual form, rebuilt) into one
  packed buffer, then the varlen flash kernel ``flash_op.flash_support`` found
  (FlashAttention-4, else FlashAttention-2 through torch: flash_prefill.py);
* ``PAGED_FLASH``: FlashAttention-4 over the unified paged cache through the block tables
  (``flash_op.flash_paged``): no gather, no pack; where ``FlashSupport.paged``;
* ``SDPA``: the same packed buffer attended per sequence by torch's public SDPA, which picks
  its own backend (cuDNN on Hopper with torch >= 2.11's bundled cuDNN, else flash);
* ``FRESH``: a sequence whose keys are all this step's own tokens (no cached prefix) attended
  by causal SDPA over the step's own q/k/v (rebuilt from base + residual in the residual
  form), no pages read (backend/torch/fresh_prefill.py); one FlashAttention-4 varlen call for
  them all where ``FlashSupport.fresh_varlen``. Chosen per sequence
  (``fresh_items``), before the batch's route: the other sequences keep theirs.
* ``CASCADE``: the chunks of a group whose page tables share a prefix (the control plane's
  ``SeqWork.shared_prefix``) attend it once for all their rows, then each its own suffix,
  merged by log-sum-exp (kernels/shared_prefix_prefill.py). Chosen per group (``cascade_group``),
  unified form only, after ``FRESH`` and before the batch's route.

The decision uses host counts only (``PrefillCounts``: the engine holds them for every step)
and which kernels take the batch's inputs (``PrefillKernels``: the library flash kernels
``flash_op.flash_support`` found, the Gluon residual kernel), so deciding never reads the
device. A policy is a small strategy object: the engine's ``KernelAttention``
holds one, the benchmark and the tests pin a route with ``FixedPrefillPolicy``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class PrefillRoute(str, Enum):
    PAGED = "paged"
    FUSED = "fused"
    WS = "ws"
    MERGED = "merged"
    FLASH = "flash"
    PAGED_FLASH = "paged_flash"
    SDPA = "sdpa"
    FRESH = "fresh"
    CASCADE = "cascade"


PACKED_ROUTES = frozenset({PrefillRoute.FLASH, PrefillRoute.SDPA})
UNIFIED_ROUTES = frozenset({PrefillRoute.PAGED, PrefillRoute.PAGED_FLASH}) | PACKED_ROUTES
RESIDUAL_ROUTES = (frozenset({PrefillRoute.FUSED, PrefillRoute.WS, PrefillRoute.MERGED})
                   | PACKED_ROUTES)


@dataclass(frozen=True)
class PrefillCounts:
    """Host copies of a varlen batch's lengths: new tokens and all keys (cached + new) per
    sequence, in batch order."""

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.seq_lens):
            raise ValueError(f"{len(self.query_lens)} query lengths for "
                             f"{len(self.seq_lens)} sequences")
        if any(q < 0 or q > s for q, s in self._pairs()):
            raise ValueError(f"query lengths {self.query_lens} must lie in 0 .. the sequence's "
                             f"length {self.seq_lens}")

    def _pairs(self) -> zip:
        return zip(self.query_lens, self.seq_lens, strict=True)

    @property
    def new_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def context_tokens(self) -> int:
        """Keys of every sequence, including those with no new token."""
        return sum(self.seq_lens)

    @property
    def packed_keys(self) -> int:
        """Rows of the flash route's packed K/V: the keys of sequences with new tokens."""
        return sum(s for q, s in self._pairs() if q)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_packed_len(self) -> int:
        return max((s for q, s in self._pairs() if q), default=0)

    @property
    def all_cold(self) -> bool:
        """Every sequence with new tokens prefills from position 0 (square causal attention)."""
        return all(q == s for q, s in self._pairs() if q)

    @property
    def causal_pairs(self) -> int:
        """(query, key) pairs the causal mask keeps: query j of a chunk of q over s keys sees
        s - q + j + 1 of them."""
        return sum(q * (s - q) + q * (q + 1) // 2 for q, s in self._pairs())


# The ``(GQA group, rank)`` shapes of the ws residual prefill measured on the H200 (rounds
# 23-27: Llama-3-8B's; round 28: GQA 8, Llama-3-70B's, where it took 8 x 64 over 8K in 0.48
# ms against the fused kernel's 1.21, residual_prefill_gqa8.json). The other groups it
# builds for (1, 2: ``residual_prefill_gluon.ws_prefill_shape``) are checked by the sm_90a
# build and the CUDA tests and stay on the Triton routes until a run measures them.
MEASURED_WS_PREFILL_SHAPES = frozenset({(4, 16), (8, 16)})


@dataclass(frozen=True)
class PrefillKernels:
    """Which kernels take a batch's inputs (device, dtype, head dim, GQA group, rank), found
    once per step by the caller (``kernels.prefill_kernels``) and read by the policy:
    ``varlen``, a varlen flash kernel (``FlashSupport.varlen``); ``paged``, one that reads
    the pages too (``FlashSupport.paged``); ``residual_ws``, the warp-specialized residual
    prefill at a shape it takes and was measured at (``MEASURED_WS_PREFILL_SHAPES``)."""

    varlen: bool = False
    paged: bool = False
    residual_ws: bool = False


NO_KERNELS = PrefillKernels()


class PrefillAttentionPolicy(Protocol):
    def route(self, counts: PrefillCounts, residual: bool,
              kernels: PrefillKernels = NO_KERNELS) -> PrefillRoute:
        """The route for a batch; ``residual``: the disaggregated form (K/V rebuilt from base
        and residual); ``kernels``: which kernels take its inputs."""

    def fresh_items(self, counts: PrefillCounts, residual: bool) -> tuple[bool, ...]:
        """Per sequence: attend it on the ``FRESH`` route (only asked where the step holds
        every new token's own K/V; a True must be a sequence with ``q == s > 0``). The
        sequences left go through ``route`` as a batch of their own."""

    def cascade_group(self, prefix: int, query_lens: tuple[int, ...]) -> bool:
        """Whether the prefill chunks of one group (``query_lens``: their new tokens) over a
        shared prefix of ``prefix`` keys take ``CASCADE`` (only asked in the unified form)."""


def cold_items(counts: PrefillCounts, min_new_tokens: int, max_seqs: int) -> tuple[bool, ...]:
    """The sequences with no cached prefix (``q == s``) of at least ``min_new_tokens`` new
    tokens, the ``max_seqs`` longest of them (ties: batch order)."""
    cold = [i for i, (q, s) in enumerate(counts._pairs()) if q == s and q >= max(1, min_new_tokens)]
    keep = set(sorted(cold, key=lambda i: -counts.query_lens[i])[:max_seqs])
    return tuple(i in keep for i in range(len(counts.query_lens)))


@dataclass(frozen=True)
class CostPrefillPolicy:
    """Packed K/V when the attention work pays for the gather: the packed routes read and
    write every packed key once more before the attention reads it again, an O(keys) cost,
    against the library kernels' speed over our Triton kernel on the O(pairs) attention. So a
    packed route when ``causal_pairs / packed_keys`` reaches the threshold and the buffer
    stays under ``max_packed_keys`` rows (transient, per layer): ``SDPA`` when every sequence
    is a cold prefill and ``sdpa_for_cold`` (torch's SDPA then runs square causal attention
    with its preferred backend, cuDNN on the H200), ``FLASH`` (varlen, bottom-right causal)
    otherwise. Else the Triton kernels, with the residual form's merge-or-fuse rule measured
    on the H200 (react-multilora, docs/KERNELS.md): merge when the context is at most
    ``merge_context_ratio`` times the new tokens. Neither gathering route runs below
    ``min_gather_new_tokens`` new tokens.

    ``FRESH`` (``fresh_items``): every sequence with no cached prefix of at least
    ``fresh_min_new_tokens`` new tokens (``residual_fresh_min_new_tokens`` in the residual
    form), at most ``fresh_max_seqs`` of them per step (the longest; each is one SDPA call,
    plus the rebuild's few launches in the residual form, so a step of many short cold
    prompts keeps the one-launch paged kernel for the rest). It neither gathers nor rebuilds
    from pages. Thresholds measured (H200, kernel_bench_prefill.json; eager, host launches
    included): at commit 16d15b6 FRESH won for unified from 4K and, with the residual
    form's rebuild as ~6 eager launches, only from 32K in that form. With the rebuild as one
    Triton launch (commit 4000238) it wins in both forms from the 1K row on: unified 1K
    0.034 ms against the paged kernel's 0.060; residual 1K 0.061 against fused 0.133, 4K
    0.280 against SDPA's 0.329, 8K 0.936 against 1.037 (the rebuild: 0.010 / 0.048 / 0.033
    ms). Below 1K nothing is measured, so the paged kernels keep those.

    ``WS`` (residual form, where ``kernels.residual_ws``): wherever the Triton kernels would
    run (``MERGED`` or ``FUSED``); the packed routes keep the long chunks their threshold
    gives them (H200, residual_prefill_launches.json: 8 x 512 over 8K, packed FA4 1.86 ms
    against ws 2.19, while ws took 8 x 64 over 8K in 0.28 against the fused kernel's 0.60,
    and 4 x 64 over 32K in 0.56 against 2.38).

    ``PAGED_FLASH`` (unified form, where ``kernels.paged``): FlashAttention-4 reads the pages
    itself, so no gather is paid and the Triton kernel's 1.6-1.9x gap to flash speed goes
    (H200, ``fa4_prefill.json``: 0.90-0.98x torch SDPA's time at 4K-32K on K/V SDPA gets
    contiguous, 0.77x at 1K); from ``paged_flash_min_new_tokens`` new tokens.

    ``CASCADE`` (``cascade_group``): a group of at least ``cascade_min_members`` chunks whose
    shared prefix is at least ``cascade_prefix_ratio`` times their mean new tokens (None:
    never). Each chunk re-reads the prefix in every route, so short chunks over a long prefix
    are memory-bound on it and gain from one read; a long chunk is compute-bound and gains
    little against the extra launch and merge (and gives up the packed routes, whose flash
    attention outruns the Triton kernel where the work is compute). The default, 64 (an 8K
    prefix: chunks of up to 128 tokens; 32K: up to 512), is a conservative first estimate,
    not yet measured on the H200 (kernel_bench --cascade-prefill).

    The flash thresholds are first estimates (gather ~2.7 ns per key per layer at 3 TB/s
    against ~0.02 ns saved per pair at the Llama-3-8B shape); the residual form's is lower
    because its alternative, the fused kernel, is itself 2.3x slower than unified.
    ``min_gather_new_tokens`` is measured (H200, kernel_bench_prefill.json): the routes that
    gather or rebuild K/V before attending (packed, merged) cost ~0.3 ms per call whatever
    its size, so a 1K cold prefill took 0.39 ms through SDPA against 0.08 ms in the paged
    kernel (residual form: SDPA 0.26, merged 0.83, fused 0.13), while
    from 4K new tokens the packed routes win (unified 4K: 0.31 against 0.54; 8 chunks of 512
    over 8K: flash 1.79 against paged 2.23, residual flash 1.86 against merged 2.33).
    """

    paged_flash_min_new_tokens: int = 1
    flash_min_pairs_per_key: float = 128.0
    residual_flash_min_pairs_per_key: float = 32.0
    min_gather_new_tokens: int = 2048
    max_packed_keys: int = 1 << 19
    merge_context_ratio: float = 4.0
    sdpa_for_cold: bool = True
    fresh: bool = True
    fresh_min_new_tokens: int = 1024
    residual_fresh_min_new_tokens: int = 1024
    fresh_max_seqs: int = 16
    cascade_min_members: int = 2
    cascade_prefix_ratio: float | None = None

    def fresh_items(self, counts: PrefillCounts, residual: bool) -> tuple[bool, ...]:
        if not self.fresh:
            return (False,) * len(counts.query_lens)
        least = self.residual_fresh_min_new_tokens if residual else self.fresh_min_new_tokens
        return cold_items(counts, least, self.fresh_max_seqs)

    def cascade_group(self, prefix: int, query_lens: tuple[int, ...]) -> bool:
        if self.cascade_prefix_ratio is None or len(query_lens) < self.cascade_min_members:
            return False
        return prefix * len(query_lens) >= self.cascade_prefix_ratio * sum(query_lens)

    def route(self, counts: PrefillCounts, residual: bool,
              kernels: PrefillKernels = NO_KERNELS) -> PrefillRoute:
        if (kernels.paged and not residual
                and counts.new_tokens >= self.paged_flash_min_new_tokens):
            return PrefillRoute.PAGED_FLASH
        if (kernels.varlen and counts.new_tokens >= self.min_gather_new_tokens
                and 0 < counts.packed_keys <= self.max_packed_keys):
            threshold = (self.residual_flash_min_pairs_per_key if residual
                         else self.flash_min_pairs_per_key)
            if counts.causal_pairs >= threshold * counts.packed_keys:
                cold = self.sdpa_for_cold and counts.all_cold
                return PrefillRoute.SDPA if cold else PrefillRoute.FLASH
        if not residual:
            return PrefillRoute.PAGED
        if kernels.residual_ws:
            return PrefillRoute.WS
        if (counts.new_tokens >= self.min_gather_new_tokens
                and counts.context_tokens <= self.merge_context_ratio * counts.new_tokens):
            return PrefillRoute.MERGED
        return PrefillRoute.FUSED


@dataclass(frozen=True)
class FixedPrefillPolicy:
    """One route for every batch of its form (benchmarks, tests). FLASH runs even where the
    flash op refuses the inputs: it then attends per sequence through SDPA. ``fresh``: every
    sequence with no cached prefix takes ``FRESH`` first (where the step holds its K/V), the
    others the pinned route. ``cascade``: every group of two or more chunks takes ``CASCADE``
    (unified form)."""

    unified: PrefillRoute = PrefillRoute.PAGED
    residual: PrefillRoute = PrefillRoute.FUSED
    fresh: bool = False
    cascade: bool = False

    def __post_init__(self) -> None:
        if self.unified not in UNIFIED_ROUTES:
            raise ValueError(f"unified prefill route must be one of {sorted(UNIFIED_ROUTES)}, "
                             f"got {self.unified}")
        if self.residual not in RESIDUAL_ROUTES:
            raise ValueError(f"residual prefill route must be one of {sorted(RESIDUAL_ROUTES)}, "
                             f"got {self.residual}")

    def fresh_items(self, counts: PrefillCounts, residual: bool) -> tuple[bool, ...]:
        if not self.fresh:
            return (False,) * len(counts.query_lens)
        return cold_items(counts, 1, len(counts.query_lens))

    def cascade_group(self, prefix: int, query_lens: tuple[int, ...]) -> bool:
        return self.cascade and len(query_lens) >= 2

    def route(self, counts: PrefillCounts, residual: bool,
              kernels: PrefillKernels = NO_KERNELS) -> PrefillRoute:
        return self.residual if residual else self.unified
