"""Judging fan-out candidates with full information, and the harness's choice of a winner.

``judge`` is what an exhaustive harness knows once every candidate is written out: the
model's mean log-probability of each candidate after the trunk (a prompt-logprob pass of
the Engine over the real model), the cascade's scorers on the *whole* candidate, and from
them the two verdicts a harness acts on: legal (the exact tool-call check) and a loop. The
cascade's thresholds (tau) are not the harness's: a legal call that shares its format's
boilerplate with the trunk scores low on 4-gram repetition and is still a fine next step.
``WinnerRule`` is the one place the winner is chosen: among the candidates a system kept,
the eligible one the model finds most likely. The exhaustive run
keeps every candidate; the cascade keeps what it did not prune, so whether its winner is
the exhaustive one is the quality side of the fan-out table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from forkserve.backend.protocol import SamplingParams
from forkserve.control.scorers import Scorer
from forkserve.engine import Engine

HISTORY = 1024  # the history the Engine's cascade shows its scorers (Engine.speculate)


@dataclass(frozen=True)
class Judged:
    mean_logprob: float  # the model's, per token of the candidate, after the trunk
    score: float         # the cascade's scorers on the whole candidate
    is_loop: bool
    reason: str
    legal: bool          # the legality scorer alone passes it
    eligible: bool       # legal and not a loop: a winner the harness would accept


class PromptLog:
    """A ``SampleLog`` that keeps only the prompt's log-probabilities (one judge request)."""

    def __init__(self) -> None:
        self.prompt: dict[int, float] = {}

    def history(self, position: int) -> Sequence[int]:
        return ()

    def record(self, position: int, token: int, logprob: float,
               top: tuple[tuple[int, float], ...]) -> None:
        pass  # the one token sampled after the prompt is not judged

    def record_prompt(self, position: int, token: int, logprob: float,
                      top: tuple[tuple[int, float], ...]) -> None:
        self.prompt[position] = logprob


def judge(engine: Engine, trunk: Sequence[int], candidates: Sequence[Sequence[int]],
          scorer: Scorer, legality: Scorer) -> list[Judged]:
    """Every candidate judged, their prompt-logprob passes batched in the engine's ticks.
    ``scorer``: the cascade's; ``legality``: its legality part (1.0: legal)."""
    logs, handles = [], []
    for cand in candidates:
        if not cand:
            raise ValueError("an empty candidate cannot be judged")
        logs.append(PromptLog())
        handles.append(engine.open(list(trunk) + list(cand), reuse_prefix=False))
        engine.start_generate(handles[-1].id, 1, sampling=SamplingParams(
            prompt_logprobs=0, log=logs[-1]))
    while any(engine.generation(h.id) is None for h in handles):
        engine.tick()
    history = list(trunk)[-HISTORY:]
    out = []
    for cand, log, h in zip(candidates, logs, handles, strict=True):
        engine.close(h.id)
        positions = range(len(trunk), len(trunk) + len(cand))
        missing = [p for p in positions if p not in log.prompt]
        if missing:
            raise RuntimeError(f"the engine reported no log-probability at {missing[:5]}")
        verdict = scorer.score(history, cand)
        legal = legality.score(history, cand).value >= 1.0
        out.append(Judged(round(sum(log.prompt[p] for p in positions) / len(cand), 4),
                          verdict.value, verdict.is_loop, verdict.reason, legal,
                          legal and not verdict.is_loop))
    return out


@dataclass(frozen=True)
class WinnerRule:
    """The eligible kept candidate of highest mean log-probability (ties: the lower index);
    with none eligible, the lowest kept index (the harness's prior)."""

    def choose(self, judged: Sequence[Judged], kept: Iterable[int]) -> int:
        kept = sorted(kept)
        if not kept:
            raise ValueError("no candidate was kept: the cascade always keeps index 0")
        eligible = [i for i in kept if judged[i].eligible]
        if not eligible:
            return kept[0]
        return max(eligible, key=lambda i: (judged[i].mean_logprob, -i))
