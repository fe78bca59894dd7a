"""CallLoopScorer: a loop check that reads tool calls instead of counting their markup.

Every tool call of a format repeats the same frame (SmolLM2's ``<tool_call>[{"name": "``,
``", "arguments": {"``, ``"}}]</tool_call>``), so ``LoopScorer``'s n-gram count calls a new
call a loop because its markup was seen before. On a residual that holds tool calls this
scorer judges the calls themselves: a call identical (same name, same canonical arguments)
to one of the path's recent calls, or to an earlier call of the residual, is a repeat; a new
call is not, however much markup it shares. Text without a call keeps the n-gram rule.

Control never parses a tool format: the interfaces layer, which knows the model's format,
supplies a ``CallReader`` (``server/tools/call_reader.py``), as it supplies the legality
scorer's ``CallChecker``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from forkserve.control.scorers import LoopScorer, Score


@dataclass(frozen=True)
class Call:
    """One parsed tool call; two calls are the same call when both fields are equal."""

    name: str
    arguments: str  # canonical JSON (sorted keys, no whitespace): equal arguments, equal text


class CallReader(Protocol):
    """The tool calls a token sequence holds (the interfaces layer supplies it)."""

    def __call__(self, tokens: Sequence[int]) -> tuple[Call, ...]:
        """Every well-formed call in the tokens' text, in order; () when none parses."""


class CallLoopScorer:
    """Score = 1 - (fraction of the residual's calls that repeat a recent call).

    ``recent``: how many of the history's last calls count as recent. ``text`` judges a
    residual with no call (today's n-gram rule); its window and loop fraction apply here too.
    """

    def __init__(self, calls: CallReader, text: LoopScorer | None = None,
                 recent: int = 8) -> None:
        if recent < 1:
            raise ValueError("CallLoopScorer needs recent >= 1")
        self.calls, self.text, self.recent = calls, text or LoopScorer(), recent

    def score(self, history: Sequence[int], residual: Sequence[int]) -> Score:
        mine = self.calls(residual)
        if not mine:
            return self.text.score(history, residual)
        seen = set(self.calls(history[-self.text.window:])[-self.recent:])
        repeated = 0
        for call in mine:
            repeated += call in seen
            seen.add(call)  # calling the same tool twice in one residual is a loop too
        frac = repeated / len(mine)
        return Score(round(1.0 - frac, 4), is_loop=frac >= self.text.loop_fraction,
                     reason=f"{repeated}/{len(mine)} calls repeat a recent call")
