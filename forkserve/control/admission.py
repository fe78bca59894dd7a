"""Admission rules (``admit_mode``): which guessed residuals of one fan-out may use GPU.

One rule is on at a time. Each is a small strategy: given a candidate and the siblings
already admitted from the same parent, admit or not. The winner (index 0) and known
suffixes (p = 1) never reach a rule: the cascade always keeps them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from forkserve.config import AdmitMode, ForkServeConfig


@dataclass(frozen=True)
class Candidate:
    index: int       # position among the parent's children; 0 is the winner
    priority: float  # the harness's prior that this residual is the one committed
    score: float     # the scorers' verdict


class AdmissionRule(Protocol):
    def admit(self, candidate: Candidate, admitted: Sequence[Candidate]) -> bool: ...


class ScoreRule:
    """Everything is admitted here; the cascade's thresholds (tau_pre, tau) do the work."""

    def admit(self, candidate: Candidate, admitted: Sequence[Candidate]) -> bool:
        return True


class WinnerRule:
    def admit(self, candidate: Candidate, admitted: Sequence[Candidate]) -> bool:
        return candidate.index == 0


@dataclass(frozen=True)
class TopMRule:
    m: int

    def admit(self, candidate: Candidate, admitted: Sequence[Candidate]) -> bool:
        return len(admitted) < self.m


@dataclass(frozen=True)
class AlphaRule:
    """Admit until the admitted residuals' prior mass reaches alpha."""

    alpha: float

    def admit(self, candidate: Candidate, admitted: Sequence[Candidate]) -> bool:
        return sum(c.priority for c in admitted) < self.alpha


def make_rule(config: ForkServeConfig) -> AdmissionRule:
    match config.admit_mode:
        case AdmitMode.SCORE:
            return ScoreRule()
        case AdmitMode.WINNER:
            return WinnerRule()
        case AdmitMode.TOP_M:
            return TopMRule(config.grammar_top_m)
        case AdmitMode.ALPHA:
            return AlphaRule(config.admit_alpha)
    raise ValueError(f"unknown admit_mode {config.admit_mode!r}")
