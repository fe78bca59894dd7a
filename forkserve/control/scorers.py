"""Residual scorers: how likely a guessed branch is worth its KV.

A scorer sees the branch's recent committed history and the residual's tokens and
returns a ``Score`` in [0, 1]. They are strategies; the cascade combines them. Shipped:

* ``LoopScorer``  — repeated n-grams against the branch's recent history. A residual
  that mostly repeats what was already said is a loop (the only thing DRAFT_SKIP skips).
  A residual of tool calls is judged by its calls instead (``call_loop.CallLoopScorer``).
* ``LegalityScorer`` — a tool call whose arguments do not parse is illegal text; given a
  ``CallChecker`` (the server supplies one over its grammar engine), a residual that cannot
  parse as a tool call of the model's format is rejected exactly.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


@dataclass(frozen=True)
class Score:
    value: float
    is_loop: bool = False
    reason: str = ""


class Scorer(Protocol):
    def score(self, history: Sequence[int], residual: Sequence[int]) -> Score: ...


class LoopScorer:
    """Score = 1 - (fraction of the residual's n-grams already seen in the recent history).

    ``is_loop`` when at least ``loop_fraction`` of them repeat: the branch is re-emitting
    a recent thought. A residual shorter than ``n`` has no evidence and scores 1.
    """

    def __init__(self, n: int = 4, window: int = 1024, loop_fraction: float = 0.8) -> None:
        if n < 1 or window < n:
            raise ValueError("LoopScorer needs n >= 1 and window >= n")
        self.n, self.window, self.loop_fraction = n, window, loop_fraction

    def score(self, history: Sequence[int], residual: Sequence[int]) -> Score:
        n = self.n
        if len(residual) < n:
            return Score(1.0, reason="too short to judge")
        context = list(history[-self.window:])
        seen = {tuple(context[i:i + n]) for i in range(len(context) - n + 1)}
        grams = [tuple(residual[i:i + n]) for i in range(len(residual) - n + 1)]
        repeated = 0
        for gram in grams:
            if gram in seen:
                repeated += 1
            seen.add(gram)  # a residual that repeats itself is a loop too
        frac = repeated / len(grams)
        is_loop = frac >= self.loop_fraction
        return Score(round(1.0 - frac, 4), is_loop=is_loop,
                     reason=f"{repeated}/{len(grams)} {n}-grams repeat recent history")


class CallChecker(Protocol):
    """The exact check of a residual's tool calls (the interfaces layer supplies it with its
    grammar engine: control never imports one)."""

    def __call__(self, tokens: Sequence[int]) -> str | None:
        """Why ``tokens`` hold a tool call the grammar rejects; None for a legal call, or none."""


# Tool calls in the ReAct / Hermes styles: ``Action: name({json})`` or
# ``<tool_call>{json}</tool_call>``.
_ACTION = re.compile(r"Action:\s*([A-Za-z_][\w.]*)\s*\(")
_TOOL_TAG = "<tool_call>"


class LegalityScorer:
    """Illegal text (a tool call that does not parse) scores ``illegal_score``.

    Text with no tool call is neutral (1.0). ``decode`` turns token ids into text; it
    comes from the backend's tokenizer. ``calls``: the exact grammar check, asked first
    (the ReAct ``Action:`` style, which no grammar covers, keeps the parse check).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], illegal_score: float = 0.22,
                 calls: CallChecker | None = None) -> None:
        self.decode = decode
        self.illegal_score = illegal_score
        self.calls = calls

    def score(self, history: Sequence[int], residual: Sequence[int]) -> Score:
        problem = self.calls(residual) if self.calls is not None else None
        if problem is None:
            problem = self._problem(self.decode(residual))
        if problem is None:
            return Score(1.0)
        return Score(self.illegal_score, reason=problem)

    @staticmethod
    def _problem(text: str) -> str | None:
        if _TOOL_TAG in text:
            body = text.split(_TOOL_TAG, 1)[1]
            if "</tool_call>" not in body:
                return "unterminated <tool_call>"
            return _json_problem(body.split("</tool_call>", 1)[0])
        match = _ACTION.search(text)
        if match is None:
            return None
        args, depth = text[match.end():], 1
        for i, ch in enumerate(args):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                return _json_problem(args[:i]) if args[:i].strip() else None
        return f"unterminated call to {match.group(1)}"


def _json_problem(payload: str) -> str | None:
    try:
        json.loads(payload)
    except json.JSONDecodeError as exc:
        return f"tool arguments do not parse: {exc.msg}"
    return None


class CompositeScorer:
    """The minimum of several scorers; a loop verdict from any of them carries over."""

    def __init__(self, scorers: Sequence[Scorer]) -> None:
        self.scorers = list(scorers)

    def score(self, history: Sequence[int], residual: Sequence[int]) -> Score:
        scores = [s.score(history, residual) for s in self.scorers]
        worst = min(scores, key=lambda s: s.value)
        return Score(worst.value, is_loop=any(s.is_loop for s in scores), reason=worst.reason)
