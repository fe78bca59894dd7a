"""TokenLog: one choice's record of its sampled tokens — the ``SampleLog`` the sampler fills.

Penalties read its history; logprobs are read from it as the tokens are delivered; prompt
logprobs are written during the prompt's prefill, before its first token is delivered. Written
on the engine thread before the token is delivered, read on the event loop after, so a
reader never sees a token before its record. Created with the request, dropped with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float | None  # None: nothing predicts it (a prompt's first token)
    top: tuple[tuple[int, float], ...]


class TokenLog:
    def __init__(self, start: int) -> None:
        """``start``: the position of the first generated token (the prompt's length)."""
        self._start = start
        self._entries: list[SampledToken] = []
        # Prompt log-probabilities (asked for by echo + logprobs): by position, filled by
        # the prefill (the first position stays None: nothing predicts it).
        self._prompt: list[SampledToken | None] = [None] * start

    def history(self, position: int) -> Sequence[int]:
        return [e.token for e in self._entries[: position - self._start]]

    def record(
        self, position: int, token: int, logprob: float, top: tuple[tuple[int, float], ...]
    ) -> None:
        # A position sampled again (the engine recomputed it) replaces what followed it.
        del self._entries[position - self._start :]
        self._entries.append(SampledToken(token, logprob, top))

    def record_prompt(
        self, position: int, token: int, logprob: float, top: tuple[tuple[int, float], ...]
    ) -> None:
        self._prompt[position] = SampledToken(token, logprob, top)

    def prompt_entries(self, prompt: Sequence[int]) -> list[SampledToken]:
        """Records of the prompt's tokens, by position; the first has no log-probability."""
        missing = [i for i, e in enumerate(self._prompt) if e is None and i > 0]
        if missing:  # an engine bug: the prefill of these positions never reported
            raise RuntimeError(f"no prompt log-probabilities for positions {missing[:5]}")
        return [SampledToken(prompt[0], None, ())] + list(self._prompt[1:])

    def entries(self, begin: int, end: int) -> list[SampledToken]:
        """Records of generated tokens ``begin..end`` (0 = the first generated token)."""
        return self._entries[begin:end]
