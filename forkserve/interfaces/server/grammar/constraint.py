"""GrammarConstraint: one request's grammar state, the ``TokenConstraint`` the sampler consults.

Created when the request starts (one per choice), advanced by the sampler on the engine
thread for each token sampled at the session's tip, dropped with the generation (a
finished, stopped or aborted request simply lets it go: it holds no engine resource).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarConstraint:
    def __init__(self, compiled: "xgr.CompiledGrammar", start: int) -> None:
        """``start``: the position of the first generated token (the prompt's length)."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._start = start
        self._accepted = 0  # tokens accepted, i.e. the next position is start + accepted

    @property
    def completed(self) -> bool:
        """The grammar reached its end (only a stop token may follow)."""
        return self._matcher.is_terminated() or self._matcher.is_completed()

    def _seek(self, position: int) -> None:
        back = self._start + self._accepted - position
        if back > 0:
            self._matcher.rollback(back)
            self._accepted -= back

    def fill_bitmask(self, bitmask: Any, row: int, position: int) -> None:
        self._seek(position)
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int, position: int) -> None:
        self._seek(position)
        if self._matcher.is_terminated():
            return  # the stop token was accepted: the engine ends the generation on it
        if not self._matcher.accept_token(token):
            # The mask allowed only grammatical tokens, so this is an engine bug, not a request's.
            raise RuntimeError(
                f"token {token} at position {position} violates the request's grammar"
            )
        self._accepted += 1
