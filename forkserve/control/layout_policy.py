"""Which KV form a new session's pages take: merged K/V, or base + rank-r residual.

The layout fixes it for every session except in the adaptive layout (seed 003, D3), where
ForkKV's split form is chosen only when it pays: the split form costs a slower attention
read (K/V rebuilt from base + residual) and a slower prefill, and buys memory (the base
shared across adapters) and, where an adapter's residual for the prompt is already
published (``base_activations``, or another session of the same adapter), the prefill
itself. Under light load nothing is gained and the merged form keeps unified's speed, so
light load never loses to unified.

Under contention merged alone would leave the batch memory-bound: when the sessions an
admission controller holds back (``Queued``) would not all fit merged but would split, the
session opens split, so every agent runs beside it (merged sessions keep their pages for
life, so splitting later cannot make room). Not some merged first and the rest split: on the
H200 (docs/MULTILORA.md "Round 6") such a mixed batch decoded slower than all split at the
same batch (24.9 against 19.9 ms a step at react W = 32), since each merged agent reads its
own copy of the context while the split agents' cascade reads their shared base once.

A session keeps its form for life: its pages were written in that form. Forks of the same
adapter inherit it; see ``KVCache.fork_kv`` for forks to another adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from forkserve.config import KVForm, KVLayout


@dataclass(frozen=True)
class Queued:
    """Sessions an admission controller holds back behind the one being opened, all alike:
    each its own adapter, ``tokens`` long at its peak (what admission reserves), its first
    ``shared_tokens`` the same as this prompt's (one context, many agents)."""

    sessions: int = 0
    tokens: int = 0
    shared_tokens: int = 0


NOTHING_QUEUED = Queued()


@dataclass(frozen=True)
class LayoutSignals:
    """What a policy may look at when a session opens (pages are the base pool's)."""

    has_adapter: bool
    residual_hit_tokens: int     # prompt tokens whose residual for this adapter is published
    # Base pages that would be load with this session merged: what tables and pins hold (not
    # the evictable cache), every live session's pending prompt, and this prompt's pages less
    # the published merged ones it would share with their holders.
    projected_base_pages: int
    base_pool_pages: int
    # Leading pages of this prompt whose split base live sessions hold: its context is served
    # split now, and a split session joins it for its own pages alone.
    split_held_pages: int = 0
    # The queue (``Queued``) all merged, and all split, sharing only what ``share_base`` lets
    # split sessions of other adapters share (equal where it shares nothing).
    queued_merged_pages: int = 0
    queued_split_pages: int = 0


class LayoutPolicy(Protocol):
    def choose(self, signals: LayoutSignals) -> KVForm: ...


@dataclass(frozen=True)
class FixedForm:
    """Every session in one form: what the unified, full_reuse and disaggregated layouts do."""

    form: KVForm

    def choose(self, signals: LayoutSignals) -> KVForm:
        return self.form


@dataclass(frozen=True)
class PressurePolicy:
    """Split where the residual is already published (the prefill is saved) or under
    contention (the queue would not fit merged beside this session, and would split into
    fewer pages); otherwise merged while this session's merged pages stay under the mark,
    split past it.

    The mark is ``high_water`` of the base pool; it leaves room for the growth of sessions
    (their generated tokens) since merged sessions keep their pages for life. Hysteresis:
    while the context is served split (``split_held_pages``) the mark drops by
    ``hysteresis``, so a session that finished merged does not hand its room to a new merged
    copy that pushes the next arrival split again (merged and split alternating as load
    crosses one line); the mark comes back once the split sessions of that context are gone.
    """

    high_water: float
    hysteresis: float = 0.0
    min_residual_hit: int = 1

    def choose(self, signals: LayoutSignals) -> KVForm:
        if not signals.has_adapter:
            return KVForm.MERGED  # the base model's K/V is the same in both forms
        if signals.residual_hit_tokens >= self.min_residual_hit or self.contended(signals):
            return KVForm.SPLIT
        if signals.projected_base_pages <= self.mark(signals):
            return KVForm.MERGED
        return KVForm.SPLIT

    def mark(self, signals: LayoutSignals) -> float:
        water = self.high_water - (self.hysteresis if signals.split_held_pages else 0.0)
        return max(0.0, water) * signals.base_pool_pages

    def contended(self, signals: LayoutSignals) -> bool:
        """The queue would not fit merged beside this session, and splitting saves pages
        (where split shares nothing across adapters, merged stays: it is faster)."""
        crowded = (signals.projected_base_pages + signals.queued_merged_pages
                   > self.high_water * signals.base_pool_pages)
        return crowded and signals.queued_split_pages < signals.queued_merged_pages


def policy_for(layout: KVLayout, high_water: float, hysteresis: float = 0.0) -> LayoutPolicy:
    """A layout of one form takes it everywhere; one that serves both chooses by pressure."""
    if len(layout.forms) > 1:
        return PressurePolicy(high_water, hysteresis)
    return FixedForm(layout.forms[0])
