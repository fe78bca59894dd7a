"""Counters the engine keeps; the benchmark tables are read from these."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    prefill_tokens: int = 0
    prefill_calls: int = 0
    decode_tokens: int = 0
    transfer_tokens: int = 0
    ms: float = 0.0            # modeled (MockBackend) or measured step time
    prefill_ms: float = 0.0    # prefill + transfer share of ``ms``
    ticks: int = 0
    pruned: int = 0            # residuals dropped before any prefill
    probe_aborts: int = 0      # early-abort probes that did not clear tau
    dropped_chunks: int = 0    # speculative work dropped: parent generation moved
    ttl_expired: int = 0
    slack_filled_tokens: int = 0
    hash_hit_tokens: int = 0     # positions whose whole KV (every side) came from the index
    base_hit_tokens: int = 0     # base (or unified) side alone
    residual_hit_tokens: int = 0
    peak_pages: int = 0        # physical pages in use, all pools
    # Host tier (residual pages): parked instead of dropped, brought back instead of
    # recomputed, dropped for good by the host's own LRU.
    offloaded_pages: int = 0
    restored_pages: int = 0
    restored_tokens: int = 0
    host_dropped_pages: int = 0
    # The backend's host copies: calls (one batch each) and the host's time inside them, so
    # a benchmark shows what D1's copies cost a tick (their bytes: pages x page bytes).
    host_offload_calls: int = 0
    host_restore_calls: int = 0
    host_copy_ms: float = 0.0
    residual_prefill_tokens: int = 0  # residual-side tokens computed by prefill (not restored)
    # Base pages pinned through a tool pause: reused by the next turn, expired, or released
    # under committed pressure.
    pins_resumed: int = 0
    pins_expired: int = 0
    pins_broken: int = 0
    # Items taken out of a tick because they could not run (their session got the error).
    failed_items: int = 0
    # Committed prefills held back a tick: an older in-flight prefill was writing their next
    # page (control/inflight.py); what it published counts in the hit tokens above.
    dedup_held: int = 0
    actions: Counter = field(default_factory=Counter)

    def snapshot(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "actions"}
        d["actions"] = dict(self.actions)
        return d
