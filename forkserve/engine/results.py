"""Frozen results of the Engine's verbs."""
from __future__ import annotations

from dataclasses import dataclass

from forkserve.adapter_key import AdapterId


@dataclass(frozen=True)
class SessionHandle:
    id: int
    tip: int  # the committed tip at open time


@dataclass(frozen=True)
class SessionSummary:
    """What the interfaces read of one open session, copied out (``Engine.session_summary``)."""

    adapter: AdapterId | None
    peak_tokens: int  # the most KV tokens it held that it could not give back (seed 000's peak)


@dataclass(frozen=True)
class CommitResult:
    session_id: int
    tip: int                 # the new committed tip
    bound_node: int | None   # the speculative branch whose pages were bound, if any
    matched_tokens: int      # longest common prefix with that branch
    prefilled_tokens: int    # the unmatched tail actually prefilled
    aborted: tuple[int, ...]


@dataclass(frozen=True)
class GenerateResult:
    tokens: tuple[int, ...]
    finish_reason: str  # "length" | "stop"


@dataclass(frozen=True)
class DrainReport:
    ticks: int
    prefill_tokens: int
    decode_tokens: int
    slack_filled_tokens: int


@dataclass(frozen=True)
class SharedPrefill:
    tokens: int              # published tokens (full pages) of the shared context
    adapters: tuple[AdapterId, ...]  # whose residuals were written from the base activations
                                     # (as the caller named them)
    prefilled_tokens: int    # what the pass computed (0 when everything was published)


@dataclass(frozen=True)
class AbortResult:
    released_nodes: tuple[int, ...]
    freed_pages: int
