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
life, so splitting later cannot make room). Where the controller holds a session back until
its pages fit (``Queued.holds_for_room``: the bench driver), a queue that does not fit merged
can instead run merged in waves, as unified runs it; it splits only past ``split_waves``
waves of the mark. On the H200 (docs/MULTILORA.md "Round 10") react at W = 32, about 1.75
waves, ran faster merged in waves than all split (2.30 against 2.12 tasks/s), and mapreduce
there within 5% either way (2.98 merged in waves against 2.96 split): a second wave costs
less than the split form's slower attention, while past two the last wave waits behind two
whole rounds of prefill and decode (that side is not measured on the H200 yet). Where every
queued open runs as its turn comes (the server: no memory admission), there are no
waves: a queue that does not fit merged splits.

Not some merged and the rest split: on the H200 (docs/MULTILORA.md "Round 6") such a mixed
batch decoded slower than all split at the same batch (24.9 against 19.9 ms a step at react
W = 32), since each merged agent reads its own copy of the context while the split agents'
cascade reads their shared base once. So a held session past the mark waits merged rather
than opening split beside the merged ones.

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
    # Whether the controller opens a session only once its pages, in the form ``layout_form``
    # gives, fit beside what it has admitted (the bench driver's reservations): a merged
    # session that does not fit then waits, so the queue can run merged in waves. False where
    # every queued open runs as its turn comes, whatever the room (the server: no memory
    # admission); meaningful with an empty queue too (the last of a burst still waits).
    holds_for_room: bool = False


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
    # This prompt's base pages merged, alone (nothing shared): past the mark, it would never
    # find merged room however long admission held it.
    session_pages: int = 0
    holds_for_room: bool = False   # ``Queued.holds_for_room``


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
    fewer pages); otherwise merged while this session's merged pages stay under the mark.
    Past the mark: merged where admission holds the session until merged room frees (it
    waits for the next wave; ``waits_merged``), split otherwise.

    The mark is ``high_water`` of the base pool; it leaves room for the growth of sessions
    (their generated tokens) since merged sessions keep their pages for life. Where admission
    holds sessions for room, contention starts only past ``split_waves`` times the mark: up to
    there the queue runs merged in waves. Hysteresis: while the context is served split
    (``split_held_pages``) the mark drops by ``hysteresis``, so a session that finished merged
    does not hand its room to a new merged copy that pushes the next arrival split again
    (merged and split alternating as load crosses one line), and a held session past the
    mark joins the split sessions' base instead of waiting merged beside them; the mark comes
    back once the split sessions of that context are gone.
    """

    high_water: float
    hysteresis: float = 0.0
    min_residual_hit: int = 1
    # 1.0: split as soon as the queue would not fit merged beside this session, held or not.
    split_waves: float = 1.0

    def choose(self, signals: LayoutSignals) -> KVForm:
        if not signals.has_adapter:
            return KVForm.MERGED  # the base model's K/V is the same in both forms
        if signals.residual_hit_tokens >= self.min_residual_hit or self.contended(signals):
            return KVForm.SPLIT
        if signals.projected_base_pages <= self.mark(signals) or self.waits_merged(signals):
            return KVForm.MERGED
        return KVForm.SPLIT

    def mark(self, signals: LayoutSignals) -> float:
        water = self.high_water - (self.hysteresis if signals.split_held_pages else 0.0)
        return max(0.0, water) * signals.base_pool_pages

    def contended(self, signals: LayoutSignals) -> bool:
        """The queue would not fit merged beside this session (where admission holds sessions
        for room: not within ``split_waves`` waves of the mark), and splitting saves pages
        (where split shares nothing across adapters, merged stays: it is faster)."""
        waves = self.split_waves if signals.holds_for_room else 1.0
        crowded = (signals.projected_base_pages + signals.queued_merged_pages
                   > waves * self.high_water * signals.base_pool_pages)
        return crowded and signals.queued_split_pages < signals.queued_merged_pages

    def waits_merged(self, signals: LayoutSignals) -> bool:
        """Past the mark and not contended, a held session waits for merged room (its wave)
        rather than open split beside merged sessions (a mixed batch); not where the context
        is already served split (it joins that base for its own pages) nor where it alone
        passes the mark (merged room would never come)."""
        return (signals.holds_for_room and not signals.split_held_pages
                and signals.session_pages <= self.mark(signals))


def policy_for(layout: KVLayout, high_water: float, hysteresis: float,
               split_waves: float) -> LayoutPolicy:
    """A layout of one form takes it everywhere; one that serves both chooses by pressure."""
    if len(layout.forms) > 1:
        return PressurePolicy(high_water, hysteresis, split_waves=split_waves)
    return FixedForm(layout.forms[0])
