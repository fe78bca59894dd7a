"""GrammarConstraint: one request's grammar state, the ``TokenConstraint`` the sampler consults;
GrammarBatchFill: the ``BitmaskFiller`` that fills a step's grammar rows in one call.

A constraint is created when the request starts (one per choice), advanced by the sampler on
the engine thread for each token sampled at the session's tip, dropped with the generation (a
finished, stopped or aborted request simply lets it go: it holds no engine resource). The
batch fill is stateless: one per process, shared by every constraint.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarBatchFill:
    """Row after row, in the one call: on the H200 (benchmarks/results/grammar_bench_h200.json)
    xgrammar's ``BatchGrammarMatcher`` took 0.42 / 1.02 ms per step at batch 1 / 64 against
    0.06 / 0.26 ms for the plain loop (its thread pool costs more than 64 fills), and on the
    CPU the two were even; a parallel fill is a drop-in ``BitmaskFiller`` when a measurement
    with more varied grammar states favours it."""

    def fill(self, bitmask: Any, rows: Sequence[tuple["GrammarConstraint", int, int]]) -> None:
        for constraint, row, position in rows:
            constraint.matcher_at(position).fill_next_token_bitmask(bitmask, row)


@functools.cache
def _batch_fill() -> GrammarBatchFill:
    return GrammarBatchFill()


class GrammarConstraint:
    def __init__(self, compiled: "xgr.CompiledGrammar", start: int) -> None:
        """``start``: the position of the first generated token (the prompt's length)."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._start = start
        self._accepted = 0  # tokens accepted, i.e. the next position is start + accepted
        self.filler = _batch_fill()

    @property
    def completed(self) -> bool:
        """The grammar reached its end (only a stop token may follow)."""
        return self._matcher.is_terminated() or self._matcher.is_completed()

    def matcher_at(self, position: int) -> "xgr.GrammarMatcher":
        """The matcher, rolled back to ``position`` if it has passed it (a resampled position)."""
        back = self._start + self._accepted - position
        if back > 0:
            self._matcher.rollback(back)
            self._accepted -= back
        return self._matcher

    def accept(self, token: int, position: int) -> None:
        matcher = self.matcher_at(position)
        if matcher.is_terminated():
            return  # the stop token was accepted: the engine ends the generation on it
        if not matcher.accept_token(token):
            # The mask allowed only grammatical tokens, so this is an engine bug, not a request's.
            raise RuntimeError(
                f"token {token} at position {position} violates the request's grammar"
            )
        self._accepted += 1
