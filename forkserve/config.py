"""ForkServeConfig: every tunable of the system in one frozen object.

Shared by all layers (it imports nothing from the package), so L1 backends and the L2
control plane read the same page size and budgets.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass


class AdmitMode(str, enum.Enum):
    """Which admission rule decides a residual's fate (seed 000: one rule at a time)."""

    SCORE = "score"    # thresholds tau_pre / tau on the scorers' output
    WINNER = "winner"  # keep only the winner (index 0)
    TOP_M = "top_m"    # keep the m best-scored residuals
    ALPHA = "alpha"    # keep while the cumulative score mass is below alpha


class KVForm(str, enum.Enum):
    """How one session's K/V is stored. The control plane decides it per session at open
    (``control/layout_policy.py``; the pages are written in it, so it holds for life) and
    hands it to the backend with every item (``SeqWork.form``)."""

    MERGED = "merged"  # one table of merged K/V (keyed under the adapter where it differs)
    SPLIT = "split"    # a shared base table + this adapter's residual table


class KVLayout(str, enum.Enum):
    """How K/V pages are stored (seed 001)."""

    UNIFIED = "unified"              # per-adapter merged K/V (vLLM / SGLang prefix caching)
    DISAGGREGATED = "disaggregated"  # shared base K(RoPE)/V + per-adapter rank-r residual
    FULL_REUSE = "full_reuse"        # merged K/V shared across adapters (lossy baseline)
    # Per session, merged K/V (unified) while memory is plentiful, base + residual under
    # contention or where the residual is already published (seed 003, D3).
    ADAPTIVE = "adaptive"

    @property
    def forms(self) -> tuple[KVForm, ...]:
        """The forms this layout's sessions take (more than one: chosen per session)."""
        return _LAYOUT_FORMS[self]

    @property
    def has_residual_pool(self) -> bool:
        """Whether the layout keeps a BASE and a RESIDUAL pool (else one UNIFIED pool)."""
        return KVForm.SPLIT in self.forms


_LAYOUT_FORMS = {
    KVLayout.UNIFIED: (KVForm.MERGED,),
    KVLayout.DISAGGREGATED: (KVForm.SPLIT,),
    KVLayout.FULL_REUSE: (KVForm.MERGED,),
    KVLayout.ADAPTIVE: (KVForm.MERGED, KVForm.SPLIT),
}


class ShareBase(str, enum.Enum):
    """Who may read base-side K/V an adapter's forward pass wrote (disaggregated, adaptive
    and full_reuse layouts). The base model always reads only its own, exact pages."""

    # Every adapter reads every adapter's base pages (ForkKV's sharing; the approximation
    # docs/QUALITY.md measures).
    CROSS_ADAPTER = "cross_adapter"
    # Each adapter reads only the base pages its own forward wrote: exact, shares nothing
    # across adapters but the base model's own pages before an aLoRA's activation point.
    EXACT = "exact"
    # Neutral writer: an adapter reads the base model's pages (a base-model pass over the
    # shared context) and its own forward's, never another adapter's. Every reader gets the
    # same base K/V, whoever came first; exact for the base model (docs/QUALITY.md, mode a).
    NEUTRAL = "neutral"

    @property
    def reads_base_model(self) -> bool:
        """Whether an adapter's match also takes pages the base model published."""
        return self is not ShareBase.EXACT


class BaseCorrection(str, enum.Enum):
    """What a split item does to base K/V another forward wrote before it attends over it
    (docs/QUALITY.md, mode d). Its own pages and the base model's reads are never changed."""

    NONE = "none"      # read as stored (ForkKV)
    # Add the (writer, reader) pair's estimated offset, fitted once on anchor prompts both
    # computed (``backend/torch/offset_table.py``); eager attention only.
    OFFSET = "offset"


class PrefixDedup(str, enum.Enum):
    """Whether a committed prefill computes full pages another in-flight prefill is already
    writing under a key it may read (``control/inflight.py``)."""

    # It waits for them to be published and matches them then (vLLM / SGLang behaviour).
    IN_FLIGHT = "in_flight"
    # Every prefill computes its own copy until a page is published (the seed's arithmetic).
    OFF = "off"


