"""The cascade: one action per residual, at the cheapest stage that can still reject it.

Stages, in the order the cascade decides them (seed 000): the free exits first, then the
residuals that cost GPU work; a published prefix cuts any of those to its miss tail:

=============  ==============================================  ===================
Action         When                                            GPU work
=============  ==============================================  ===================
HASH_SKIP      published full pages cover the residual          0
DRAFT_SKIP     a loop: loop score < tau_pre                     0
REJECTED       the admit_mode rule declined it                  0
EARLY_ABORT    score < tau (not a loop)                         prefill (the miss tail
                                                                 if a prefix is published)
                                                                 + a probe; budget if it
                                                                 clears tau
HASH_PARTIAL   a proper prefix is published                     the miss tail
PREFILL        otherwise                                        the residual
=============  ==============================================  ===================

The winner (index 0) and known suffixes (p = 1) are always kept (HASH_* or PREFILL).
With the cascade off (the ``alias`` system) every residual is a PREFILL.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from forkserve.config import ForkServeConfig
from forkserve.control.admission import Candidate, make_rule
from forkserve.control.scorers import Scorer


class Action(str, enum.Enum):
    HASH_SKIP = "hash_skip"
    DRAFT_SKIP = "draft_skip"
    REJECTED = "rejected"
    HASH_PARTIAL = "hash_partial"
    EARLY_ABORT = "early_abort"
    PREFILL = "prefill"

    @property
    def prunes(self) -> bool:
        """The residual is dropped before any of its tokens is prefilled."""
        return self in (Action.DRAFT_SKIP, Action.REJECTED)


@dataclass(frozen=True)
class Decision:
    action: Action
    score: float | None
    hit_tokens: int   # residual tokens covered by published pages
    miss_tokens: int  # residual tokens to prefill (before any probe)
    reason: str = ""


@dataclass(frozen=True)
class Residual:
    index: int
    priority: float
    known: bool                 # p = 1: a harness wrapper that will certainly follow
    history: Sequence[int]      # the branch's committed tokens before the residual
    tokens: Sequence[int]       # the residual itself
    hit_tokens: int             # of ``tokens``, how many published pages already cover


class Cascade:
    def __init__(self, config: ForkServeConfig, scorer: Scorer) -> None:
        self.config = config
        self.scorer = scorer
        self.rule = make_rule(config)

    def decide(self, residual: Residual,
               admitted: Sequence[Candidate]) -> tuple[Decision, Candidate]:
        """Decide one residual; ``admitted`` are its siblings already kept, in order."""
        n, hit = len(residual.tokens), residual.hit_tokens
        if not self.config.cascade:
            return (Decision(Action.PREFILL, None, 0, n, "cascade off"),
                    Candidate(residual.index, residual.priority, 1.0))
        if hit >= n:
            return (Decision(Action.HASH_SKIP, None, n, 0, "published pages cover the residual"),
                    Candidate(residual.index, residual.priority, 1.0))
        score = self.scorer.score(residual.history, residual.tokens)
        cand = Candidate(residual.index, residual.priority, score.value)
        kept_always = residual.index == 0 or residual.known
        if not kept_always:
            if score.is_loop and score.value < self.config.tau_pre:
                return Decision(Action.DRAFT_SKIP, score.value, hit, 0, score.reason), cand
            if not self.rule.admit(cand, admitted):
                return Decision(Action.REJECTED, score.value, hit, 0,
                                f"admit_mode={self.config.admit_mode.value}"), cand
        # A published prefix makes a residual cheaper, not better: a low score still earns
        # the probe (over the miss tail), or every call sharing a committed call's opening
        # tokens would skip the legality stage.
        if not kept_always and score.value < self.config.tau:
            return Decision(Action.EARLY_ABORT, score.value, hit, n - hit, score.reason), cand
        if hit > 0:
            return Decision(Action.HASH_PARTIAL, score.value, hit, n - hit, "miss tail"), cand
        return Decision(Action.PREFILL, score.value, 0, n, score.reason), cand
