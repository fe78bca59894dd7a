"""Which KV form a new session's pages take: merged K/V, or base + rank-r residual.

The layout fixes it for every session except in the adaptive layout (seed 003, D3), where
ForkKV's split form is chosen only when it pays: the split form costs a slower attention
read (K/V rebuilt from base + residual) and buys memory (the base shared across adapters)
and, where an adapter's residual for the prompt is already published (``base_activations``,
or another session of the same adapter), the prefill itself. Under light load nothing is
gained and the merged form keeps unified's speed, so light load never loses to unified.

A session keeps its form for life: its pages were written in that form. Forks of the same
adapter inherit it; see ``KVCache.fork_kv`` for forks to another adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from forkserve.config import KVForm, KVLayout


@dataclass(frozen=True)
class LayoutSignals:
    """What a policy may look at when a session opens."""

    has_adapter: bool
    residual_hit_tokens: int     # prompt tokens whose residual for this adapter is published
    # Base pages that would be load with this session merged: what tables and pins hold (not
    # the evictable cache), every live session's pending prompt, and this prompt's pages less
    # the published merged ones it would share with their holders.
    projected_base_pages: int
    base_pool_pages: int


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
    """Split where the residual is already published (the prefill is saved) or when the base
    pool would pass ``high_water`` with this session merged; merged otherwise. The high-water
    mark leaves room for the split sessions that contention will bring, since merged sessions
    keep their pages for life."""

    high_water: float
    min_residual_hit: int = 1

    def choose(self, signals: LayoutSignals) -> KVForm:
        if not signals.has_adapter:
            return KVForm.MERGED  # the base model's K/V is the same in both forms
        if signals.residual_hit_tokens >= self.min_residual_hit:
            return KVForm.SPLIT
        if signals.projected_base_pages > self.high_water * signals.base_pool_pages:
            return KVForm.SPLIT
        return KVForm.MERGED


def policy_for(layout: KVLayout, high_water: float) -> LayoutPolicy:
    """A layout of one form takes it everywhere; one that serves both chooses by pressure."""
    if len(layout.forms) > 1:
        return PressurePolicy(high_water)
    return FixedForm(layout.forms[0])