@dataclass(frozen=True)
class ForkServeConfig:
    page_size: int = 16
    num_pages: int = 4096
    num_residual_pages: int = 4096
    kv_layout: KVLayout = KVLayout.UNIFIED
    # Adaptive layout: a new session keeps merged K/V while the base pool, with every live
    # session's pending prompt and this one counted, stays under this fraction of its pages.
    adaptive_high_water: float = 0.9
    # ...less this fraction while split sessions hold this prompt's context (hysteresis:
    # ``PressurePolicy``), so the form does not alternate as load crosses the mark.
    adaptive_hysteresis: float = 0.2
    # Where admission holds a session until its pages fit (``Queued.holds_for_room``), a queue
    # that would not fit merged runs merged in waves up to this many times the mark, and splits
    # past it. 1.5: with the split form's prefill in the ws kernel (issue 15 round 23), react
    # at W = 32 (1.75 waves at the 8B shape in 24 GiB) ran faster all split than merged in
    # waves on the H200 (disaggregated 2.64 against unified 2.48 tasks/s,
    # react_multilora_issue15_round23_ws.json); before it, merged in waves had won there (2.30
    # against 2.12, docs/MULTILORA.md "Round 10"). At W = 64 (3.5 marks) 4 (merged) lost
    # react to 2 (split) by 6% (docs/MULTILORA.md "Round 14").
    adaptive_split_waves: float = 1.5
    share_base: ShareBase = ShareBase.CROSS_ADAPTER
    # Selective recompute (disaggregated layout; docs/QUALITY.md, mode b): in these decoder
    # layers an adapter's split item keeps its own merged K/V in its residual pages instead
    # of reading the shared base pages (and its residual). () shares every layer.
    recompute_layers: tuple[int, ...] = ()
    # Offset correction (mode d): a reader's base K/V from another writer is corrected on read.
    base_correction: BaseCorrection = BaseCorrection.NONE
    # Memory the spine may occupy, in tokens (H of seed 000); decode slots C = H // M_spine.
    hbm_tokens: int = 65536
    spec_chunk: int = 512
    # Tokens one tick may process (prefill chunks + decode steps).
    max_batch_tokens: int = 8192
    max_context: int = 32768
    # Prior estimate of prefill cost (ms per token) to decide whether a known suffix fits
    # the tool pause; refined from measured step costs.
    prefill_ms_per_token: float = 0.012
    branch_cap: int = 6
    grammar_top_m: int = 3
    q_min: float = 0.35
    tau_pre: float = 0.15
    tau: float = 0.45
    admit_mode: AdmitMode = AdmitMode.SCORE
    admit_alpha: float = 0.9
    # Cascade off = every residual is prefilled on its aliased trunk (the `alias` system).
    cascade: bool = False
    # Early abort: decode a probe of this many tokens before extending to the budget.
    early_abort_probe_tokens: int = 4
    # Speculative branch budget (tokens generated to fill a pause) when the cascade keeps it.
    speculate_budget_tokens: int = 16
    # 1 ms of time-between-tokens weighs as much as this many ms of time-to-first-token.
    tbt_weight: float = 4.0
    # Seconds a speculative node lives without being touched; None disables TTL.
    node_ttl_s: float | None = 60.0
    vocab_size: int = 32000
    # Disaggregated prefill/decode: kept residual tails move over a connector.
    disaggregated_prefill: bool = False
    # Host (CPU) tier for evicted RESIDUAL pages, in pages; 0 = evicted residual pages are
    # dropped (the backend must implement ``HostOffload`` for a non-zero value to matter).
    host_residual_pages: int = 0
    # Pin a closed session's published base pages through the tool pause that usually
    # follows (an agent's next turn re-opens the same context); the pin's TTL is a quantile
    # of observed pause lengths (``control/pause_ttl.py``), ``pause_ttl_prior_s`` before any.
    pause_pin: bool = False
    pause_ttl_quantile: float = 0.9
    pause_ttl_prior_s: float = 30.0
    # Shared-prefix (cascade) attention: items of one step whose page tables start with at
    # least this many tokens of the same pages read them once per group (control/sharing.py);
    # None: every item reads its whole table.
    shared_prefix_min_tokens: int | None = 256
    # Sessions in plain steady decode skip the per-item path: kept in a set across ticks,
    # stepped as one DecodeBatch (engine/steady.py). Off: every item takes the general path
    # (the same results; tests compare the two).
    steady_decode: bool = True
    # Overlap (needs steady_decode): a tick whose step holds steady rows alone returns with
    # the step in flight; the next tick prepares its successor while it runs and launches it
    # with the tokens read back (Stepper._overlapped). Any verb settles it first
    # (``Engine.sync``). A stop token is seen one step late (that step's work is taken back).
    overlap: bool = False
    # In-flight prefix deduplication: sessions opened together on one prefix compute it once.
    prefix_dedup: PrefixDedup = PrefixDedup.IN_FLIGHT
    # VllmBackend, decode-ahead: a committed plain decode asks vLLM for this many tokens in
    # one request and serves the rest from a lookahead while the Engine writes exactly them
    # (backend/vllm/lookahead.py). 1: one vLLM request per sequence per step.
    vllm_decode_ahead: int = 8

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "num_residual_pages", "hbm_tokens",
                     "spec_chunk", "branch_cap", "vocab_size", "max_batch_tokens", "max_context",
                     "vllm_decode_ahead"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ForkServeConfig.{name} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.host_residual_pages < 0:
            raise ValueError("ForkServeConfig.host_residual_pages must be >= 0, got "
                             f"{self.host_residual_pages}")
        if self.shared_prefix_min_tokens is not None and self.shared_prefix_min_tokens < 1:
            raise ValueError(f"ForkServeConfig.shared_prefix_min_tokens must be >= 1 or None, "
                             f"got {self.shared_prefix_min_tokens}")
        if self.pause_ttl_prior_s < 0:
            raise ValueError("ForkServeConfig.pause_ttl_prior_s must be >= 0, got "
                             f"{self.pause_ttl_prior_s}")
        if not 0.0 < self.pause_ttl_quantile <= 1.0:
            raise ValueError("ForkServeConfig.pause_ttl_quantile must be in (0, 1], got "
                             f"{self.pause_ttl_quantile}")
        for name in ("tau_pre", "tau", "q_min", "admit_alpha", "adaptive_high_water",
                     "adaptive_hysteresis"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ForkServeConfig.{name} must be in [0, 1], got "
                                 f"{getattr(self, name)}")
        if not 1.0 <= self.adaptive_split_waves < math.inf:
            raise ValueError("ForkServeConfig.adaptive_split_waves must be >= 1 and finite, got "
                             f"{self.adaptive_split_waves}")
        object.__setattr__(self, "admit_mode", AdmitMode(self.admit_mode))
        object.__setattr__(self, "kv_layout", KVLayout(self.kv_layout))
        object.__setattr__(self, "share_base", ShareBase(self.share_base))
        layers = tuple(self.recompute_layers)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in layers) \
                or list(layers) != sorted(set(layers)):
            raise ValueError("ForkServeConfig.recompute_layers must be increasing layer indices "
                             f">= 0, got {self.recompute_layers!r}")
        if layers and not self.kv_layout.has_residual_pool:
            raise ValueError("ForkServeConfig.recompute_layers needs a layout with a residual pool "
                             f"(disaggregated, adaptive), not {self.kv_layout.value}")
        if layers and self.host_residual_pages:
            raise ValueError("ForkServeConfig.recompute_layers: the host tier does not carry the "
                             "recompute layers' K/V; set host_residual_pages = 0")
        object.__setattr__(self, "recompute_layers", layers)
        object.__setattr__(self, "base_correction", BaseCorrection(self.base_correction))
        if self.base_correction is not BaseCorrection.NONE and not self.kv_layout.has_residual_pool:
            raise ValueError("ForkServeConfig.base_correction corrects shared base pages: it needs "
                             "a layout with a residual pool (disaggregated, adaptive), not "
                             f"{self.kv_layout.value}")
        object.__setattr__(self, "prefix_dedup", PrefixDedup(self.prefix_dedup))

    def replace(self, **changes) -> "ForkServeConfig":
        return dataclasses.replace(self, **changes)


def plus_config(**overrides) -> ForkServeConfig:
    """The full cascade (`--system forkserve_plus`): hash, loop skip, early abort, slack fill."""
    return ForkServeConfig(cascade=True, **overrides)


def app_config(**overrides) -> ForkServeConfig:
    """Cascade on, tuned for interactive apps: TBT weighs more, shorter speculation budget."""
    base = dict(cascade=True, tbt_weight=8.0, speculate_budget_tokens=8)
    base.update(overrides)
    return ForkServeConfig(**base)
