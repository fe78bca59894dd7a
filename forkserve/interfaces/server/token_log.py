"""TokenLog: one choice's record of its sampled tokens — the ``SampleLog`` the sampler fills.

Penalties read its history; logprobs are read from it as the tokens are delivered. Written
on the engine thread before the token is delivered, read on the event loop after, so a
reader never sees a token before its record. Created with the request, dropped with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SampledToken:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class TokenLog:
    def __init__(self, start: int) -> None:
        """``start``: the position of the first generated token (the prompt's length)."""
        self._start = start
        self._entries: list[SampledToken] = []

    def history(self, position: int) -> Sequence[int]:
        return [e.token for e in self._entries[: position - self._start]]

    def record(
        self, position: int, token: int, logprob: float, top: tuple[tuple[int, float], ...]
    ) -> None:
        # A position sampled again (the engine recomputed it) replaces what followed it.
        del self._entries[position - self._start :]
        self._entries.append(SampledToken(token, logprob, top))

    def entries(self, begin: int, end: int) -> list[SampledToken]:
        """Records of generated tokens ``begin..end`` (0 = the first generated token)."""
        return self._entries[begin:end]
